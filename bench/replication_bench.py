"""Benchmark of replica groups (docs/replication.md) beside a lone broker, in one run: what
replication costs a send (rate, latency, CPU of each replica) and how long a group takes to
serve again after ``kill -9`` of its leader.

Every service is a separate process (``python -m apogee_nameserver``, ``python -m
apogee_broker``) on free ports of 127.0.0.1 (metrics too), not the defaults, with async flush;
each setup has a nameserver of its own and is stopped before the next one starts. A replica
group is three brokers of one broker name, each with its own data folder (``replicas = 3``,
``min_insync_replicas = 2``), leadership in a shared folder (``replication = "file"``) unless
the case says otherwise; the leader and the followers are found by asking each replica
``apogee.v1.Replication/DescribeReplica``. Apogee's SDK ``Producer`` runs in this process and
sends 1 KiB bodies with a tag to a topic of 8 queues.

Prints one JSON object per line (see ``figures.emit``), plus ``client_cpu_s``, the CPU
seconds of each broker process, read from /proc, and the same per acknowledged message
(``*_cpu_us_per_msg``: CPU microseconds). A follower's CPU is counted until its log has
caught up with the leader's; ``follower_cpu_us_per_msg`` is the mean of the two followers,
``group_cpu_us_per_msg`` the three replicas together.

Cases:

- ``lone_async``: one lone broker; ``send_nowait`` with at most ``--window`` (4,096) sends
  unsettled (``load.windowed_sends``), the latency of one send in 16; ``broker_cpu_*``.
- ``replicas_acks_leader``: the same load on a replica group with ``acks = "leader"`` (a send
  is answered once the leader stored it; the followers copy behind); ``leader_cpu_*``,
  ``follower_cpu_*``, and ``vs_lone`` (its rate over ``lone_async``'s).
- ``replicas_acks_all``: the same with ``acks = "all"`` (a send is answered once the in-sync
  set holds it); ``vs_lone`` (the design's target: at least 0.5).
- ``latency_at_2000_lone``, ``latency_at_2000_acks_all``: sends started on a schedule of
  2,000 per second for ``--paced-seconds`` (10; 3 with ``--quick``), each ``send`` awaited in
  a task of its own (an open loop: a slow send does not delay the next), on the lone broker
  and on the ``acks = "all"`` group; latency of one send. The second line adds
  ``added_p50_us`` and ``added_p99_us``: its p50 and p99 minus the lone broker's.
- ``failover``: a group with ``acks = "all"`` under a light paced load (``--failover-rate``,
  200 sends a second, each in its own task); its leader is killed with SIGKILL ``--kills``
  times (10; 3 with ``--quick``), and the killed replica is started again and caught up
  before the next kill. A failover lasts from the kill to the end of the first acknowledged
  send that started after it: ``failover_median_s``, ``failover_p99_s``, ``failover_max_s``
  (and each in ``failovers_s``); p50/p99 are of the sends, the slow ones through the
  failovers included. Leadership is in a real etcd (``coordination: "etcd"``, as in
  production; ``--lease-s``, the broker's default 2 s, bounds the failover from below) when
  the ``etcd`` program is installed, else in the shared folder (``coordination: "file"``, the
  line says why).

On two cores the three replicas and the producer share the machine, so a group's rate is what
four busy processes on two cores allow, not what three machines would.

    python bench/replication_bench.py            # full run (about four minutes)
    python bench/replication_bench.py --quick    # about a minute and a half
    python bench/replication_bench.py --no-failover   # the send path only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from figures import ProcessMeter, emit, loop_name, paced, percentile, run_async
from load import create_topics, windowed_sends

from apogee.client import AdminClient, Message, Producer
from apogee.common.errors import ApogeeError
from apogee.rpc.server import CLIENT_OPTIONS, check_health
from apogee.testkit.etcd import EtcdServer
from apogee.testkit.ports import free_port
from apogee.testkit.processes import ServiceProcess
from apogee.testkit.waiting import eventually
from apogee.v1 import replication_pb2, replication_pb2_grpc

BODY = 1024
TAG = "TagA"
TOPIC = "BenchReplicated"
BROKER = "broker-a"
WARM_UP = 200
#: async sends: the latency of one in SAMPLE is measured
SAMPLE = 16
#: how long a process may take to serve, a group to elect or to catch up
START_TIMEOUT_S = 60.0
#: how long a stopped process may take to exit before it is killed
STOP_TIMEOUT_S = 10.0

#: every broker of the run, lone or replica: async flush, a short grace at SIGTERM
BROKER_ENV: Mapping[str, str] = {
    "APOGEE_BROKER_FLUSH_MODE": "async",
    "APOGEE_BROKER_SHUTDOWN_GRACE_S": "1",
}
NAMESERVER_ENV: Mapping[str, str] = {"APOGEE_NAMESERVER_SHUTDOWN_GRACE_S": "1"}


# -- the processes ------------------------------------------------------------------------------


@dataclass
class Broker:
    """One broker process of ``broker-a`` (a lone broker or one replica), at a fixed free port
    so that a restarted replica comes back at the same address."""

    index: int
    root: Path
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    proc: ServiceProcess | None = None
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None

    def meter(self) -> ProcessMeter:
        assert self.proc is not None, f"broker {self.index} is not started"
        return ProcessMeter(self.proc.proc.pid)

    def start(self, namesrv: str) -> None:
        """Start (or start again; each start logs to ``broker-N.K.log``)."""
        self.starts += 1
        args = [
            *("--listen", self.address),
            *("--name", BROKER),
            *("--data-dir", str(self.root / f"broker-{self.index}")),
            *("--namesrv", namesrv),
        ]
        log = self.root / f"broker-{self.index}.{self.starts}.log"
        self.proc = ServiceProcess("apogee_broker", args, log, self.env)

    def kill(self) -> float:
        """``kill -9``; the monotonic time of the kill."""
        assert self.proc is not None, f"broker {self.index} is not started"
        at = time.monotonic()
        self.proc.kill()
        return at


def stop_all(procs: list[ServiceProcess]) -> None:
    """SIGTERM to every process still running, then SIGKILL to those that outstay
    :data:`STOP_TIMEOUT_S`."""
    running = [p for p in procs if p.proc.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in running:
        try:
            p.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


Description = replication_pb2.DescribeReplicaResponse


class Setup:
    """A nameserver and ``broker-a``: one lone broker (``replication="none"``) or a group of
    three replicas (``"file"`` or ``"etcd"``) with ``acks``; ``await setup.start()``, and
    :meth:`close` stops every process, however the run ended."""

    def __init__(
        self,
        root: Path,
        replication: str = "none",
        acks: str = "all",
        etcd_endpoint: str = "",
        lease_s: float = 2.0,
    ) -> None:
        self.root = root
        self.replication = replication
        self.acks = acks
        self.namesrv = f"127.0.0.1:{free_port()}"
        self.nameserver: ServiceProcess | None = None
        base = dict(BROKER_ENV)
        if replication != "none":
            base |= {
                "APOGEE_BROKER_REPLICATION": replication,
                "APOGEE_BROKER_REPLICAS": "3",
                "APOGEE_BROKER_ACKS": acks,
                "APOGEE_BROKER_MIN_INSYNC_REPLICAS": "2",
            }
            if replication == "file":
                base["APOGEE_BROKER_REPLICA_GROUP_DIR"] = str(root / "group")
            else:
                base["APOGEE_BROKER_ETCD_ENDPOINTS"] = etcd_endpoint
                base["APOGEE_BROKER_REPLICA_LEASE_S"] = str(lease_s)
        count = 1 if replication == "none" else 3
        self.brokers = [
            Broker(i, root, {**base, "APOGEE_BROKER_METRICS_LISTEN": f"127.0.0.1:{free_port()}"})
            for i in range(count)
        ]

    @property
    def replicated(self) -> bool:
        return self.replication != "none"

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.nameserver = ServiceProcess(
            "apogee_nameserver",
            ["--listen", self.namesrv],
            self.root / "nameserver.log",
            NAMESERVER_ENV,
        )
        await self.nameserver.wait(
            lambda: check_health(self.namesrv, 1.0), "the nameserver SERVING", START_TIMEOUT_S
        )
        for b in self.brokers:
            b.start(self.namesrv)
        if self.replicated:
            await self.wait_in_sync(len(self.brokers))
        else:
            broker = self.brokers[0]
            assert broker.proc is not None
            await broker.proc.wait(
                lambda: check_health(broker.address, 1.0), "the broker SERVING", START_TIMEOUT_S
            )
        async with AdminClient(self.namesrv) as admin:

            async def registered() -> bool:
                return any(b.broker_name == BROKER for b in await admin.cluster_info())

            await eventually(
                registered, START_TIMEOUT_S, f"{BROKER} registered", every=0.1, detail=self.logs
            )
        await create_topics(self.namesrv, [TOPIC], 8)

    def close(self) -> None:
        stop_all([b.proc for b in self.brokers if b.proc is not None])
        if self.nameserver is not None:
            stop_all([self.nameserver])

    def logs(self, lines: int = 20) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"==> {path.name} <==\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- roles ----------------------------------------------------------------------------------

    async def describe(self, b: Broker) -> Description | None:
        """``DescribeReplica`` of ``b``; None when it does not answer."""
        if not b.alive:
            return None
        async with grpc.aio.insecure_channel(b.address, options=CLIENT_OPTIONS) as ch:
            stub = replication_pb2_grpc.ReplicationStub(ch)
            try:
                reply: Description = await stub.DescribeReplica(
                    replication_pb2.DescribeReplicaRequest(), timeout=1.0
                )
            except grpc.aio.AioRpcError:
                return None
            return reply

    async def described(self) -> list[tuple[Broker, Description | None]]:
        answers = await asyncio.gather(*(self.describe(b) for b in self.brokers))
        return list(zip(self.brokers, answers, strict=True))

    async def roles(self) -> tuple[Broker, list[Broker]]:
        """The leader and the followers (a lone broker: itself and none)."""
        if not self.replicated:
            return self.brokers[0], []
        leader = await self.wait_leader()
        return leader, [b for b in self.brokers if b is not leader]

    async def wait_leader(self, not_: Broker | None = None) -> Broker:
        found: list[Broker] = []

        async def led() -> bool:
            for b, d in await self.described():
                if d is not None and d.role == "LEADER" and b is not not_:
                    found.append(b)
                    return True
            return False

        await eventually(
            led, START_TIMEOUT_S, "a leader of the group", every=0.05, detail=self.logs
        )
        return found[-1]

    async def wait_in_sync(self, size: int) -> None:
        async def in_sync() -> bool:
            return any(
                d is not None and d.role == "LEADER" and len(d.in_sync) >= size
                for _, d in await self.described()
            )

        await eventually(
            in_sync, START_TIMEOUT_S, f"{size} replicas in sync", every=0.05, detail=self.logs
        )

    async def wait_caught_up(self) -> None:
        """Until every follower's log ends where the leader's does."""

        async def caught_up() -> bool:
            answers = [d for _, d in await self.described()]
            ends = {d.log_end for d in answers if d is not None}
            return len(ends) == 1 and all(d is not None for d in answers)

        await eventually(
            caught_up, START_TIMEOUT_S, "the followers caught up", every=0.05, detail=self.logs
        )


# -- the cases ----------------------------------------------------------------------------------


def message() -> Message:
    return Message(TOPIC, os.urandom(BODY), tags=TAG)


class Mark:
    """The CPU seconds of this process and of each broker of ``setup`` (its leader and its
    followers) from a starting point; :meth:`figures` makes a line's fields of them."""

    def __init__(self, setup: Setup, leader: Broker, followers: list[Broker]) -> None:
        self.setup, self.leader, self.followers = setup, leader, followers
        self.meters = {b.index: b.meter() for b in [leader, *followers]}
        self.cpu0 = {i: m.cpu_s() for i, m in self.meters.items()}
        self.client0 = time.process_time()

    async def figures(self, messages: int) -> dict[str, Any]:
        """``client_*`` until now; ``broker_*`` (a lone broker), or ``leader_*``,
        ``follower_*`` and ``group_*`` until the followers have caught up; the setup."""
        client = time.process_time() - self.client0
        if self.followers:
            await self.setup.wait_caught_up()
        cpu = {i: m.cpu_s() - self.cpu0[i] for i, m in self.meters.items()}
        per = 1e6 / messages if messages else 0.0
        out: dict[str, Any] = {
            "client_cpu_s": round(client, 2),
            "client_cpu_us_per_msg": round(client * per, 1),
        }
        lead = cpu[self.leader.index]
        if not self.followers:
            out |= {"broker_cpu_s": round(lead, 2), "broker_cpu_us_per_msg": round(lead * per, 1)}
            return out | {"setup": "lone broker"}
        each = [cpu[f.index] for f in self.followers]
        return out | {
            "leader_cpu_s": round(lead, 2),
            "leader_cpu_us_per_msg": round(lead * per, 1),
            "follower_cpu_s": [round(c, 2) for c in each],
            "follower_cpu_us_per_msg": round(statistics.mean(each) * per, 1),
            "group_cpu_us_per_msg": round((lead + sum(each)) * per, 1),
            **setup_fields(self.setup),
        }


def setup_fields(setup: Setup) -> dict[str, Any]:
    return {
        "setup": "3 replicas",
        "coordination": setup.replication,
        "acks": setup.acks,
        "min_insync_replicas": 2,
    }


async def case_async(
    case: str, setup: Setup, count: int, window: int, lone_rate: float | None
) -> float:
    """``count`` windowed sends; prints the line, returns the rate."""
    msg = message()
    leader, followers = await setup.roles()
    async with Producer(setup.namesrv, group=f"bench-{case.replace('_', '-')}") as producer:
        await asyncio.gather(*(producer.send(msg) for _ in range(WARM_UP)))
        req0 = producer.stats().requests
        mark = Mark(setup, leader, followers)
        sent = await windowed_sends(producer, msg, count, window, SAMPLE, settle_timeout_s=300)
        requests = producer.stats().requests - req0
    acked = count - sent.errors
    rate = acked / sent.seconds if sent.seconds else 0.0
    extra = {"vs_lone": round(rate / lone_rate, 2)} if lone_rate else {}
    emit(
        case,
        acked,
        BODY,
        sent.seconds,
        sent.latencies,
        errors=sent.errors,
        window=window,
        msgs_per_request=round(count / requests, 1) if requests else None,
        **await mark.figures(acked),
        **extra,
        latency_of=f"send_nowait to its result (one send in {SAMPLE})",
    )
    return rate


async def case_paced(
    case: str, setup: Setup, rate: int, seconds: float, lone: tuple[float, float] | None
) -> tuple[float, float]:
    """Sends on a schedule of ``rate`` a second for ``seconds``, each awaited in its own task;
    prints the line (with what it adds to ``lone``'s p50 and p99, in seconds), returns its own
    p50 and p99 in seconds."""
    msg = message()
    count = int(rate * seconds)
    leader, followers = await setup.roles()
    lat: list[float] = []
    errors = late = 0
    perf = time.perf_counter
    async with Producer(setup.namesrv, group=f"bench-{case.replace('_', '-')}") as producer:
        await asyncio.gather(*(producer.send(msg) for _ in range(WARM_UP)))
        req0 = producer.stats().requests

        async def one() -> None:
            nonlocal errors
            t = perf()
            try:
                await producer.send(msg)
            except ApogeeError:
                errors += 1
                return
            lat.append(perf() - t)

        tasks: set[asyncio.Task[None]] = set()
        mark = Mark(setup, leader, followers)
        t0 = perf()
        async for behind in paced(rate, count):
            late += behind
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
        elapsed = perf() - t0
        requests = producer.stats().requests - req0
    lat.sort()
    own = (percentile(lat, 0.50), percentile(lat, 0.99))
    extra: dict[str, Any] = {}
    if lone is not None:
        extra["added_p50_us"] = round((own[0] - lone[0]) * 1e6, 1)
        extra["added_p99_us"] = round((own[1] - lone[1]) * 1e6, 1)
    emit(
        case,
        len(lat),
        BODY,
        elapsed,
        lat,
        target_rate=rate,
        started_late=late,
        errors=errors,
        msgs_per_request=round(count / requests, 1) if requests else None,
        **await mark.figures(len(lat)),
        **extra,
        latency_of="one send, each started on schedule in its own task",
    )
    return own


@dataclass
class LightLoad:
    """Sends on a schedule of ``rate`` a second, each in its own task, until :attr:`stop` is
    set; the monotonic start and end of each acknowledged send in :attr:`acks` (in the order
    they ended)."""

    producer: Producer
    rate: int
    acks: list[tuple[float, float]] = field(default_factory=list)
    errors: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        msg = message()
        tasks: set[asyncio.Task[None]] = set()

        async def one() -> None:
            began = time.monotonic()
            try:
                await self.producer.send(msg)
            except ApogeeError:
                self.errors += 1
                return
            self.acks.append((began, time.monotonic()))

        async for _ in paced(self.rate, 1 << 40):
            if self.stop.is_set():
                break
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait_for(asyncio.gather(*tasks), 60)

    async def until_acked(self, more: int, what: str, detail: Callable[[], str]) -> None:
        target = len(self.acks) + more
        await eventually(
            lambda: len(self.acks) >= target, START_TIMEOUT_S, what, every=0.02, detail=detail
        )


async def failover_kills(setup: Setup, kills: int, rate: int) -> dict[str, Any]:
    """Kill the leader ``kills`` times under a :class:`LightLoad`; the line's figures."""
    failovers: list[float] = []
    # routes read every 0.5 s besides after a failure, as in the end-to-end test
    async with Producer(setup.namesrv, group="bench-failover", route_refresh_interval=0.5) as p:
        load = LightLoad(p, rate)
        t0 = time.perf_counter()
        sending = asyncio.create_task(load.run())
        try:
            await load.until_acked(rate, "the load acknowledged", setup.logs)
            for k in range(kills):
                old = await setup.wait_leader()
                seen = len(load.acks)
                killed_at = old.kill()
                await setup.wait_leader(not_=old)

                def after_kill(seen: int = seen, at: float = killed_at) -> float | None:
                    ends = [end for began, end in load.acks[seen:] if began > at]
                    return min(ends) if ends else None

                await eventually(
                    lambda: after_kill() is not None,
                    START_TIMEOUT_S,
                    f"a send acknowledged after kill {k + 1}",
                    every=0.02,
                    detail=setup.logs,
                )
                first = after_kill()
                assert first is not None
                failovers.append(first - killed_at)
                old.start(setup.namesrv)  # back as a follower, catching up
                await setup.wait_in_sync(3)
                await load.until_acked(rate // 4, f"the load after kill {k + 1}", setup.logs)
        finally:
            load.stop.set()
            await asyncio.wait_for(sending, 90)
        seconds = time.perf_counter() - t0
    failovers.sort()
    lat = [end - began for began, end in load.acks]
    return {
        "messages": len(lat),
        "seconds": seconds,
        "lat": lat,
        "errors": load.errors,
        "failover_median_s": round(statistics.median(failovers), 3),
        "failover_p99_s": round(percentile(failovers, 0.99), 3),
        "failover_max_s": round(failovers[-1], 3),
        "failovers_s": [round(f, 3) for f in failovers],
    }


async def case_failover(root: Path, kills: int, rate: int, lease_s: float) -> None:
    etcd_path = shutil.which("etcd")
    with contextlib.ExitStack() as stack:
        if etcd_path is not None:
            etcd = stack.enter_context(EtcdServer(root / "etcd"))
            setup = Setup(root, "etcd", "all", etcd_endpoint=etcd.endpoint, lease_s=lease_s)
            how: dict[str, Any] = {"coordination": "etcd", "replica_lease_s": lease_s}
        else:
            setup = Setup(root, "file", "all")
            how = {"coordination": "file", "why_file": "etcd is not installed"}
        stack.callback(setup.close)
        await setup.start()
        got = await failover_kills(setup, kills, rate)
    emit(
        "failover",
        got.pop("messages"),
        BODY,
        got.pop("seconds"),
        got.pop("lat"),
        kills=kills,
        load_rate=rate,
        **got,
        **{**setup_fields(setup), **how},
        latency_of="one acknowledged send of the light load, the failovers included",
    )


# -- the run ------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, data: Path) -> None:
    lone = Setup(data / "lone")
    try:
        await lone.start()
        lone_rate = await case_async("lone_async", lone, args.messages, args.window, None)
        lone_paced = await case_paced(
            f"latency_at_{args.rate}_lone", lone, args.rate, args.paced_seconds, None
        )
    finally:
        lone.close()

    group = Setup(data / "acks-leader", "file", "leader")
    try:
        await group.start()
        await case_async("replicas_acks_leader", group, args.messages, args.window, lone_rate)
    finally:
        group.close()

    group = Setup(data / "acks-all", "file", "all")
    try:
        await group.start()
        await case_async("replicas_acks_all", group, args.messages, args.window, lone_rate)
        await case_paced(
            f"latency_at_{args.rate}_acks_all", group, args.rate, args.paced_seconds, lone_paced
        )
    finally:
        group.close()

    if not args.no_failover:
        await case_failover(data / "failover", args.kills, args.failover_rate, args.lease_s)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller runs, about 90 s in all")
    ap.add_argument("--messages", type=int, default=None, help="sends per throughput case")
    ap.add_argument("--window", type=int, default=4096, help="unsettled sends (throughput)")
    ap.add_argument("--rate", type=int, default=2000, help="sends a second of the paced cases")
    ap.add_argument("--paced-seconds", type=float, default=None, help="length of a paced case")
    ap.add_argument("--kills", type=int, default=None, help="leader kills in the failover case")
    ap.add_argument("--failover-rate", type=int, default=200, help="sends a second (failover)")
    ap.add_argument("--lease-s", type=float, default=2.0, help="replica_lease_s of the etcd group")
    ap.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default=None,
        help="this process's event loop (default: uvloop when installed)",
    )
    ap.add_argument("--dir", default=None, help="where to put the data (default: a temp dir)")
    ap.add_argument(
        "--no-failover",
        action="store_true",
        help="skip the failover case (to compare the send path before and after a change)",
    )
    args = ap.parse_args()
    args.messages = args.messages or (20_000 if args.quick else 200_000)
    args.paced_seconds = args.paced_seconds or (3.0 if args.quick else 10.0)
    args.kills = args.kills or (3 if args.quick else 10)
    base = Path(args.dir or tempfile.gettempdir())
    data = Path(tempfile.mkdtemp(prefix="replication-bench-", dir=base))
    try:
        run_async(run(args, data), loop_name(args.loop))
    finally:
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
