"""What the transaction tests (:mod:`e2e.test_transactions`) share: waits that say what was
seen, a consumer polling in the background (:class:`Delivered`), executors and a check listener
that notes every check (:class:`Checks`), the proof that messages were stored once
(:func:`assert_delivered_once`), the ``apogee`` command, a second transaction checker
(:class:`SecondChecker`), and the brokers' transaction state read directly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path

import grpc.aio

from apogee.client import (
    AdminClient,
    Message,
    PullConsumer,
    ReceivedMessage,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
    TransactionResult,
)
from apogee.client.txn_admin import PendingTransaction
from apogee.common.topics import TRANS_CHECK_MAX_TIME_TOPIC, TRANS_HALF_TOPIC
from apogee.rpc.errors import KIND_KEY
from apogee.testkit.ports import free_port
from apogee.v1 import transaction_pb2, transaction_pb2_grpc
from e2e.harness import Cluster, eventually, wait_for_route

COMMIT = TransactionDecision.COMMIT

# -- waiting, with what was seen ------------------------------------------------------------------


async def wait(
    check: Callable[[], bool | Awaitable[bool]],
    timeout: float,
    what: str,
    seen: Callable[[], str] = lambda: "",
) -> float:
    """:func:`~apogee.testkit.waiting.eventually`, the seconds it took; a timeout says what was
    seen (the conftest adds the clusters' log tails)."""
    return await eventually(check, timeout, what, detail=lambda: f"seen: {seen()}")


def log_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


def tail(path: str | Path, lines: int = 30) -> str:
    return "\n".join(log_text(path).splitlines()[-lines:])


# -- topics and consumers --------------------------------------------------------------------------


async def make_topic(cluster: Cluster, topic: str, queues: int = 1) -> None:
    """``topic`` with ``queues`` queues on every broker, routed so by every nameserver."""
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=queues)
    await wait_for_route(cluster.nameservers, topic, {b.name for b in cluster.brokers})


class Delivered:
    """What a consumer got: every delivery by unique id, with where it came from."""

    def __init__(self) -> None:
        self.by_id: dict[str, list[ReceivedMessage]] = {}
        #: monotonic time each unique id first arrived
        self.at: dict[str, float] = {}
        self.failure: BaseException | None = None

    def add(self, msgs: Iterable[ReceivedMessage]) -> None:
        now = time.monotonic()
        for m in msgs:
            self.by_id.setdefault(m.unique_id, []).append(m)
            self.at.setdefault(m.unique_id, now)

    def __contains__(self, uid: object) -> bool:
        return uid in self.by_id

    def has_all(self, ids: Iterable[str]) -> bool:
        if self.failure is not None:
            raise AssertionError(f"the consumer failed: {self.failure!r}")
        return all(u in self.by_id for u in ids)

    def stored_at(self, uid: str) -> set[tuple[str, int, int]]:
        """The distinct places (broker, queue, offset) ``uid`` was delivered from: more than
        one is a message stored twice (a consumer's own redelivery repeats its place)."""
        return {(m.broker_name, m.queue_id, m.queue_offset) for m in self.by_id.get(uid, [])}

    def summary(self) -> str:
        copies = sum(len(v) for v in self.by_id.values())
        twice = {u: sorted(self.stored_at(u)) for u in self.by_id if len(self.stored_at(u)) > 1}
        failed = f"; the consumer failed: {self.failure!r}" if self.failure else ""
        return (
            f"{len(self.by_id)} unique ids in {copies} deliveries; stored more than once: "
            f"{twice or 'none'}{failed}"
        )


@contextlib.asynccontextmanager
async def reading(cluster: Cluster, topic: str, group: str) -> AsyncIterator[Delivered]:
    """A pull consumer of ``topic`` (from the earliest offset) polling in the background."""
    got = Delivered()
    consumer = PullConsumer(
        cluster.namesrv,
        group,
        consume_from="earliest",
        rebalance_interval=1.0,
        long_poll_timeout=2.0,
    )
    consumer.subscribe(topic)
    await consumer.start()

    async def pump() -> None:
        try:
            while True:
                got.add(await consumer.poll(timeout=0.5))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            got.failure = exc

    task = asyncio.create_task(pump())
    try:
        yield got
    finally:
        task.cancel()
        await asyncio.wait({task})
        await consumer.close()


# -- executors and check listeners -----------------------------------------------------------------


def deciding(
    decision: TransactionDecision, ran: list[str] | None = None
) -> Callable[[TransactionMessage, object], Awaitable[TransactionDecision]]:
    """An executor that answers ``decision`` (and notes in ``ran`` the transactions it ran
    for)."""

    async def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        if ran is not None:
            ran.append(m.transaction_id)
        return decision

    return executor


commit = deciding(COMMIT)


class Checks:
    """A check listener that notes every check (by transaction id, with its monotonic and wall
    clock times) and answers ``answer``."""

    def __init__(self, answer: TransactionDecision) -> None:
        self.answer = answer
        self.calls: dict[str, list[tuple[float, float, TransactionCheckMessage]]] = defaultdict(
            list
        )

    async def __call__(self, m: TransactionCheckMessage) -> TransactionDecision:
        self.calls[m.transaction_id].append((time.monotonic(), time.time(), m))
        return self.answer

    def count(self, uid: str) -> int:
        return len(self.calls.get(uid, []))

    def times(self, uid: str) -> list[int]:
        """The check numbers (``check_times``) of ``uid``'s checks, in arrival order."""
        return [m.check_times for _, _, m in self.calls.get(uid, [])]

    def summary(self) -> str:
        many = {u: self.times(u) for u, c in self.calls.items() if len(c) > 1}
        return f"{len(self.calls)} transactions checked; more than once: {many or 'none'}"


# -- delivered once --------------------------------------------------------------------------------


async def marker(producer: TransactionProducer, topic: str, where: tuple[str, int]) -> str:
    """Commit messages until one lands on queue ``where`` (broker, queue id); its id."""
    landed = []
    for n in range(16):  # the producer turns over the queues: a few sends reach each
        r = await producer.send_in_transaction(Message(topic, f"marker {n}".encode()), commit)
        assert r.committed, r
        if (r.broker_name, r.queue_id) == where:
            return r.transaction_id
        landed.append((r.broker_name, r.queue_id))
    raise AssertionError(f"no marker reached {where} of {topic}: they went to {landed}")


async def assert_delivered_once(
    cluster: Cluster,
    got: Delivered,
    topic: str,
    ids: Iterable[str],
    also: Iterable[tuple[str, int]] = (),
    timeout: float = 30.0,
) -> None:
    """Every one of ``ids`` is delivered; then a marker committed on each queue they came on
    (and on the queues ``also``, (broker, queue id)) is delivered too, every offset of those
    queues up to it was, and each of ``ids`` was stored at exactly one place."""
    wanted = set(ids)
    await wait(
        lambda: got.has_all(wanted),
        timeout,
        f"{len(wanted)} transactions of {topic} delivered",
        lambda: f"{got.summary()}; missing {sorted(wanted - set(got.by_id))[:10]}",
    )
    queues = sorted({(m.broker_name, m.queue_id) for u in wanted for m in got.by_id[u]} | {*also})
    # a producer of its own, that turns over every queue whatever earlier sends took
    async with TransactionProducer(
        cluster.namesrv, "txn-e2e-markers", latency_fault_tolerance=False
    ) as producer:
        markers = [await marker(producer, topic, q) for q in queues]
    await wait(lambda: got.has_all(markers), 15.0, f"markers on {queues} delivered", got.summary)
    twice = {u: sorted(got.stored_at(u)) for u in wanted if len(got.stored_at(u)) != 1}
    assert not twice, f"stored more than once: {twice}"
    # each queue was read whole up to its marker: no offset left out
    for (broker, queue), mark in zip(queues, markers, strict=True):
        [(_, _, last)] = got.stored_at(mark)
        offsets = {
            off
            for u in got.by_id
            for (b, q, off) in got.stored_at(u)
            if (b, q) == (broker, queue) and off <= last
        }
        assert offsets == set(range(last + 1)), (broker, queue, sorted(offsets))


async def assert_kept_aside(
    cluster: Cluster, r: TransactionResult, checks: int, body: bytes
) -> None:
    """``r``'s copies on its broker: the first and one put back by each of its ``checks``
    checks in the half queue, the newest (saying so many checks) in TRANS_CHECK_MAX_TIME_TOPIC,
    none under its topic."""
    async with AdminClient(cluster.namesrv) as admin:
        copies = await admin.get_messages(r.transaction_id)
    where = Counter((m.broker_name, m.topic) for m in copies)
    assert where == {
        (r.broker_name, TRANS_HALF_TOPIC): checks + 1,
        (r.broker_name, TRANS_CHECK_MAX_TIME_TOPIC): 1,
    }, where
    newest = copies[0]
    assert newest.topic == TRANS_CHECK_MAX_TIME_TOPIC, [m.topic for m in copies]
    assert newest.properties["TRANSACTION_CHECK_TIMES"] == str(checks), newest.properties
    assert newest.body == body


async def pending(cluster: Cluster, group: str) -> dict[str, PendingTransaction]:
    """The pending transactions of ``group`` on every broker, by id."""
    async with AdminClient(cluster.namesrv) as admin:
        return {p.transaction_id: p for p in await admin.list_pending_transactions(group)}


# -- the command, a second checker, the brokers' state ---------------------------------------------


def apogee(namesrv: str, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    """``apogee --namesrv NAMESRV ARGS`` as a user runs it; it must exit ``code``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
    done = subprocess.run(
        [sys.executable, "-m", "apogee.cli", "--namesrv", namesrv, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == code, (
        f"apogee {' '.join(args)} exited {done.returncode}, not {code}\n"
        f"stdout: {done.stdout}\nstderr: {done.stderr}"
    )
    return done


class SecondChecker:
    """Another ``python -m apogee_txn_checker`` on the cluster's lock file and nameservers,
    with the cluster checker's settings, its health service and its metrics endpoint on ports
    of their own and its log beside the cluster's; :meth:`stop` always."""

    def __init__(self, cluster: Cluster) -> None:
        first = cluster.member("txn-checker")
        self.address = f"127.0.0.1:{free_port()}"
        argv = list(first.argv)
        argv[argv.index("--listen") + 1] = self.address
        env = {**first.env, "APOGEE_TXN_CHECKER_METRICS_LISTEN": f"127.0.0.1:{free_port()}"}
        self.log = cluster.data_dir / "logs" / "txn-checker-2.log"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )

    def stop(self) -> None:
        """SIGTERM, and SIGKILL if it is not gone within 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def rounds(log: str) -> int:
    """The check rounds a checker's log reports (each round that checked something)."""
    return sum(": round: " in line for line in log.splitlines())


async def half_max_offsets(cluster: Cluster) -> dict[str, int]:
    """The end of every broker's half queue."""
    out = {}
    for b in cluster.brokers:
        async with grpc.aio.insecure_channel(b.address) as channel:
            stub = transaction_pb2_grpc.TransactionCheckStub(channel)
            state = await stub.GetTransactionState(
                transaction_pb2.GetTransactionStateRequest(), timeout=5
            )
        out[b.name] = state.half_max_offset
    return out


def kind_of(err: grpc.aio.AioRpcError) -> str:
    """The error kind a broker's answer names in its trailing metadata."""
    for key, value in err.trailing_metadata() or ():
        if key == KIND_KEY:
            return str(value)
    return ""
