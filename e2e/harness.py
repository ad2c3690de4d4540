"""What the end-to-end tests share: a cluster of real processes, and ways to look inside it.

:class:`Cluster` wraps :mod:`apogee.local.cluster` (each nameserver and broker is its own
``python -m`` process with its log under ``<data>/logs/``) with what a test needs besides: kill a
member with SIGKILL, start it again, stop everything gracefully, and - once stopped - read a
broker's store directly with :class:`apogee.store.MessageStore`, opened with the very settings
the broker ran with. :meth:`Cluster.close` always leaves nothing running and says whether every
member stopped gracefully.

The settings shrink what the defaults make slow: brokers heartbeat every second, nameservers
drop a broker after 5 s of silence and look for silent ones every 0.5 s, stores use small files.

``local_cluster`` drives its own event loops with ``asyncio.run``; an async test calls the
methods of :class:`Cluster` through ``asyncio.to_thread`` (they block for seconds), and the
``async`` helpers below (:func:`route_brokers`, :func:`eventually`, ...) are for the test's loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

import grpc
import grpc.aio

from apogee.local import cluster as local_cluster
from apogee.local.cluster import ClusterState, Process
from apogee.rpc.security import ClientSecurity
from apogee.store import GetStatus, MessageStore, StoreConfig, StoredMessage

# the polls with a deadline, re-exported: the tests import them from here
from apogee.testkit.waiting import eventually as eventually  # noqa: PLC0414
from apogee.testkit.waiting import wait_until as wait_until  # noqa: PLC0414
from apogee.v1 import nameserver_pb2, nameserver_pb2_grpc
from apogee_broker.settings import load_settings as broker_settings

T = TypeVar("T")

KiB = 1024
MiB = 1024 * KiB

#: Nameservers of the tests: a broker silent for 5 s is dropped; silent ones are looked for
#: twice a second.
NAMESERVER_ENV: Mapping[str, str] = {
    "APOGEE_NAMESERVER_BROKER_EXPIRY_S": "5",
    "APOGEE_NAMESERVER_SCAN_INTERVAL_S": "0.5",
    "APOGEE_NAMESERVER_SHUTDOWN_GRACE_S": "1",
}
#: Brokers of the tests: a heartbeat every second, small store files (several CommitLog and
#: ConsumeQueue files fill up in a test), a short grace on SIGTERM.
BROKER_ENV: Mapping[str, str] = {
    "APOGEE_BROKER_HEARTBEAT_INTERVAL_S": "1",
    "APOGEE_BROKER_REGISTER_TIMEOUT_S": "1",
    "APOGEE_BROKER_COMMITLOG_FILE_SIZE": str(2 * MiB),
    "APOGEE_BROKER_MAX_MESSAGE_SIZE": str(256 * KiB),
    "APOGEE_BROKER_CONSUME_QUEUE_ENTRIES_PER_FILE": "1024",
    "APOGEE_BROKER_INDEX_SLOTS": "4999",
    "APOGEE_BROKER_INDEX_ENTRIES_PER_FILE": "65536",
    "APOGEE_BROKER_SHUTDOWN_GRACE_S": "2",
}
#: The schedule service of the tests: it looks for new brokers every second.
SCHEDULE_ENV: Mapping[str, str] = {"APOGEE_SCHEDULE_BROKER_REFRESH_S": "1"}
#: The shared cluster's largest body, small so that "too large" costs little.
SHARED_MAX_MESSAGE_SIZE = 64 * KiB
#: The shared cluster's brokers: no topics created on first send, small bodies only.
SHARED_BROKER_ENV: Mapping[str, str] = {
    "APOGEE_BROKER_AUTO_CREATE_TOPICS": "false",
    "APOGEE_BROKER_MAX_MESSAGE_SIZE": str(SHARED_MAX_MESSAGE_SIZE),
}
#: Seconds a cluster may take to start, and a member to stop gracefully.
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


def in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own: ``local_cluster`` runs event loops with ``asyncio.run``,
    which must not disturb the caller's thread (pytest-asyncio's loop lives there)."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, name="e2e-cluster")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


class Cluster:
    """A running local cluster; ``Cluster.start(path)``, then :meth:`close` (always)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.data_dir = Path(state.data_dir)
        #: members this test killed on purpose
        self.killed: set[str] = set()
        self._closed = False

    @classmethod
    def start(
        cls,
        data_dir: Path,
        *,
        brokers: int = 2,
        nameservers: int = 2,
        flush_mode: str = "async",
        nameserver_env: Mapping[str, str] | None = None,
        broker_env: Mapping[str, str] | None = None,
        txn_checker_env: Mapping[str, str] | None = None,
        schedule_env: Mapping[str, str] | None = None,
        console: bool = False,
        replicas: int = 1,
    ) -> Cluster:
        """Start nameservers and brokers (the test settings, overridden by the given
        environment) and wait until every broker is registered with every nameserver; then the
        schedule service and the transaction checker (its defaults, overridden by
        ``txn_checker_env``), and the web console only when asked (``console``). ``replicas``:
        each broker a replica group of that many processes (``broker-a-0``, ...)."""
        ns_env = dict({**NAMESERVER_ENV, **(nameserver_env or {})})
        b_env = dict({**BROKER_ENV, **(broker_env or {})})
        state = in_thread(
            lambda: local_cluster.up(
                data_dir,
                brokers=brokers,
                nameservers=nameservers,
                flush_mode=flush_mode,
                timeout=START_TIMEOUT,
                nameserver_env=ns_env,
                broker_env=b_env,
                schedule_env=dict({**SCHEDULE_ENV, **(schedule_env or {})}),
                txn_checker_env=dict(txn_checker_env or {}),
                console=console,
                replicas=replicas,
            )
        )
        return cls(state)

    # -- members -------------------------------------------------------------------------------

    @property
    def namesrv(self) -> str:
        """``host:port;host:port`` of the nameservers, in order."""
        return self.state.namesrv

    @property
    def brokers(self) -> list[Process]:
        return self.state.brokers

    @property
    def nameservers(self) -> list[Process]:
        return self.state.nameservers

    def member(self, name: str) -> Process:
        for p in self.state.all():
            if p.name == name:
                return p
        raise KeyError(f"no member {name!r} in {self.data_dir}")

    def kill(self, name: str) -> float:
        """SIGKILL member ``name`` and wait until it is gone; returns the monotonic time of the
        kill."""
        p = self.member(name)
        self.killed.add(name)
        at = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        wait_until(lambda: not local_cluster.pid_alive(p.pid), 10.0, f"{name} gone after SIGKILL")
        return at

    def restart(self, name: str) -> Process:
        """Start a killed member again and wait until it is healthy."""
        member = in_thread(lambda: local_cluster.restart(self.state, name, timeout=START_TIMEOUT))
        self.killed.discard(name)
        return member

    # -- stopping ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every member gracefully (SIGTERM; brokers first) and check that each did."""
        if self._closed:
            return
        self._closed = True
        try:
            report = in_thread(lambda: local_cluster.down(self.data_dir, STOP_TIMEOUT))
        finally:
            leftovers = self._kill_leftovers()
        bad = [f"{p.name}: {how}" for p, how in report if how != "stopped"]
        bad += [f"{name}: still running after `down`, killed" for name in leftovers]
        if bad:
            raise AssertionError(
                "the cluster did not stop gracefully: " + "; ".join(bad) + "\n" + self.log_tails()
            )

    def close(self) -> None:
        """:meth:`stop` unless done; whatever happens, nothing of the cluster keeps running."""
        if not self._closed:
            self.stop()
        self._kill_leftovers()

    def _kill_leftovers(self) -> list[str]:
        left = []
        for p in self.state.all():
            if local_cluster.pid_alive(p.pid):
                left.append(p.name)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        return left

    # -- looking inside ------------------------------------------------------------------------

    def log_tails(self, lines: int = 40) -> str:
        """The last ``lines`` lines of every member's log."""
        parts = []
        for p in self.state.all():
            try:
                text = Path(p.log).read_text(errors="replace").splitlines()[-lines:]
            except OSError as exc:
                text = [f"(cannot read the log: {exc})"]
            parts.append(f"==> {p.name} (pid {p.pid}) {p.log} <==\n" + "\n".join(text))
        return "\n".join(parts)

    def store_config(self, broker: str) -> StoreConfig:
        """The store settings broker ``broker`` ran with (from its environment)."""
        return broker_settings(env=self.member(broker).env).store_config()

    def read_topic(self, broker: str, topic: str) -> list[StoredMessage]:
        """Every message of ``topic`` in ``broker``'s store, queue by queue from offset 0. The
        cluster must be stopped: a running broker holds its store's lock."""
        if not self._closed:
            raise RuntimeError("stop the cluster before reading a store")
        p = self.member(broker)
        out: list[StoredMessage] = []
        with MessageStore.open(p.data_dir, self.store_config(broker), start_retention=False) as s:
            queues = sorted(q for t, q in s.queue_max_offsets() if t == topic)
            for q in queues:
                offset = 0
                while True:
                    got = s.get(topic, q, offset, max_count=1024)
                    if got.status is not GetStatus.FOUND:
                        assert got.status is GetStatus.NO_NEW_MESSAGE, (broker, topic, q, got)
                        break
                    out += got.messages
                    offset = got.next_offset
                assert offset == s.max_offset(topic, q)
                assert s.min_offset(topic, q) == 0
        return out


class ClusterFactory:
    """Starts clusters under one folder (``factory("name", broker_env=...)``); :meth:`close`
    closes all of them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.clusters: list[Cluster] = []

    def __call__(
        self,
        name: str,
        *,
        brokers: int = 2,
        nameservers: int = 2,
        flush_mode: str = "async",
        nameserver_env: Mapping[str, str] | None = None,
        broker_env: Mapping[str, str] | None = None,
        txn_checker_env: Mapping[str, str] | None = None,
        schedule_env: Mapping[str, str] | None = None,
        console: bool = False,
    ) -> Cluster:
        # a cluster that fails to start is cleaned up by `up` itself; a started one by close()
        cluster = Cluster.start(
            self.root / name,
            brokers=brokers,
            nameservers=nameservers,
            flush_mode=flush_mode,
            nameserver_env=nameserver_env,
            broker_env=broker_env,
            txn_checker_env=txn_checker_env,
            schedule_env=schedule_env,
            console=console,
        )
        self.clusters.append(cluster)
        return cluster

    def close(self) -> None:
        errors: list[BaseException] = []
        for c in self.clusters:
            try:
                c.close()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


# -- asking a nameserver directly ---------------------------------------------------------------


async def route_brokers(nameserver: str, topic: str) -> set[str]:
    """The brokers in ``nameserver``'s route of ``topic`` (empty when it has none). Asked over
    TLS and signed when the environment says so (``ClientSecurity.from_env``)."""
    async with ClientSecurity.from_env().channel(nameserver) as channel:
        stub = nameserver_pb2_grpc.NameServerStub(channel)
        try:
            route = await stub.GetRoute(nameserver_pb2.GetRouteRequest(topic=topic), timeout=2)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return set()
            raise
    queue_brokers = {q.broker_name for q in route.queues}
    assert queue_brokers == {b.broker_name for b in route.brokers}, route
    return queue_brokers


async def live_brokers(nameserver: str) -> set[str]:
    """The brokers ``nameserver``'s cluster info lists (asked as :func:`route_brokers` asks)."""
    async with ClientSecurity.from_env().channel(nameserver) as channel:
        stub = nameserver_pb2_grpc.NameServerStub(channel)
        info = await stub.GetClusterInfo(nameserver_pb2.GetClusterInfoRequest(), timeout=2)
    return {b.broker_name for b in info.brokers}


async def wait_for_route(
    nameservers: Iterable[Process], topic: str, brokers: set[str], timeout: float = 10.0
) -> None:
    """Wait until every nameserver routes ``topic`` to exactly ``brokers``."""
    for ns in nameservers:

        async def routed(address: str = ns.address) -> bool:
            return await route_brokers(address, topic) == brokers

        await eventually(routed, timeout, f"{ns.name} routes {topic} to {sorted(brokers)}")


async def wait_registered(
    nameservers: Iterable[Process], broker: str, timeout: float = 10.0
) -> None:
    """Wait until every nameserver lists ``broker`` as live (a broker answers its health check
    a moment before its first registration)."""
    for ns in nameservers:

        async def listed(address: str = ns.address) -> bool:
            return broker in await live_brokers(address)

        await eventually(listed, timeout, f"{ns.name} lists {broker}")
