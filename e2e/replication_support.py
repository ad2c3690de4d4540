"""What the replication tests share: a nameserver and one broker name served by a replica
group of real processes, and a Jepsen-style record of what was sent and what was read.

:class:`ReplicaGroup` starts ``python -m apogee_nameserver`` and N ``python -m apogee_broker``
replicas of ``broker-a``, each with its own data folder and a fixed free port (a restarted
replica comes back at the same address), leadership decided by a file (``coordination="file"``)
or by a real etcd (``coordination="etcd"``). It finds the leader by asking every replica's
``DescribeReplica``, kills and restarts replicas, and stops everything when the test ends.
Everything listens on 127.0.0.1, unless the test places the replicas elsewhere: with
``namespaces`` each replica runs in a network namespace of its own (``ip netns exec``, see
:mod:`e2e.netns`) and listens on, and advertises, its address there, and ``host`` is where the
nameserver listens (an address every namespace reaches).

:class:`History` records every send (acknowledged, failed with nothing stored, or unknown) and
every message read, and :meth:`History.check` reports what a user would call a bug: an
acknowledged message never read (lost), a message read twice (duplicated; allowed only for a
send whose outcome was unknown and retried), a message read that nobody sent (unexpected).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio

from apogee.client import Message, Producer
from apogee.common.errors import ApogeeError
from apogee.rpc.server import CLIENT_OPTIONS
from apogee.store import GetStatus, MessageStore
from apogee.testkit.ports import free_port
from apogee.testkit.processes import ServiceProcess
from apogee.testkit.waiting import eventually
from apogee.v1 import replication_pb2, replication_pb2_grpc
from apogee_broker.settings import load_settings as broker_settings
from e2e.netns import NamespacedProcess

BROKER = "broker-a"

#: Replicas of the tests: a heartbeat every second, small files, a short lag bound.
REPLICA_ENV: Mapping[str, str] = {
    "APOGEE_BROKER_HEARTBEAT_INTERVAL_S": "1",
    "APOGEE_BROKER_REGISTER_TIMEOUT_S": "1",
    "APOGEE_BROKER_COMMITLOG_FILE_SIZE": str(4 << 20),
    "APOGEE_BROKER_MAX_MESSAGE_SIZE": str(256 << 10),
    "APOGEE_BROKER_CONSUME_QUEUE_ENTRIES_PER_FILE": "4096",
    "APOGEE_BROKER_INDEX_SLOTS": "4999",
    "APOGEE_BROKER_INDEX_ENTRIES_PER_FILE": "65536",
    "APOGEE_BROKER_SHUTDOWN_GRACE_S": "1",
    "APOGEE_BROKER_AUTO_CREATE_TOPICS": "true",
    "APOGEE_BROKER_REPLICA_LAG_MAX_S": "2",
    "APOGEE_BROKER_REPLICATION_TIMEOUT_S": "5",
    "APOGEE_BROKER_REPLICA_LEASE_S": "2",
}
NAMESERVER_ENV: Mapping[str, str] = {
    "APOGEE_NAMESERVER_BROKER_EXPIRY_S": "5",
    "APOGEE_NAMESERVER_SCAN_INTERVAL_S": "0.5",
    "APOGEE_NAMESERVER_SHUTDOWN_GRACE_S": "1",
}


@dataclass
class Replica:
    index: int
    port: int
    data_dir: Path
    log: Path
    env: dict[str, str]
    proc: ServiceProcess | None = None
    paused: bool = False
    starts: int = 0
    #: the address it listens on and advertises
    host: str = "127.0.0.1"
    #: the network namespace it runs in ("": this process's)
    netns: str = ""

    def logs(self) -> list[Path]:
        """The log of each start, in order."""
        return sorted(self.log.parent.glob(f"replica-{self.index}.*.log"))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics(self) -> str:
        """``host:port`` its metrics are served on now, as its log says (a free port, picked
        again when it changes role); "" before it serves them."""
        found = ""
        with contextlib.suppress(OSError):
            for line in self.log.read_text(errors="replace").splitlines():
                if "serving /metrics on " in line:
                    found = line.rsplit("serving /metrics on ", 1)[1].split()[0]
        return found

    def start(self, namesrv: str) -> None:
        """Start (or start again: each start logs to a file of its own, ``replica-N.K.log``)."""
        self.starts += 1
        self.log = self.log.with_name(f"replica-{self.index}.{self.starts}.log")
        args = [
            *("--listen", self.address),
            *("--name", BROKER),
            *("--data-dir", str(self.data_dir)),
            *("--namesrv", namesrv),
        ]
        if self.netns:
            self.proc = NamespacedProcess(self.netns, "apogee_broker", args, self.log, self.env)
        else:
            self.proc = ServiceProcess("apogee_broker", args, self.log, self.env)

    def wipe(self) -> None:
        """Lose the disk: the data folder removed (the replica must be stopped)."""
        assert not self.alive
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.proc.send_signal(signal.SIGCONT)
        self.paused = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None

    def kill(self) -> float:
        """``kill -9``; returns the monotonic time of the kill."""
        assert self.proc is not None
        at = time.monotonic()
        self.proc.kill()  # SIGKILL ends a stopped process too
        self.paused = False
        return at


class ReplicaGroup:
    """See the module docstring; ``async with ReplicaGroup(tmp_path) as group: ...``."""

    def __init__(
        self,
        root: Path,
        *,
        replicas: int = 3,
        coordination: str = "file",
        etcd_endpoint: str = "",
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        namespaces: Sequence[tuple[str, str]] = (),
    ) -> None:
        """``namespaces``: for each replica in turn, the network namespace it runs in and its
        address there (empty: all on 127.0.0.1 of this namespace); ``host``: the nameserver's
        address."""
        if namespaces and len(namespaces) != replicas:
            raise ValueError(f"namespaces: one per replica ({replicas}), got {len(namespaces)}")
        self.root = root
        self.ns_port = free_port(host)
        self.namesrv = f"{host}:{self.ns_port}"
        self.nameserver: ServiceProcess | None = None
        base = dict(REPLICA_ENV)
        base["APOGEE_BROKER_REPLICATION"] = coordination
        # a cluster name of its own: groups of several tests may share one etcd
        base["APOGEE_BROKER_CLUSTER"] = f"c{self.ns_port}"
        if coordination == "file":
            base["APOGEE_BROKER_REPLICA_GROUP_DIR"] = str(root / "group")
        else:
            base["APOGEE_BROKER_ETCD_ENDPOINTS"] = etcd_endpoint
        base.update(env or {})
        places = list(namespaces) or [("", "127.0.0.1")] * replicas
        self.replicas = [
            Replica(
                i,
                free_port(),
                root / f"replica-{i}",
                root / f"replica-{i}.log",
                {**base, "APOGEE_BROKER_METRICS_LISTEN": f"{places[i][1]}:0"},
                host=places[i][1],
                netns=places[i][0],
            )
            for i in range(replicas)
        ]

    async def __aenter__(self) -> ReplicaGroup:
        try:
            await self.start()
        except BaseException:
            self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.nameserver = ServiceProcess(
            "apogee_nameserver",
            ["--listen", self.namesrv],
            self.root / "nameserver.log",
            dict(NAMESERVER_ENV),
        )
        for r in self.replicas:
            r.start(self.namesrv)
        await self.wait_leader()
        await self.wait_in_sync(len(self.replicas))

    def close(self) -> None:
        for r in self.replicas:
            if r.proc is not None:
                r.proc.kill()
        if self.nameserver is not None:
            self.nameserver.kill()

    # -- looking ------------------------------------------------------------------------------

    async def describe(self, r: Replica) -> replication_pb2.DescribeReplicaResponse | None:
        if not r.alive or r.paused:
            return None
        async with grpc.aio.insecure_channel(r.address, options=CLIENT_OPTIONS) as ch:
            stub = replication_pb2_grpc.ReplicationStub(ch)
            try:
                reply: replication_pb2.DescribeReplicaResponse = await stub.DescribeReplica(
                    replication_pb2.DescribeReplicaRequest(), timeout=1.0
                )
            except grpc.aio.AioRpcError:
                return None
            return reply

    async def leader(self) -> tuple[Replica, replication_pb2.DescribeReplicaResponse] | None:
        # asked together: a replica that does not answer (cut off) costs one timeout, not one
        # per replica before it
        answers = await asyncio.gather(*(self.describe(r) for r in self.replicas))
        for r, d in zip(self.replicas, answers, strict=True):
            if d is not None and d.role == "LEADER":
                return r, d
        return None

    async def wait_leader(self, timeout: float = 30.0, not_: Replica | None = None) -> Replica:
        found: list[Replica] = []

        async def led() -> bool:
            got = await self.leader()
            if got is None or got[0] is not_:
                return False
            found.append(got[0])
            return True

        await eventually(
            led, timeout, "a leader of the replica group", every=0.05, detail=self.logs
        )
        return found[-1]

    async def wait_in_sync(self, size: int, timeout: float = 30.0, exact: bool = False) -> None:
        async def in_sync() -> bool:
            got = await self.leader()
            if got is None:
                return False
            n = len(got[1].in_sync)
            return n == size if exact else n >= size

        await eventually(
            in_sync, timeout, f"an in-sync set of {size} replicas", every=0.05, detail=self.logs
        )

    async def replica_id(self, r: Replica) -> str:
        d = await self.describe(r)
        assert d is not None, f"replica {r.index} does not answer"
        return d.replica_id

    def logs(self, lines: int = 30) -> str:
        parts = []
        for path in [self.root / "nameserver.log", *(p for r in self.replicas for p in r.logs())]:
            with contextlib.suppress(OSError):
                parts.append(
                    f"==> {path.name} <==\n"
                    + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
                )
        return "\n".join(parts)


# -- the history ------------------------------------------------------------------------------


@dataclass
class History:
    """Every send and every read of a test (see the module docstring)."""

    acked: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    unknown: set[str] = field(default_factory=set)
    #: monotonic (start, end) of each acknowledged send, by body
    ack_times: dict[str, tuple[float, float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    read: Counter[str] = field(default_factory=Counter)

    def check(self) -> dict[str, list[str]]:
        sent = self.acked | self.failed | self.unknown
        return {
            "lost": sorted(self.acked - set(self.read)),
            "duplicated": sorted(
                b for b, n in self.read.items() if n > 1 and b not in self.unknown
            ),
            "unexpected": sorted(set(self.read) - sent),
            "stored although refused": sorted(self.failed & set(self.read)),
        }


@dataclass
class Load:
    """Producers sending numbered bodies in a loop until stopped, every outcome in
    :attr:`history`."""

    producer: Producer
    topic: str
    workers: int = 4
    history: History = field(default_factory=History)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    _n: int = 0

    async def run(self) -> None:
        await asyncio.gather(*(self._worker(w) for w in range(self.workers)))

    async def _worker(self, w: int) -> None:
        h = self.history
        while not self.stop.is_set():
            self._n += 1
            body = f"m{w}-{self._n}"
            began = time.monotonic()
            try:
                await self.producer.send(Message(self.topic, body.encode()))
            except ApogeeError as err:
                if _outcome_unknown(err):
                    h.unknown.add(body)
                else:
                    h.failed.add(body)
                h.errors.append(f"{body}: {err}")
                await asyncio.sleep(0.01)  # a pause between failed attempts, not a wait
            else:
                h.acked.add(body)
                h.ack_times[body] = (began, time.monotonic())

    async def until_acked(self, count: int, timeout: float) -> None:
        target = len(self.history.acked) + count

        async def enough() -> bool:
            return len(self.history.acked) >= target

        await eventually(enough, timeout, f"{count} more acknowledged sends", every=0.02)


def _outcome_unknown(err: ApogeeError) -> bool:
    """Whether a failed send may have stored its message: the SDK says so in its error."""
    return err.outcome_unknown


@contextlib.asynccontextmanager
async def loaded(group: ReplicaGroup, topic: str) -> AsyncIterator[Load]:
    """A :class:`Load` on ``topic`` of ``group`` running for the block (routes refreshed twice
    a second, as a producer meeting failovers does); it stops, every send settled, at the end."""
    async with Producer(group.namesrv, route_refresh_interval=0.5) as producer:
        load = Load(producer, topic)
        sending = asyncio.create_task(load.run())
        try:
            yield load
        finally:
            load.stop.set()
            await asyncio.wait_for(sending, 30)


def read_messages(replica: Replica, topic_name: str) -> list[tuple[str, int]]:
    """``(body, CommitLog offset)`` of every message of ``topic_name`` in a stopped replica's
    store, queue by queue."""
    cfg = broker_settings(env=replica.env).store_config()
    out: list[tuple[str, int]] = []
    with MessageStore.open(replica.data_dir, cfg, start_retention=False) as store:
        for topic, q in sorted(store.queue_max_offsets()):
            if topic != topic_name:
                continue
            offset = 0
            while True:
                got = store.get(topic, q, offset, max_count=1024)
                if got.status is not GetStatus.FOUND:
                    break
                out += [(m.body.decode(), m.phys_offset) for m in got.messages]
                offset = got.next_offset
    return out
