"""How a broker's and a nameserver's costs grow with the work they hold: topics, touched
queues and consumer groups, each at a series of steps, against a real cluster
(``apogee.local.cluster``: one nameserver and one broker as processes, async flush, free ports;
a fresh data directory at each step).

Axis ``topics`` (100, 1,000, 10,000, 50,000 by default; 8 queues each). At each step:

- ``create_s``, ``creates_per_s``: creating the topics, ``--concurrency`` ``PutTopic`` calls at
  a time straight to the broker (what ``AdminClient.create_or_update_topic`` sends to each
  broker), and ``known_s``: until the nameserver lists them all;
- ``broker_rss_mb``, ``broker_fds``, ``broker_maps``: the broker's resident memory, open files
  and memory maps with the topics created and idle (nothing sent); ``broker_fd_limit``: its
  limit on open files;
- ``register_bytes``, ``register_ms``: the size of the broker's registration with every topic
  (what it sends after a change) and the nameserver's time to answer it (median of 5);
  ``heartbeat_bytes``, ``heartbeat_ms``: the same for a heartbeat with nothing changed (the
  short form, which carries no topics);
- ``route_p50_ms``, ``route_p99_ms``: ``GetRoute`` of random topics, one at a time;
- ``send_per_s``, ``send_p99_ms``, ``read_per_s``: a fixed load on one topic
  (``--messages`` of 1 KiB through a ``Producer``, at most 1,000 unsettled; then read back
  with a ``QueueReader``);
- ``touched_rss_mb``, ``touched_fds``, ``touched_maps``, ``per_touched_queue_kib``: the same
  once every queue of every topic has had one message (and is idle again), and the memory one
  such queue costs; ``touch_errors``: sends that failed (a wall: files or maps run out);
- ``recovery_s``, ``recovery_known_s``: after ``kill -9`` of the broker, until it answers
  again, and until the nameserver lists every topic again.

Axis ``groups`` (10, 1,000, 10,000): each group commits an offset on every queue of one topic
(``AdminClient.commit_offsets``); ``commit_s``, ``offsets_file_kib`` (what the broker keeps on
disk for them), ``broker_rss_mb``, and ``persist_bytes``: what the broker writes to its data
directory to persist one group's changed offset (the files' growth and rewrites between two
persistences, with the broker otherwise idle).

Prints one JSON object per step (the figures above, with ``axis`` and ``step``) and, at the end,
one table per axis: the curve of each figure against the axis.

    python bench/scale_bench.py                       # both axes, default steps
    python bench/scale_bench.py --axis topics --steps 100,1000
    python bench/scale_bench.py --quick               # 100 and 1,000 topics; 10 and 1,000 groups
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from figures import percentile, run_async
from load import windowed_sends

from apogee.client import AdminClient, Message, MessageQueue, Producer, QueueReader
from apogee.common.topics import READ_WRITE
from apogee.local import cluster as local_cluster
from apogee.testkit.waiting import eventually
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    nameserver_pb2,
    nameserver_pb2_grpc,
)

QUEUES = 8
BODY = b"x" * 1024
DEFAULT_STEPS = {"topics": [100, 1_000, 10_000, 50_000], "groups": [10, 1_000, 10_000]}
QUICK_STEPS = {"topics": [100, 1_000], "groups": [10, 1_000]}
#: the broker writes offsets this often here (the default is 5 s), so a step waits less
PERSIST_INTERVAL_S = 1.0
#: the gRPC answer size limit of the benchmark's own calls (a 50,000-topic listing is large)
MAX_MESSAGE = 256 << 20
OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]


# -- what /proc says of a process ---------------------------------------------------------------


def proc_facts(pid: int) -> dict[str, float]:
    """Resident memory (MiB), open files and memory maps of process ``pid``."""
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/maps", "rb") as f:
        maps = sum(1 for _ in f)
    return {"rss_mb": round(rss_kib / 1024, 1), "fds": fds, "maps": maps}


def fd_limit(pid: int) -> int:
    """Process ``pid``'s limit on open files (the soft one, which it meets first)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    return 0


def dir_bytes(root: Path) -> dict[str, tuple[int, int, float]]:
    """Every file under ``root``: its size, inode and modification time."""
    out: dict[str, tuple[int, int, float]] = {}
    for p in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            if p.is_file():
                out[str(p.relative_to(root))] = (st.st_size, st.st_ino, st.st_mtime)
    return out


# -- a cluster per step -------------------------------------------------------------------------


class Step:
    """A fresh one-broker cluster in its own directory; ``with Step(...) as s:``."""

    def __init__(self, base: Path, name: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"scale-{name}-", dir=base))
        env = {"APOGEE_BROKER_OFFSET_PERSIST_INTERVAL_S": str(PERSIST_INTERVAL_S)}
        self.state = local_cluster.up(
            self.dir,
            brokers=1,
            nameservers=1,
            flush_mode="async",
            broker_env=env,
            schedule=False,
            txn_checker=False,
            console=False,
        )
        self.broker = self.state.brokers[0]
        self.env = env

    @property
    def namesrv(self) -> str:
        return self.state.namesrv

    @property
    def pid(self) -> int:
        return self.broker.pid

    def restart_broker_after_kill(self) -> float:
        """``kill -9`` the broker, start it again; seconds until it is up and registered."""
        os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        t0 = time.perf_counter()
        self.state = local_cluster.up(
            self.dir,
            brokers=1,
            nameservers=1,
            flush_mode="async",
            broker_env=self.env,
            schedule=False,
            txn_checker=False,
            console=False,
            timeout=600,
        )
        self.broker = self.state.brokers[0]
        return time.perf_counter() - t0

    def broker_alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return Path(f"/proc/{self.pid}/status").read_text().find("State:\tZ") < 0

    def __enter__(self) -> Step:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            local_cluster.down(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)


async def bounded(concurrency: int, calls: Iterable[Callable[[], Awaitable[Any]]]) -> None:
    """Run ``calls``, at most ``concurrency`` at a time; the first failure is raised."""
    room = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        async with room:
            await call()

    await asyncio.gather(*(one(c) for c in calls))


async def nameserver_lists(namesrv: str, wanted: set[str], timeout: float) -> float:
    """Seconds until the nameserver lists every topic of ``wanted``."""
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(namesrv, options=OPTIONS) as ch:
        stub = nameserver_pb2_grpc.NameServerStub(ch)

        async def known() -> bool:
            got = await stub.ListTopics(nameserver_pb2.ListTopicsRequest(), timeout=60)
            return wanted <= set(got.topics)

        await eventually(known, timeout, f"the nameserver lists {len(wanted)} topics", every=0.2)
    return time.perf_counter() - t0


# -- axis: topics -------------------------------------------------------------------------------


def topic_names(n: int) -> list[str]:
    return [f"ScaleTopic{i:05d}" for i in range(n)]


async def create(broker: str, names: list[str], concurrency: int) -> float:
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(broker, options=OPTIONS) as ch:
        stub = broker_pb2_grpc.BrokerAdminStub(ch)

        def put(name: str) -> Callable[[], Awaitable[Any]]:
            config = common_pb2.TopicConfig(
                name=name, read_queues=QUEUES, write_queues=QUEUES, perm=int(READ_WRITE)
            )
            return lambda: stub.PutTopic(broker_pb2.PutTopicRequest(topic=config), timeout=600)

        await bounded(concurrency, (put(n) for n in names))
    return time.perf_counter() - t0


async def registration(step: Step) -> dict[str, Any]:
    """The broker's registration with every topic, sent to the nameserver as a heartbeat sends
    it: its size, and the nameserver's time to answer it."""
    async with (
        grpc.aio.insecure_channel(step.broker.address, options=OPTIONS) as bch,
        grpc.aio.insecure_channel(step.namesrv, options=OPTIONS) as nch,
    ):
        listed = await broker_pb2_grpc.BrokerAdminStub(bch).ListTopics(
            broker_pb2.BrokerListTopicsRequest(include_system=True), timeout=60
        )
        ns = nameserver_pb2_grpc.NameServerStub(nch)
        info = await ns.GetClusterInfo(nameserver_pb2.GetClusterInfoRequest(), timeout=60)
        me = next(b for b in info.brokers if b.address == step.broker.address)
        request = nameserver_pb2.RegisterBrokerRequest(
            cluster=me.cluster,
            broker_name=me.broker_name,
            address=me.address,
            topics=list(listed.topics),
            heartbeat_interval_ms=30_000,
            auto_create_topics=me.auto_create_topics,
            epoch=me.epoch,
        )
        full = await median_s(lambda: ns.RegisterBroker(request, timeout=60))
        # a heartbeat with nothing changed: the short form, at the version just registered
        short = nameserver_pb2.RegisterBrokerRequest(
            cluster=me.cluster,
            broker_name=me.broker_name,
            address=me.address,
            heartbeat_interval_ms=30_000,
            auto_create_topics=me.auto_create_topics,
            epoch=me.epoch,
            topics_unchanged=True,
            topics_version=request.topics_version,
        )
        answer = await ns.RegisterBroker(short, timeout=60)
        assert not answer.topics_needed, "the nameserver refused a short heartbeat"
        quick = await median_s(lambda: ns.RegisterBroker(short, timeout=60))
    # (the broker's own next heartbeat, at its version, is refused and followed by its topics)
    return {
        "register_topics": len(listed.topics),
        "register_bytes": request.ByteSize(),
        "register_ms": round(full * 1000, 2),
        "heartbeat_bytes": short.ByteSize(),
        "heartbeat_ms": round(quick * 1000, 2),
    }


async def median_s(call: Callable[[], Awaitable[Any]], times: int = 5) -> float:
    """The median seconds ``call()`` takes, of ``times``."""
    took = []
    for _ in range(times):
        t0 = time.perf_counter()
        await call()
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


async def routes(namesrv: str, names: list[str], lookups: int) -> dict[str, Any]:
    rng = random.Random(7)
    lat = []
    async with grpc.aio.insecure_channel(namesrv, options=OPTIONS) as ch:
        stub = nameserver_pb2_grpc.NameServerStub(ch)
        for _ in range(lookups):
            topic = rng.choice(names)
            t0 = time.perf_counter()
            await stub.GetRoute(nameserver_pb2.GetRouteRequest(topic=topic), timeout=10)
            lat.append(time.perf_counter() - t0)
    lat.sort()
    return {
        "route_p50_ms": round(percentile(lat, 0.5) * 1000, 3),
        "route_p99_ms": round(percentile(lat, 0.99) * 1000, 3),
    }


async def fixed_load(namesrv: str, topic: str, messages: int) -> dict[str, Any]:
    async with Producer(namesrv) as producer:
        sent = await windowed_sends(producer, Message(topic, BODY), messages, 1_000, sample=16)
    lat = sorted(sent.latencies)
    t0 = time.perf_counter()
    read = 0
    async with QueueReader(namesrv) as reader:
        for q in await reader.queues(topic):
            bounds = await reader.offsets(q)
            async for _ in reader.read(q, bounds.min_offset, bounds.max_offset):
                read += 1
    read_s = time.perf_counter() - t0
    return {
        "send_per_s": round(messages / sent.seconds),
        "send_p99_ms": round(percentile(lat, 0.99) * 1000, 2),
        "send_errors": sent.errors,
        "read_per_s": round(read / read_s) if read_s else 0,
        "read": read,
    }


async def touch_every_queue(namesrv: str, names: list[str]) -> int:
    """One message to each queue of every topic (the producer takes a topic's queues in turn);
    the sends that failed."""
    errors = 0
    pending: list[Awaitable[Any]] = []
    async with Producer(namesrv, send_timeout=30) as producer:
        for i, name in enumerate(names):
            msg = Message(name, b"t")
            pending += (producer.send(msg) for _ in range(QUEUES))
            if len(pending) >= 4_000 or i == len(names) - 1:
                outcomes = await asyncio.gather(*pending, return_exceptions=True)
                errors += sum(isinstance(o, BaseException) for o in outcomes)
                pending = []
    if errors:
        return errors  # a wall was met: what it left is measured as it is
    # the store indexes a large backlog on its dispatch thread: wait until the last topic's
    # queues show their message (indexing goes in CommitLog order, so every queue then has)
    async with QueueReader(namesrv) as reader:
        last = await reader.queues(names[-1])

        async def indexed() -> bool:
            return all([(await reader.offsets(q)).max_offset >= 1 for q in last])

        await eventually(indexed, 300, f"{names[-1]}'s queues indexed", every=0.1)
    return errors


def axis_topics(base: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    names = topic_names(n)
    row: dict[str, Any] = {"axis": "topics", "step": n, "queues": n * QUEUES}
    with Step(base, f"topics-{n}") as step:
        idle_before = proc_facts(step.pid)
        row["broker_fd_limit"] = fd_limit(step.pid)
        row["create_s"] = round(run(create(step.broker.address, names, args.concurrency)), 2)
        row["creates_per_s"] = round(n / row["create_s"])
        row["known_s"] = round(run(nameserver_lists(step.namesrv, set(names), 600)), 2)
        idle = proc_facts(step.pid)
        row |= {f"broker_{k}": v for k, v in idle.items()}
        row["per_idle_topic_kib"] = round((idle["rss_mb"] - idle_before["rss_mb"]) * 1024 / n, 2)
        row |= run(registration(step))
        row |= run(routes(step.namesrv, names, args.lookups))
        row |= run(fixed_load(step.namesrv, names[0], args.messages))
        loaded = proc_facts(step.pid)
        if not args.no_touch:
            t0 = time.perf_counter()
            row["touch_errors"] = run(touch_every_queue(step.namesrv, names))
            row["touch_s"] = round(time.perf_counter() - t0, 2)
            if step.broker_alive():
                touched = proc_facts(step.pid)
                row |= {f"touched_{k}": v for k, v in touched.items()}
                row["per_touched_queue_kib"] = round(
                    (touched["rss_mb"] - loaded["rss_mb"]) * 1024 / (n * QUEUES), 2
                )
            else:
                row["touched_broker"] = "exited"
        try:
            row["recovery_s"] = round(step.restart_broker_after_kill(), 2)
        except Exception as exc:  # a wall: the broker does not come back
            row["recovery_failed"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
            return row
        row["recovery_known_s"] = round(run(nameserver_lists(step.namesrv, set(names), 600)), 2)
        recovered = proc_facts(step.pid)
        row |= {f"recovered_{k}": v for k, v in recovered.items()}
    return row


# -- axis: groups -------------------------------------------------------------------------------


async def fill(namesrv: str, topic: str, per_queue: int) -> None:
    """``per_queue`` messages in each queue of ``topic`` (offsets can be committed up to it)."""
    async with Producer(namesrv) as producer:
        for _ in range(per_queue * QUEUES):  # the producer takes the queues in turn
            await producer.send(Message(topic, b"g"))


async def commit_groups(
    namesrv: str, topic: str, groups: list[str], concurrency: int, offset: int
) -> float:
    t0 = time.perf_counter()
    async with AdminClient(namesrv) as admin:
        info = await admin.cluster_info()
        queues = [MessageQueue(topic, info[0].broker_name, q) for q in range(QUEUES)]

        def commit(g: str) -> Callable[[], Awaitable[Any]]:
            return lambda: admin.commit_offsets(g, dict.fromkeys(queues, offset))

        await bounded(concurrency, (commit(g) for g in groups))
    return time.perf_counter() - t0


def offsets_files(root: Path) -> dict[str, tuple[int, int, float]]:
    """The files that hold committed offsets (not the backup copy, which a rename makes)."""
    return {k: v for k, v in dir_bytes(root).items() if "consumerOffset" in k and ".bak" not in k}


def wait_persisted(
    root: Path, before: dict[str, tuple[int, int, float]], timeout: float
) -> dict[str, tuple[int, int, float]]:
    """Wait until the offsets' files change from ``before`` and then stay as they are for two
    persistence intervals (the persistence has ended, and nothing else was pending); the files
    then."""
    deadline = time.monotonic() + timeout
    now = offsets_files(root)
    while now == before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no offset persistence within {timeout} s")
        time.sleep(0.05)  # polling the files' state, with a deadline
        now = offsets_files(root)
    stable_since = time.monotonic()
    while time.monotonic() - stable_since < 2 * PERSIST_INTERVAL_S:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the offsets' files kept changing for {timeout} s")
        time.sleep(0.05)
        later = offsets_files(root)
        if later != now:
            now, stable_since = later, time.monotonic()
    return now


def changed_bytes(
    before: dict[str, tuple[int, int, float]], after: dict[str, tuple[int, int, float]]
) -> int:
    """Bytes written between two views of the offsets' files: a file rewritten (a new inode)
    counts whole, one that grew counts its growth."""
    total = 0
    for name, (size, ino, mtime) in after.items():
        old = before.get(name)
        if old is None or old[1] != ino or size < old[0]:
            total += size
        elif mtime != old[2]:
            total += size - old[0]
    return total


def axis_groups(base: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    topic = "ScaleGroupsTopic"
    groups = [f"scale-group-{i:05d}" for i in range(n)]
    row: dict[str, Any] = {"axis": "groups", "step": n}
    with Step(base, f"groups-{n}") as step:
        run(create(step.broker.address, [topic], 1))
        run(nameserver_lists(step.namesrv, {topic}, 60))
        run(fill(step.namesrv, topic, 2))
        data = Path(step.broker.data_dir)
        before = offsets_files(data)
        committing = commit_groups(step.namesrv, topic, groups, args.concurrency, 1)
        row["commit_s"] = round(run(committing), 2)
        full = wait_persisted(data, before, 120)
        row["offsets_file_kib"] = round(sum(s for s, _, _ in full.values()) / 1024, 1)
        row["broker_rss_mb"] = proc_facts(step.pid)["rss_mb"]
        run(commit_groups(step.namesrv, topic, groups[:1], 1, 2))
        row["persist_bytes"] = changed_bytes(full, wait_persisted(data, full, 120))
    return row


# -- running ------------------------------------------------------------------------------------


def run(coro: Awaitable[Any]) -> Any:
    out: list[Any] = []

    async def main() -> None:
        out.append(await coro)

    run_async(main(), "asyncio")
    return out[0]


AXES: dict[str, Callable[[Path, int, argparse.Namespace], dict[str, Any]]] = {
    "topics": axis_topics,
    "groups": axis_groups,
}


def curves(rows: list[dict[str, Any]]) -> None:
    """One table per axis: each figure against the axis."""
    for axis in AXES:
        mine = [r for r in rows if r["axis"] == axis]
        if not mine:
            continue
        keys = [k for k in mine[0] if k not in ("axis", "step")]
        print(f"\n{axis}: " + " | ".join(str(r["step"]) for r in mine))
        for k in keys:
            print(f"  {k:24s} " + " | ".join(str(r.get(k, "-")) for r in mine))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--axis", choices=sorted(AXES), action="append")
    ap.add_argument("--steps", help="comma-separated steps (with one --axis)")
    ap.add_argument("--quick", action="store_true", help="the first two steps of each axis")
    ap.add_argument("--concurrency", type=int, default=32, help="admin calls at a time")
    ap.add_argument("--lookups", type=int, default=2_000, help="route lookups per step")
    ap.add_argument("--messages", type=int, default=20_000, help="the fixed load's messages")
    ap.add_argument("--no-touch", action="store_true", help="skip touching every queue")
    ap.add_argument("--dir", default=None, help="where to put the clusters (default: temp)")
    args = ap.parse_args()
    axes = args.axis or list(AXES)
    if args.steps and len(axes) != 1:
        sys.exit("--steps goes with exactly one --axis")
    base = Path(args.dir or tempfile.gettempdir())
    rows = []
    for axis in axes:
        steps = (QUICK_STEPS if args.quick else DEFAULT_STEPS)[axis]
        if args.steps:
            steps = [int(s) for s in args.steps.split(",")]
        for n in steps:
            row = AXES[axis](base, n, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    curves(rows)


if __name__ == "__main__":
    main()
