"""Transactional messages against real nameservers and brokers in this process: a committed
transaction reaches consumers once, as sent; a rolled-back one never does; one left UNKNOWN is
delivered once a check (asked of the broker here with ``TransactionCheck.CheckHalf``, as the
txn-checker does) reaches the producer's check listener and it answers COMMIT; an executor that
raises leaves it UNKNOWN; bad messages are refused before anything is stored; the sync twin
does the same."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest

from apogee.client import (
    EndOutcome,
    Message,
    PullConsumer,
    ReceivedMessage,
    StoredMessage,
    SyncTransactionProducer,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
    TransactionResult,
)
from apogee.common.errors import ApogeeError, InvalidArgumentError, InvalidPropertyError
from apogee.testkit.cluster import InProcessCluster, eventually
from apogee.testkit.waiting import wait_until
from apogee.v1 import transaction_pb2, transaction_pb2_grpc

pytestmark = pytest.mark.integration

TOPIC = "Orders"
GROUP = "order-txns"
LOGGER = "apogee.client.producer.transaction"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    """One nameserver and two brokers; the topic on both."""
    async with InProcessCluster(tmp_path, nameservers=1) as c:
        await c.create_topic(TOPIC, queues=2)
        yield c


def address_of(cluster: InProcessCluster, broker: str) -> str:
    return cluster.brokers[broker].address


async def txn_state(
    cluster: InProcessCluster, broker: str
) -> transaction_pb2.GetTransactionStateResponse:
    async with grpc.aio.insecure_channel(address_of(cluster, broker)) as ch:
        stub = transaction_pb2_grpc.TransactionCheckStub(ch)
        return await stub.GetTransactionState(
            transaction_pb2.GetTransactionStateRequest(), timeout=3.0
        )


async def wait_producer(cluster: InProcessCluster, client_id: str) -> None:
    """Until every broker lists ``client_id`` among the group's producers (its session)."""

    async def listed() -> bool:
        for name in cluster.brokers:
            state = await txn_state(cluster, name)
            ids = {c for p in state.producers if p.producer_group == GROUP for c in p.client_ids}
            if client_id not in ids:
                return False
        return True

    await eventually(listed, 10.0, f"producer {client_id} at every broker")


async def check_half(
    cluster: InProcessCluster, result: TransactionResult
) -> transaction_pb2.CheckHalfResponse:
    """What the txn-checker does for a half left open: ask its broker to check it."""
    async with grpc.aio.insecure_channel(address_of(cluster, result.broker_name)) as ch:
        stub = transaction_pb2_grpc.TransactionCheckStub(ch)
        return await stub.CheckHalf(
            transaction_pb2.CheckHalfRequest(half_offset=result.half_offset), timeout=3.0
        )


async def consume(
    cluster: InProcessCluster,
    done: Callable[[dict[str, list[ReceivedMessage]]], bool],
    timeout: float = 15.0,
    linger: float = 1.0,
) -> dict[str, list[ReceivedMessage]]:
    """Every message of the topic by unique id, read until ``done(got)``, then ``linger``
    seconds more (to see duplicates)."""
    got: dict[str, list[ReceivedMessage]] = {}
    async with PullConsumer(cluster.namesrv, "readers", consume_from="earliest") as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        async with asyncio.timeout(timeout):
            while not done(got):
                for m in await consumer.poll(timeout=0.5):
                    got.setdefault(m.unique_id, []).append(m)
        loop = asyncio.get_running_loop()
        until = loop.time() + linger
        while loop.time() < until:
            for m in await consumer.poll(timeout=0.2):
                got.setdefault(m.unique_id, []).append(m)
    return got


def decide(
    decision: TransactionDecision,
) -> Callable[[TransactionMessage, object], Awaitable[TransactionDecision]]:
    async def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        return decision

    return executor


async def half_max(cluster: InProcessCluster) -> dict[str, int]:
    return {name: (await txn_state(cluster, name)).half_max_offset for name in cluster.brokers}


# -- commit, rollback ----------------------------------------------------------------------------


async def test_a_committed_transaction_is_delivered_once_as_sent(cluster: InProcessCluster) -> None:
    props = {"order": "o-17", "CHECK_IMMUNITY_TIME_IN_SECONDS": "60"}
    seen: list[TransactionMessage] = []

    async def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        seen.append(m)
        assert arg == "the order"
        return TransactionDecision.COMMIT

    async with TransactionProducer(cluster.namesrv, GROUP) as producer:
        message = Message(TOPIC, b"order placed", tags="placed", keys="o-17", properties=props)
        result = await producer.send_in_transaction(message, executor, "the order")
    assert (result.decision, result.end_outcome, result.committed) == (
        TransactionDecision.COMMIT,
        EndOutcome.COMMITTED,
        True,
    )
    assert (result.topic, result.broker_name in cluster.brokers) == (TOPIC, True)
    assert result.queue_offset >= 0
    assert [m.transaction_id for m in seen] == [result.message_id]
    got = await consume(cluster, lambda g: result.message_id in g)
    [m] = got[result.message_id]  # once
    assert list(got) == [result.message_id]
    assert (m.topic, m.body, m.tags, m.keys, m.broker_name, m.queue_id, m.queue_offset) == (
        TOPIC,
        b"order placed",
        "placed",
        ("o-17",),
        result.broker_name,
        result.queue_id,
        result.queue_offset,
    )
    assert m.properties == {"order": "o-17"}  # no transaction property is left


async def test_a_rolled_back_transaction_is_never_delivered(cluster: InProcessCluster) -> None:
    async with TransactionProducer(cluster.namesrv, GROUP) as producer:
        rolled = await producer.send_in_transaction(
            Message(TOPIC, b"cancelled"), decide(TransactionDecision.ROLLBACK)
        )
        marker = await producer.send_in_transaction(
            Message(TOPIC, b"after"), decide(TransactionDecision.COMMIT)
        )
        plain = await producer.send(Message(TOPIC, b"an ordinary send"))  # it is a Producer too
    assert (rolled.end_outcome, rolled.committed, rolled.pending) == (
        EndOutcome.ROLLED_BACK,
        False,
        False,
    )
    got = await consume(cluster, lambda g: marker.message_id in g and plain.message_id in g)
    assert rolled.message_id not in got
    assert sorted(got) == sorted([marker.message_id, plain.message_id])


# -- checks --------------------------------------------------------------------------------------


async def test_an_unknown_transaction_is_delivered_when_a_check_commits_it(
    cluster: InProcessCluster,
) -> None:
    asked: list[TransactionCheckMessage] = []

    async def listener(m: TransactionCheckMessage) -> TransactionDecision:
        asked.append(m)
        return TransactionDecision.COMMIT

    async with TransactionProducer(
        cluster.namesrv, GROUP, listener, client_id="checked@1", heartbeat_interval=1.0
    ) as producer:
        result = await producer.send_in_transaction(
            Message(TOPIC, b"later", keys="o-9", properties={"a": "1"}),
            decide(TransactionDecision.UNKNOWN),
        )
        assert (result.end_outcome, result.pending) == (EndOutcome.NOT_ENDED, True)
        got = await consume(cluster, lambda g: True, linger=0.5)
        assert result.message_id not in got  # a half is not delivered
        await wait_producer(cluster, "checked@1")
        checked = await check_half(cluster, result)
        assert checked.outcome == transaction_pb2.CHECK_SENT
        assert checked.producer_client_id == "checked@1"
        got = await consume(cluster, lambda g: result.message_id in g)
        await eventually(lambda: producer.check_stats().answered == 1, 5, "the answer counted")
    [m] = got[result.message_id]
    assert (m.body, m.keys, m.properties) == (b"later", ("o-9",), {"a": "1"})
    [a] = asked
    assert (a.topic, a.transaction_id, a.check_times, a.body, a.keys, a.properties) == (
        TOPIC,
        result.message_id,
        1,
        b"later",
        ("o-9",),
        {"a": "1"},
    )
    assert a.queue_id == result.queue_id
    # the transaction is decided: checking the old copy again changes nothing
    again = await check_half(cluster, result)
    assert again.outcome in (transaction_pb2.CLOSED, transaction_pb2.DECIDED)


async def test_an_executor_that_raises_leaves_it_unknown_and_logged_then_a_check_rolls_back(
    cluster: InProcessCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        raise RuntimeError("the database went away")

    def listener(m: StoredMessage) -> TransactionDecision:  # a plain function: on a thread
        return TransactionDecision.ROLLBACK

    async with TransactionProducer(
        cluster.namesrv, GROUP, listener, client_id="raising@1"
    ) as producer:
        result = await producer.send_in_transaction(Message(TOPIC, b"doomed"), executor)
        assert (result.decision, result.end_outcome) == (
            TransactionDecision.UNKNOWN,
            EndOutcome.NOT_ENDED,
        )
        assert result.executor_error == "the executor raised RuntimeError: the database went away"
        assert (
            f"the executor raised RuntimeError for transaction {result.message_id}; it counts as "
            "UNKNOWN" in caplog.text
        )
        await wait_producer(cluster, "raising@1")
        assert (await check_half(cluster, result)).outcome == transaction_pb2.CHECK_SENT
        await eventually(lambda: producer.check_stats().answered == 1, 5, "the ROLLBACK answer")
        marker = await producer.send_in_transaction(
            Message(TOPIC, b"marker"), decide(TransactionDecision.COMMIT)
        )
    got = await consume(cluster, lambda g: marker.message_id in g)
    assert result.message_id not in got


async def test_a_check_without_a_listener_stays_pending(
    cluster: InProcessCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with TransactionProducer(cluster.namesrv, GROUP, client_id="deaf@1") as producer:
        result = await producer.send_in_transaction(
            Message(TOPIC, b"x"), decide(TransactionDecision.UNKNOWN)
        )
        await wait_producer(cluster, "deaf@1")
        checked = await check_half(cluster, result)
        assert checked.outcome == transaction_pb2.CHECK_SENT
        await eventually(lambda: producer.check_stats().unknown == 1, 5, "UNKNOWN")
    assert "this producer has no check_listener" in caplog.text


async def test_a_failed_end_is_reported_and_the_check_resolves_it_after_a_broker_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker stops while the local transaction runs: ending fails, the result says so,
    and nothing is lost. Restarted (on a new port), the broker is found again by the
    producer's session, and a check commits the transaction."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with InProcessCluster(tmp_path, nameservers=1, brokers=("broker-a",)) as cluster:
        await cluster.create_topic(TOPIC, queues=2)

        async def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
            await cluster.stop_broker("broker-a")
            return TransactionDecision.COMMIT

        async def listener(m: StoredMessage) -> TransactionDecision:
            return TransactionDecision.COMMIT

        async with TransactionProducer(
            cluster.namesrv, GROUP, listener, client_id="restarts@1", route_refresh_interval=0.5
        ) as producer:
            result = await producer.send_in_transaction(Message(TOPIC, b"survives"), executor)
            assert (result.decision, result.end_outcome, result.pending) == (
                TransactionDecision.COMMIT,
                EndOutcome.FAILED,
                True,
            )
            assert "broker broker-a" in result.end_error
            assert f"ending transaction {result.message_id} (COMMIT)" in caplog.text
            await cluster.start_broker("broker-a")
            await cluster.wait_registered({"broker-a"}, 10.0)
            await wait_producer(cluster, "restarts@1")
            assert (await check_half(cluster, result)).outcome == transaction_pb2.CHECK_SENT
            got = await consume(cluster, lambda g: result.message_id in g)
    assert [m.body for m in got[result.message_id]] == [b"survives"]


async def test_a_restarted_producer_answers_the_checks_its_predecessor_left(
    cluster: InProcessCluster,
) -> None:
    """A new producer of the group with ``topics`` has sessions before it sends anything."""
    async with TransactionProducer(cluster.namesrv, GROUP) as first:
        left = await first.send_in_transaction(
            Message(TOPIC, b"left open"), decide(TransactionDecision.UNKNOWN)
        )

    async def listener(m: StoredMessage) -> TransactionDecision:
        return TransactionDecision.COMMIT

    async with TransactionProducer(
        cluster.namesrv, GROUP, listener, client_id="next@1", topics=[TOPIC]
    ) as second:
        await wait_producer(cluster, "next@1")
        assert (await check_half(cluster, left)).outcome == transaction_pb2.CHECK_SENT
        got = await consume(cluster, lambda g: left.message_id in g)
        assert second.check_stats().answered == 1
    assert [m.body for m in got[left.message_id]] == [b"left open"]


# -- refusals ------------------------------------------------------------------------------------


REFUSED: list[tuple[object, type[ApogeeError], str]] = [
    (
        [Message(TOPIC, b"a"), Message(TOPIC, b"b")],
        InvalidArgumentError,
        "message: send_in_transaction takes one message, got a list of 2 (a batch cannot be "
        "sent in a transaction)",
    ),
    (
        Message(TOPIC, b"x", delay_level=2),
        InvalidArgumentError,
        "delay_level: a transactional message cannot be delayed; got level 2, must be 0",
    ),
    (
        Message(TOPIC, b"x", deliver_at=1_900_000_000),
        InvalidArgumentError,
        "deliver_at: a transactional message cannot be delayed; must be None, got 1900000000",
    ),
    (
        Message(TOPIC, b"x", properties={"TRAN_MSG": "true"}),
        InvalidPropertyError,
        "property 'TRAN_MSG': is set by brokers only; use Message.delay_level or "
        "Message.deliver_at for a delayed message",
    ),
]


@pytest.mark.parametrize(("message", "kind", "sentence"), REFUSED)
async def test_bad_input_is_refused_before_anything_is_stored(
    cluster: InProcessCluster, message: object, kind: type[ApogeeError], sentence: str
) -> None:
    before = await half_max(cluster)
    ran: list[object] = []

    def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        ran.append(m)
        return TransactionDecision.COMMIT

    async with TransactionProducer(cluster.namesrv, GROUP) as producer:
        with pytest.raises(kind) as caught:
            await producer.send_in_transaction(message, executor)  # type: ignore[arg-type]
    assert str(caught.value) == sentence
    assert caught.value.code == "INVALID_ARGUMENT"
    assert ran == []
    assert await half_max(cluster) == before


# -- the sync twin -------------------------------------------------------------------------------


async def test_the_sync_producer_commits_and_answers_checks(cluster: InProcessCluster) -> None:
    def run() -> tuple[TransactionResult, TransactionResult, list[str], list[str]]:
        caller = threading.current_thread().name
        executor_threads: list[str] = []
        answered: list[str] = []

        def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
            executor_threads.append(threading.current_thread().name)
            return TransactionDecision.COMMIT if arg == "now" else TransactionDecision.UNKNOWN

        def listener(m: StoredMessage) -> TransactionDecision:
            answered.append(m.unique_id)
            return TransactionDecision.COMMIT

        with SyncTransactionProducer(
            cluster.namesrv, GROUP, listener, client_id="sync@1"
        ) as producer:
            now = producer.send_in_transaction(Message(TOPIC, b"now"), executor, "now")
            later = producer.send_in_transaction(Message(TOPIC, b"later"), executor, "later")
            fut = asyncio.run_coroutine_threadsafe(_check_later(cluster, later), loop)
            fut.result(20)
            wait_until(lambda: producer.check_stats().answered >= 1, 5, "the check answered")
        assert executor_threads == [caller, caller]
        return now, later, answered, executor_threads

    loop = asyncio.get_running_loop()
    now, later, answered, _ = await asyncio.to_thread(run)
    assert (now.end_outcome, later.end_outcome) == (EndOutcome.COMMITTED, EndOutcome.NOT_ENDED)
    assert answered == [later.message_id]
    got = await consume(cluster, lambda g: now.message_id in g and later.message_id in g)
    assert [len(got[now.message_id]), len(got[later.message_id])] == [1, 1]


async def _check_later(cluster: InProcessCluster, later: TransactionResult) -> None:
    await wait_producer(cluster, "sync@1")
    assert (await check_half(cluster, later)).outcome == transaction_pb2.CHECK_SENT
