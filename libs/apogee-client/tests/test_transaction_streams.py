"""The transactional producer against fake brokers that speak ``apogee.v1.Transaction`` over
real gRPC (and a fake nameserver routing to them): how it stores halves, retries, ends
transactions; its session streams (hello, heartbeats, reconnection, which brokers); how it
answers checks (listener kinds, UNKNOWN, failures, bounded concurrency, duplicates) and how it
closes. The real broker's side is in test_transaction_cluster.py."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.client import (
    EndOutcome,
    Message,
    StoredMessage,
    SyncTransactionProducer,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
)
from apogee.common.errors import UnsupportedError
from apogee.testkit.waiting import eventually, wait_until
from apogee.v1 import (
    common_pb2,
    nameserver_pb2,
    nameserver_pb2_grpc,
    transaction_pb2,
    transaction_pb2_grpc,
)

pytestmark = pytest.mark.integration

LOGGER = "apogee.client.producer.transaction"
TOPIC = "Orders"
GROUP = "txn-group"


class FirstQueue(random.Random):
    """Round robin starting at the first queue (broker-a's), for tests that need to know."""

    def randrange(self, *args: Any, **kwargs: Any) -> int:
        return 0


@dataclass(eq=False)
class FakeBroker(transaction_pb2_grpc.TransactionServicer):
    """Keeps what it was sent; fails on demand; pushes checks on the open sessions."""

    name: str
    address: str = ""
    attempts: list[str] = field(default_factory=list)
    halves: list[transaction_pb2.SendHalfRequest] = field(default_factory=list)
    ends: list[transaction_pb2.EndTransactionRequest] = field(default_factory=list)
    hellos: list[transaction_pb2.ProducerHello] = field(default_factory=list)
    heartbeats: int = 0
    fail_sends: int = 0
    fail_ends: int = 0
    end_attempts: int = 0
    sessions: list[asyncio.Queue[transaction_pb2.ProducerSessionEvent | None]] = field(
        default_factory=list
    )
    ended_sessions: int = 0

    async def SendHalf(
        self, request: transaction_pb2.SendHalfRequest, context: Any
    ) -> transaction_pb2.SendHalfResponse:
        self.attempts.append(request.message.unique_id)
        if self.fail_sends:
            self.fail_sends -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "down for the test")
        self.halves.append(request)
        return transaction_pb2.SendHalfResponse(
            unique_id=request.message.unique_id,
            half_offset=100 + len(self.halves),
            store_timestamp_ms=1_700_000_000_000,
            broker_name=self.name,
            queue_id=request.message.queue_id,
        )

    async def EndTransaction(
        self, request: transaction_pb2.EndTransactionRequest, context: Any
    ) -> transaction_pb2.EndTransactionResponse:
        self.end_attempts += 1
        if self.fail_ends:
            self.fail_ends -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "ending is down for the test")
        self.ends.append(request)
        if request.decision == transaction_pb2.COMMIT:
            return transaction_pb2.EndTransactionResponse(
                outcome=transaction_pb2.COMMITTED, topic=TOPIC, queue_id=1, queue_offset=7
            )
        return transaction_pb2.EndTransactionResponse(outcome=transaction_pb2.ROLLED_BACK)

    async def SendHalves(
        self, request: transaction_pb2.SendHalvesRequest, context: Any
    ) -> transaction_pb2.SendHalvesResponse:
        resp = transaction_pb2.SendHalvesResponse(broker_name=self.name)
        for m in request.messages:
            half = transaction_pb2.SendHalfRequest(producer_group=request.producer_group, message=m)
            resp.results.add(half=await self.SendHalf(half, context))
        return resp

    async def EndTransactions(
        self, request: transaction_pb2.EndTransactionsRequest, context: Any
    ) -> transaction_pb2.EndTransactionsResponse:
        resp = transaction_pb2.EndTransactionsResponse()
        for end in request.ends:
            resp.results.add(end=await self.EndTransaction(end, context))
        return resp

    async def ProducerSession(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        queue: asyncio.Queue[transaction_pb2.ProducerSessionEvent | None] = asyncio.Queue()

        async def read() -> None:
            async for req in request_iterator:
                if req.HasField("hello"):
                    self.hellos.append(req.hello)
                    self.sessions.append(queue)
                else:
                    self.heartbeats += 1
            queue.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (event := await queue.get()) is not None:
                await context.write(event)
        finally:
            reader.cancel()
            if queue in self.sessions:
                self.sessions.remove(queue)
            self.ended_sessions += 1

    def check(self, uid: str, half_offset: int, body: bytes = b"order", times: int = 1) -> None:
        """Send a check of ``uid`` on the newest session."""
        half = common_pb2.StoredMessage(
            topic="RMQ_SYS_TRANS_HALF_TOPIC",
            queue_offset=half_offset,
            body=body,
            unique_id=uid,
            keys=["o-1"],
            properties={"REAL_TOPIC": TOPIC, "REAL_QID": "1", "PGROUP": GROUP, "a": "1"},
        )
        self.sessions[-1].put_nowait(
            transaction_pb2.ProducerSessionEvent(
                check=transaction_pb2.TransactionCheckRequest(
                    half=half,
                    unique_id=uid,
                    half_offset=half_offset,
                    check_times=times,
                    topic=TOPIC,
                )
            )
        )

    def end_sessions(self) -> None:
        for queue in list(self.sessions):
            queue.put_nowait(None)


class FakeNameServer(nameserver_pb2_grpc.NameServerServicer):
    """Routes the topic to the fake brokers (GetRoute is all a producer asks)."""

    def __init__(self, brokers: dict[str, FakeBroker]) -> None:
        self.brokers = brokers

    async def GetRoute(
        self, request: nameserver_pb2.GetRouteRequest, context: Any
    ) -> nameserver_pb2.GetRouteResponse:
        if request.topic != TOPIC:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no route for {request.topic}")
        return nameserver_pb2.GetRouteResponse(
            topic=TOPIC,
            queues=[
                nameserver_pb2.QueueData(broker_name=n, read_queues=2, write_queues=2, perm=6)
                for n in self.brokers
            ],
            brokers=[
                nameserver_pb2.BrokerData(cluster="c", broker_name=n, address=b.address)
                for n, b in self.brokers.items()
            ],
        )


@dataclass
class Fakes:
    namesrv: str
    a: FakeBroker
    b: FakeBroker


@pytest.fixture
async def fakes() -> AsyncIterator[Fakes]:
    servers: list[grpc.aio.Server] = []
    brokers: dict[str, FakeBroker] = {}
    try:
        for name in ("broker-a", "broker-b"):
            server = grpc.aio.server()
            broker = FakeBroker(name)
            transaction_pb2_grpc.add_TransactionServicer_to_server(broker, server)
            broker.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            servers.append(server)
            brokers[name] = broker
        ns = grpc.aio.server()
        routes = FakeNameServer(brokers)  # type: ignore[abstract]
        nameserver_pb2_grpc.add_NameServerServicer_to_server(routes, ns)
        port = ns.add_insecure_port("127.0.0.1:0")
        await ns.start()
        servers.append(ns)
        yield Fakes(f"127.0.0.1:{port}", brokers["broker-a"], brokers["broker-b"])
    finally:
        for server in servers:
            await server.stop(None)


def commit(m: TransactionMessage, arg: object) -> TransactionDecision:
    return TransactionDecision.COMMIT


# -- sending -------------------------------------------------------------------------------------


async def test_a_failed_half_moves_to_the_other_broker_with_the_same_id_and_ends_there(
    fakes: Fakes,
) -> None:
    fakes.a.fail_sends = 1
    seen: list[tuple[TransactionMessage, object]] = []

    def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        seen.append((m, arg))
        return TransactionDecision.COMMIT

    async with TransactionProducer(
        fakes.namesrv, GROUP, rng=FirstQueue(), client_id="me@1"
    ) as producer:
        r = await producer.send_in_transaction(
            Message(TOPIC, b"order", keys="o-1", tags="new"), executor, "arg"
        )
    [uid] = fakes.a.attempts
    assert fakes.b.attempts == [uid]  # the same transaction id on both attempts
    assert (r.message_id, r.broker_name, r.half_offset, r.topic) == (uid, "broker-b", 101, TOPIC)
    assert (r.decision, r.end_outcome, r.queue_offset, r.committed) == (
        TransactionDecision.COMMIT,
        EndOutcome.COMMITTED,
        7,
        True,
    )
    [(m, arg)] = seen
    assert (m.transaction_id, m.body, m.keys, m.tags, arg) == (
        uid,
        b"order",
        ("o-1",),
        "new",
        "arg",
    )
    [half] = fakes.b.halves
    assert (half.producer_group, half.message.topic, half.message.body) == (GROUP, TOPIC, b"order")
    [end] = fakes.b.ends
    assert (end.unique_id, end.half_offset, end.decision, end.source, end.client_id) == (
        uid,
        101,
        transaction_pb2.COMMIT,
        transaction_pb2.PRODUCER,
        "me@1",
    )
    assert (end.producer_group, fakes.a.ends) == (GROUP, [])


async def test_rollback_ends_and_unknown_does_not(fakes: Fakes) -> None:
    async with TransactionProducer(fakes.namesrv, GROUP) as producer:
        rolled = await producer.send_in_transaction(
            Message(TOPIC, b"x"), lambda m, a: TransactionDecision.ROLLBACK
        )
        unknown = await producer.send_in_transaction(
            Message(TOPIC, b"y"), lambda m, a: TransactionDecision.UNKNOWN
        )
    ends = fakes.a.ends + fakes.b.ends
    assert [(e.unique_id, e.decision) for e in ends] == [
        (rolled.message_id, transaction_pb2.ROLLBACK)
    ]
    assert (rolled.end_outcome, unknown.end_outcome, unknown.pending) == (
        EndOutcome.ROLLED_BACK,
        EndOutcome.NOT_ENDED,
        True,
    )


async def test_an_end_that_keeps_failing_is_logged_and_reported_not_raised(
    fakes: Fakes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    fakes.a.fail_ends = fakes.b.fail_ends = 100
    async with TransactionProducer(fakes.namesrv, GROUP, retries=2) as producer:
        r = await producer.send_in_transaction(Message(TOPIC, b"x"), commit)
    assert fakes.a.end_attempts + fakes.b.end_attempts == 3  # tried again twice, same broker
    assert (r.end_outcome, r.pending, r.committed) == (EndOutcome.FAILED, True, False)
    assert "ending is down for the test" in r.end_error
    assert (
        f"ending transaction {r.message_id} (COMMIT) at broker {r.broker_name} failed:"
        in caplog.text
    )
    assert "the broker's checks will resolve it" in caplog.text


async def test_an_end_that_fails_once_is_tried_again(fakes: Fakes) -> None:
    fakes.a.fail_ends = fakes.b.fail_ends = 1
    async with TransactionProducer(fakes.namesrv, GROUP) as producer:
        r = await producer.send_in_transaction(Message(TOPIC, b"x"), commit)
    assert r.end_outcome is EndOutcome.COMMITTED


async def test_a_half_that_cannot_be_stored_raises_and_the_executor_does_not_run(
    fakes: Fakes,
) -> None:
    fakes.a.fail_sends = fakes.b.fail_sends = 100
    ran: list[object] = []

    def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        ran.append(m)
        return TransactionDecision.COMMIT

    async with TransactionProducer(fakes.namesrv, GROUP, retries=1) as producer:
        with pytest.raises(Exception, match="down for the test") as caught:
            await producer.send_in_transaction(Message(TOPIC, b"x"), executor)
    assert getattr(caught.value, "retriable", None) is True
    assert ran == []
    assert len(fakes.a.attempts) + len(fakes.b.attempts) == 2


async def test_a_broker_without_transactions_is_named() -> None:
    """A server that does not serve apogee.v1.Transaction (an old broker) says so."""
    server = grpc.aio.server()
    broker = FakeBroker("old")
    port = server.add_insecure_port("127.0.0.1:0")
    broker.address = f"127.0.0.1:{port}"
    ns = grpc.aio.server()
    routes = FakeNameServer({"old": broker})  # type: ignore[abstract]
    nameserver_pb2_grpc.add_NameServerServicer_to_server(routes, ns)
    ns_port = ns.add_insecure_port("127.0.0.1:0")
    await server.start()
    await ns.start()
    try:
        async with TransactionProducer(f"127.0.0.1:{ns_port}", GROUP) as producer:
            with pytest.raises(UnsupportedError) as caught:
                await producer.send_in_transaction(Message(TOPIC, b"x"), commit)
        assert str(caught.value) == (
            f"broker old at 127.0.0.1:{port} does not serve transactional messages "
            "(apogee.v1.Transaction)"
        )
    finally:
        await server.stop(None)
        await ns.stop(None)


# -- sessions ------------------------------------------------------------------------------------


async def test_sessions_reach_every_broker_of_the_route_with_hello_then_heartbeats(
    fakes: Fakes,
) -> None:
    async with TransactionProducer(
        fakes.namesrv, GROUP, client_id="me@2", heartbeat_interval=0.05
    ) as producer:
        await producer.send_in_transaction(Message(TOPIC, b"x"), commit)
        await eventually(lambda: fakes.a.hellos and fakes.b.hellos, 5, "a hello at both brokers")
        await eventually(lambda: fakes.a.heartbeats >= 2, 5, "heartbeats")
        hello = fakes.a.hellos[0]
        assert (hello.producer_group, hello.client_id, hello.heartbeat_interval_ms) == (
            GROUP,
            "me@2",
            50,
        )
    await eventually(
        lambda: fakes.a.ended_sessions and fakes.b.ended_sessions, 5, "the sessions end"
    )


async def test_the_topics_option_opens_sessions_before_any_send(fakes: Fakes) -> None:
    async with TransactionProducer(fakes.namesrv, GROUP, topics=[TOPIC]):
        await eventually(lambda: fakes.a.hellos and fakes.b.hellos, 5, "a hello at both brokers")


async def test_a_session_that_ends_is_opened_again(fakes: Fakes) -> None:
    async with TransactionProducer(fakes.namesrv, GROUP, topics=[TOPIC]):
        await eventually(lambda: fakes.a.sessions, 5, "a session")
        fakes.a.end_sessions()
        await eventually(
            lambda: len(fakes.a.hellos) == 2 and fakes.a.sessions, 5, "a second session"
        )


# -- checks --------------------------------------------------------------------------------------


async def test_a_check_is_answered_as_the_listener_decides(fakes: Fakes) -> None:
    seen: list[StoredMessage] = []

    async def listener(m: StoredMessage) -> TransactionDecision:
        seen.append(m)
        return {
            "T1": TransactionDecision.COMMIT,
            "T2": TransactionDecision.ROLLBACK,
        }.get(m.unique_id, TransactionDecision.UNKNOWN)

    async with TransactionProducer(
        fakes.namesrv, GROUP, listener, topics=[TOPIC], client_id="me@3"
    ) as producer:
        await eventually(lambda: fakes.a.sessions, 5, "a session")
        fakes.a.check("T1", 11)
        fakes.a.check("T2", 12)
        fakes.a.check("T3", 13)
        await eventually(lambda: len(seen) == 3 and len(fakes.a.ends) == 2, 5, "two answers")
        # T3 settled too (nothing is sent for it): no answer of it may follow
        await eventually(lambda: producer.check_stats().unknown == 1, 5, "T3 left UNKNOWN")
        stats = producer.check_stats()
    assert sorted((e.unique_id, e.half_offset, e.decision, e.source) for e in fakes.a.ends) == [
        ("T1", 11, transaction_pb2.COMMIT, transaction_pb2.CHECK),
        ("T2", 12, transaction_pb2.ROLLBACK, transaction_pb2.CHECK),
    ]
    assert {e.client_id for e in fakes.a.ends} == {"me@3"}
    m = next(m for m in seen if m.unique_id == "T1")
    assert (m.topic, m.queue_id, m.body, m.keys, m.properties) == (
        TOPIC,
        1,
        b"order",
        ("o-1",),
        {"a": "1"},
    )
    assert (stats.received, stats.answered, stats.unknown) == (3, 2, 1)


async def test_a_plain_listener_runs_on_a_check_thread(fakes: Fakes) -> None:
    threads: list[str] = []

    def listener(m: StoredMessage) -> TransactionDecision:
        threads.append(threading.current_thread().name)
        time.sleep(0.01)  # a plain listener may block
        return TransactionDecision.COMMIT

    async with TransactionProducer(fakes.namesrv, GROUP, listener, topics=[TOPIC]):
        await eventually(lambda: fakes.a.sessions, 5, "a session")
        fakes.a.check("T1", 11)
        await eventually(lambda: fakes.a.ends, 5, "the answer")
    assert threads[0].startswith(f"apogee-txn-check-{GROUP}")


async def test_a_listener_that_raises_or_answers_nonsense_leaves_it_unknown(
    fakes: Fakes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    def listener(m: StoredMessage) -> TransactionDecision:
        if m.unique_id == "BAD":
            raise KeyError("no such order")
        return "COMMIT"  # type: ignore[return-value]

    async with TransactionProducer(fakes.namesrv, GROUP, listener, topics=[TOPIC]) as producer:
        await eventually(lambda: fakes.a.sessions, 5, "a session")
        fakes.a.check("BAD", 11)
        fakes.a.check("ODD", 12)
        await eventually(lambda: producer.check_stats().unknown == 2, 5, "two UNKNOWN")
    assert fakes.a.ends == []
    assert (
        "the check listener raised KeyError for transaction BAD; it counts as UNKNOWN"
        in caplog.text
    )
    assert "the check listener returned 'COMMIT', not a TransactionDecision" in caplog.text


async def test_without_a_listener_checks_are_unknown_and_logged_once(
    fakes: Fakes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with TransactionProducer(fakes.namesrv, GROUP, topics=[TOPIC]) as producer:
        await eventually(lambda: fakes.a.sessions, 5, "a session")
        for i in range(5):
            fakes.a.check(f"T{i}", i)
        await eventually(lambda: producer.check_stats().unknown == 5, 5, "five UNKNOWN")
    assert fakes.a.ends == []
    warnings = [r.getMessage() for r in caplog.records if "no check_listener" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith("broker broker-a checks transaction T0 of group txn-group")


async def test_checks_run_concurrently_but_bounded_and_duplicates_are_dropped(
    fakes: Fakes,
) -> None:
    running = 0
    most = 0
    release = asyncio.Event()
    calls: list[str] = []

    async def listener(m: StoredMessage) -> TransactionDecision:
        nonlocal running, most
        calls.append(m.unique_id)
        running += 1
        most = max(most, running)
        await release.wait()
        running -= 1
        return TransactionDecision.ROLLBACK

    async with TransactionProducer(
        fakes.namesrv, GROUP, listener, topics=[TOPIC], max_concurrent_checks=3
    ) as producer:
        await eventually(lambda: fakes.a.sessions, 5, "a session")
        for i in range(10):
            fakes.a.check(f"T{i}", i)
        fakes.a.check("T0", 0)  # asked again while being checked
        await eventually(lambda: running == 3, 5, "three checks running")
        release.set()
        await eventually(lambda: len(fakes.a.ends) == 10, 5, "ten answers")
        assert most == 3  # never a fourth, before the release or after
        assert producer.check_stats().dropped == 1
    assert sorted(calls) == sorted(f"T{i}" for i in range(10))


async def test_close_ends_sessions_and_cancels_checks_in_bounded_time(fakes: Fakes) -> None:
    cancelled = asyncio.Event()

    async def stuck(m: StoredMessage) -> TransactionDecision:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return TransactionDecision.COMMIT

    producer = TransactionProducer(fakes.namesrv, GROUP, stuck, topics=[TOPIC])
    await producer.start()
    await eventually(lambda: fakes.a.sessions and fakes.b.sessions, 5, "two sessions")
    fakes.a.check("T1", 1)
    await eventually(lambda: producer.check_stats().received == 1, 5, "the check")
    began = time.monotonic()
    await producer.close()
    assert time.monotonic() - began < 3.0
    assert cancelled.is_set()
    await eventually(lambda: not fakes.a.sessions and not fakes.b.sessions, 5, "the sessions end")
    assert fakes.a.ends == []


async def test_a_check_listener_past_check_timeout_is_unknown(fakes: Fakes) -> None:
    async def slow(m: StoredMessage) -> TransactionDecision:
        await asyncio.sleep(10)
        return TransactionDecision.COMMIT

    async with TransactionProducer(
        fakes.namesrv, GROUP, slow, topics=[TOPIC], check_timeout=0.1
    ) as producer:
        await eventually(lambda: fakes.a.sessions, 5, "a session")
        fakes.a.check("T1", 1)
        await eventually(lambda: producer.check_stats().unknown == 1, 5, "UNKNOWN")
    assert fakes.a.ends == []


# -- the sync twin -------------------------------------------------------------------------------


async def test_the_sync_producer_runs_the_executor_in_the_calling_thread(fakes: Fakes) -> None:
    loop = asyncio.get_running_loop()

    def run() -> tuple[Any, str, list[str], list[str]]:
        caller = threading.current_thread().name
        executor_threads: list[str] = []
        listener_threads: list[str] = []

        def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
            executor_threads.append(threading.current_thread().name)
            return TransactionDecision.UNKNOWN

        def listener(m: StoredMessage) -> TransactionDecision:
            listener_threads.append(threading.current_thread().name)
            return TransactionDecision.COMMIT

        with SyncTransactionProducer(fakes.namesrv, GROUP, listener, topics=[TOPIC]) as p:
            r = p.send_in_transaction(Message(TOPIC, b"x"), executor)
            broker = fakes.a if r.broker_name == "broker-a" else fakes.b
            wait_until(lambda: broker.sessions, 5, "a session")
            loop.call_soon_threadsafe(broker.check, r.message_id, r.half_offset)
            wait_until(lambda: broker.ends, 5, "the answer")
        return r, caller, executor_threads, listener_threads

    r, caller, executor_threads, listener_threads = await asyncio.to_thread(run)
    assert r.end_outcome is EndOutcome.NOT_ENDED
    assert executor_threads == [caller]
    assert listener_threads
    assert listener_threads[0].startswith(f"apogee-txn-check-{GROUP}")
    [end] = fakes.a.ends + fakes.b.ends
    assert (end.unique_id, end.half_offset, end.source) == (
        r.message_id,
        r.half_offset,
        transaction_pb2.CHECK,
    )
