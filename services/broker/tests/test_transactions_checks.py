"""The checker's side of transactions over real gRPC against a real broker: producer sessions,
CheckHalf (sent, no producer, closed, decided, gave up, gone), the scans, the progress and the
pending list."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.common.topics import TRANS_CHECK_MAX_TIME_TOPIC, TRANS_HALF_TOPIC
from apogee.testkit.broker import running_broker, small_settings
from apogee.testkit.broker_txn import (
    GROUP,
    TOPIC,
    TXN_PROPERTIES,
    end,
    payment,
    pb,
    put_topic,
    read,
    read_topic,
    refused,
    send_half,
)
from apogee.testkit.waiting import eventually
from apogee.v1 import (
    transaction_pb2,
    transaction_pb2_grpc,
)
from apogee_broker.app import BrokerApp
from apogee_broker.core.txn.state import DecidedTransactions

pytestmark = pytest.mark.integration

# -- helpers ---------------------------------------------------------------------------------------


def settings(data_dir: Path, **extra: Any) -> Any:
    return small_settings(data_dir, broker_name="b1", **extra)


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[BrokerApp]:
    async with running_broker(settings(tmp_path / "broker")) as app:
        await put_topic(app, TOPIC, 2)
        await put_topic(app, "Refunds", 1)
        yield app


@pytest.fixture
async def channel(app: BrokerApp) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(app.address) as ch:
        yield ch


def checker(ch: grpc.aio.Channel) -> transaction_pb2_grpc.TransactionCheckAsyncStub:
    return transaction_pb2_grpc.TransactionCheckStub(ch)


async def check(
    ch: grpc.aio.Channel, offset: int, max_check_times: int = 0
) -> transaction_pb2.CheckHalfResponse:
    return await checker(ch).CheckHalf(
        pb.CheckHalfRequest(half_offset=offset, max_check_times=max_check_times), timeout=5
    )


async def state(ch: grpc.aio.Channel) -> transaction_pb2.GetTransactionStateResponse:
    return await checker(ch).GetTransactionState(pb.GetTransactionStateRequest(), timeout=5)


async def producers(ch: grpc.aio.Channel) -> dict[str, list[str]]:
    return {p.producer_group: list(p.client_ids) for p in (await state(ch)).producers}


class Producer:
    """A producer's session stream, fed from a queue."""

    def __init__(self, ch: grpc.aio.Channel) -> None:
        self.outbox: asyncio.Queue[transaction_pb2.ProducerSessionRequest | None] = asyncio.Queue()
        self.call = transaction_pb2_grpc.TransactionStub(ch).ProducerSession(self._requests())

    async def _requests(self) -> AsyncIterator[transaction_pb2.ProducerSessionRequest]:
        while (r := await self.outbox.get()) is not None:
            yield r

    def hello(self, client_id: str, group: str = GROUP, interval_ms: int = 0) -> None:
        self.outbox.put_nowait(
            pb.ProducerSessionRequest(
                hello=pb.ProducerHello(
                    producer_group=group, client_id=client_id, heartbeat_interval_ms=interval_ms
                )
            )
        )

    def heartbeat(self) -> None:
        self.outbox.put_nowait(pb.ProducerSessionRequest(heartbeat_ms=1))

    async def next_check(self, timeout: float = 5.0) -> transaction_pb2.TransactionCheckRequest:
        event = await asyncio.wait_for(self.call.read(), timeout)
        assert isinstance(event, pb.ProducerSessionEvent), event
        return event.check

    async def ended(self, timeout: float = 5.0) -> tuple[grpc.StatusCode, str]:
        """The status the broker ended the stream with."""
        code = await asyncio.wait_for(self.call.code(), timeout)
        return code, await self.call.details() or ""

    def close(self) -> None:
        self.outbox.put_nowait(None)


async def connected(ch: grpc.aio.Channel, client_id: str, group: str = GROUP) -> Producer:
    p = Producer(ch)
    p.hello(client_id, group)

    async def there() -> bool:
        return client_id in (await producers(ch)).get(group, [])

    await eventually(there, 5, f"producer {client_id} listed")
    return p


# -- producer sessions --------------------------------------------------------------------------


async def test_a_session_begins_with_a_hello(channel: grpc.aio.Channel) -> None:
    p = Producer(channel)
    p.heartbeat()
    code, details = await p.ended()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == (
        "hello: the first message of a producer session must be a hello (its producer_group "
        "and client_id), got heartbeat_ms"
    )


@pytest.mark.parametrize(
    ("group", "client_id", "interval", "says"),
    [
        ("", "c1", 0, "hello.producer_group: must not be empty"),
        ("a b", "c1", 0, "hello.producer_group: 'a b' has a character outside"),
        (GROUP, "", 0, "hello.client_id: must not be empty"),
        (GROUP, "c1", -5, "hello.heartbeat_interval_ms: must be between 0 (not said) and"),
    ],
)
async def test_a_bad_hello_ends_the_session(
    channel: grpc.aio.Channel, group: str, client_id: str, interval: int, says: str
) -> None:
    p = Producer(channel)
    p.hello(client_id, group, interval)
    code, details = await p.ended()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(says), details
    assert await producers(channel) == {}


async def test_a_second_hello_ends_the_session_and_the_producer_is_forgotten(
    channel: grpc.aio.Channel,
) -> None:
    p = await connected(channel, "c1")
    p.hello("c1")
    code, details = await p.ended()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("hello: is sent once, as the first message of a session")
    assert await producers(channel) == {}


async def test_a_producer_that_closes_its_stream_is_forgotten_at_once(
    channel: grpc.aio.Channel,
) -> None:
    p = await connected(channel, "c1")
    p.close()
    assert (await p.ended())[0] == grpc.StatusCode.OK

    async def gone() -> bool:
        return await producers(channel) == {}

    await eventually(gone, 5, "the producer forgotten")


async def test_a_silent_producer_expires_and_a_heartbeating_one_stays(tmp_path: Path) -> None:
    async with (
        running_broker(settings(tmp_path / "b", producer_expiry_s=0.6)) as app,
        grpc.aio.insecure_channel(app.address) as ch,
    ):
        silent = await connected(ch, "silent")
        alive = await connected(ch, "alive")
        for _ in range(15):  # 1.5 s: more than twice the expiry of 0.6 s
            alive.heartbeat()
            await asyncio.sleep(0.1)
        code, details = await silent.ended()
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert f"the next heartbeat of producer silent in group {GROUP}" in details
        assert await producers(ch) == {GROUP: ["alive"]}
        alive.close()


async def test_a_newer_session_of_a_client_replaces_the_older(channel: grpc.aio.Channel) -> None:
    old = await connected(channel, "c1")
    new = Producer(channel)
    new.hello("c1")
    code, details = await old.ended()
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "opened a newer session" in details
    assert await producers(channel) == {GROUP: ["c1"]}
    new.close()


async def test_stopping_the_broker_ends_producer_sessions(tmp_path: Path) -> None:
    async with (
        running_broker(settings(tmp_path / "b")) as app,
        grpc.aio.insecure_channel(app.address) as ch,
    ):
        p = await connected(ch, "c1")
        await app.stop()
        code, details = await p.ended()
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "it is stopping" in details


# -- CheckHalf ----------------------------------------------------------------------------------


async def test_a_check_reaches_a_connected_producer_which_answers_it(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel, payment(unique_id="ASK-ME"))
    p = await connected(channel, "c1")
    first = await check(channel, half.half_offset)
    assert (first.outcome, first.new_half_offset, first.producer_client_id, first.check_times) == (
        pb.CHECK_SENT,
        1,
        "c1",
        1,
    )
    asked = await p.next_check()
    assert (asked.unique_id, asked.half_offset, asked.check_times, asked.topic) == (
        "ASK-ME",
        1,
        1,
        TOPIC,
    )
    h = asked.half
    assert (h.topic, h.queue_id, h.queue_offset, h.body, h.unique_id) == (
        TRANS_HALF_TOPIC,
        0,
        1,
        b"pay 10",
        "ASK-ME",
    )
    assert (h.tags, list(h.keys), h.broker_name) == ("paid", ["order-7"], "b1")
    assert h.properties["TRANSACTION_CHECK_TIMES"] == "1"
    assert h.properties["PGROUP"] == GROUP
    assert h.properties["TRAN_FIRST_STORED"] == str(half.store_timestamp_ms)

    # the old copy is closed: a second CheckHalf of it does nothing
    again = await check(channel, half.half_offset)
    assert (again.outcome, again.check_times) == (pb.CLOSED, 0)
    # the producer answers the check, naming the copy it was given
    answer = await end(
        channel, None, pb.COMMIT, unique_id="ASK-ME", half_offset=asked.half_offset, source=pb.CHECK
    )
    assert answer.outcome == pb.COMMITTED
    assert (await check(channel, asked.half_offset)).outcome == pb.CLOSED
    [real] = await read_topic(app, channel)
    assert real.unique_id == "ASK-ME"
    assert not TXN_PROPERTIES & set(real.properties)
    p.close()


async def test_checks_go_to_the_producers_of_the_group_in_turn(channel: grpc.aio.Channel) -> None:
    a = await connected(channel, "a")
    b = await connected(channel, "b")
    other = await connected(channel, "x", group="other-group")
    halves = [await send_half(channel) for _ in range(4)]
    chosen = [(await check(channel, h.half_offset)).producer_client_id for h in halves]
    assert chosen == ["a", "b", "a", "b"]
    assert [(await a.next_check()).unique_id for _ in range(2)] == [
        halves[0].unique_id,
        halves[2].unique_id,
    ]
    assert (await b.next_check()).unique_id == halves[1].unique_id
    for p in (a, b, other):
        p.close()


async def test_no_producer_still_puts_the_half_again(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel)
    got = await check(channel, half.half_offset)
    assert (got.outcome, got.new_half_offset, got.producer_client_id, got.check_times) == (
        pb.NO_PRODUCER,
        1,
        "",
        1,
    )
    second = await check(channel, got.new_half_offset)
    assert (second.outcome, second.new_half_offset, second.check_times) == (pb.NO_PRODUCER, 2, 2)
    scan = await checker(channel).ScanHalf(pb.ScanHalfRequest(offset=0), timeout=5)
    assert [(e.queue_offset, e.check_times) for e in scan.entries] == [(0, 0), (1, 1), (2, 2)]
    assert {e.first_stored_ms for e in scan.entries} == {half.store_timestamp_ms}
    assert {e.unique_id for e in scan.entries} == {half.unique_id}
    assert (scan.next_offset, scan.max_offset) == (3, 3)


async def test_a_decided_transaction_closes_the_copy_checked(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel)
    put = await check(channel, half.half_offset)
    # the producer ends it by the offset SendHalf gave, after the check put a new copy
    assert (await end(channel, half, pb.COMMIT)).outcome == pb.COMMITTED
    scan = await checker(channel).ScanHalf(pb.ScanHalfRequest(offset=1), timeout=5)
    assert [e.decided for e in scan.entries] == [pb.COMMIT]
    decided = await check(channel, put.new_half_offset)
    assert (decided.outcome, decided.check_times) == (pb.DECIDED, 1)
    assert (await check(channel, put.new_half_offset)).outcome == pb.CLOSED
    ops = await checker(channel).ScanOps(pb.ScanOpsRequest(offset=0), timeout=5)
    assert [(e.half_offset, e.decision) for e in ops.entries] == [
        (0, pb.TRANSACTION_DECISION_UNSPECIFIED),  # CHECKED
        (0, pb.COMMIT),
        (1, pb.COMMIT),
    ]
    assert {e.unique_id for e in ops.entries} == {half.unique_id}
    assert len(await read_topic(app, channel)) == 1


async def test_after_the_last_check_the_half_is_kept_for_an_operator(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel, payment(unique_id="STUCK", keys=["order-9"]))
    offset = half.half_offset
    outcomes = []
    for _ in range(3):
        got = await check(channel, offset, max_check_times=2)
        outcomes.append((got.outcome, got.check_times))
        offset = got.new_half_offset
    assert outcomes == [(pb.NO_PRODUCER, 1), (pb.NO_PRODUCER, 2), (pb.GAVE_UP, 2)]
    [kept] = await read(channel, TRANS_CHECK_MAX_TIME_TOPIC, 0)
    assert (kept.unique_id, kept.body) == ("STUCK", b"pay 10")
    props = kept.properties
    assert (props["REAL_TOPIC"], props["PGROUP"], props["TRANSACTION_CHECK_TIMES"]) == (
        TOPIC,
        GROUP,
        "2",
    )
    assert props["TRAN_FIRST_STORED"] == str(half.store_timestamp_ms)
    assert (await check(channel, 2)).outcome == pb.CLOSED  # the last copy was closed

    listed = await checker(channel).ListPending(pb.ListPendingRequest(), timeout=5)
    [p] = listed.pending
    assert (p.unique_id, p.checking, p.check_times, p.offset, p.keys, p.topic) == (
        "STUCK",
        False,
        2,
        0,
        "order-9",
        TOPIC,
    )
    assert p.first_stored_ms == half.store_timestamp_ms

    done = await end(
        channel, None, pb.COMMIT, unique_id="STUCK", half_offset=-1, source=pb.OPERATOR
    )
    assert (done.outcome, done.topic, done.queue_id) == (pb.COMMITTED, TOPIC, 1)
    [real] = await read_topic(app, channel)
    assert real.unique_id == "STUCK"
    assert not TXN_PROPERTIES & set(real.properties)
    assert (await checker(channel).ListPending(pb.ListPendingRequest(), timeout=5)).pending == []
    ops = await checker(channel).ScanOps(pb.ScanOpsRequest(offset=0), timeout=5)
    assert [(e.half_offset, e.decision) for e in ops.entries][-1] == (-1, pb.COMMIT)


async def test_a_half_that_cannot_be_read_is_closed_as_gone(
    app: BrokerApp, channel: grpc.aio.Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    half = await send_half(channel)
    assert app.transactions is not None
    monkeypatch.setattr(app.transactions, "half_at", lambda offset: None)  # retention took it
    assert (await check(channel, half.half_offset)).outcome == pb.GONE
    assert (await check(channel, half.half_offset)).outcome == pb.CLOSED
    ops = await checker(channel).ScanOps(pb.ScanOpsRequest(offset=0), timeout=5)
    assert [(e.half_offset, e.unique_id) for e in ops.entries] == [(0, "")]


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        (pb.CheckHalfRequest(half_offset=-1), "half_offset: must not be negative, got -1"),
        (pb.CheckHalfRequest(half_offset=5), "half_offset: 5 is beyond the end of"),
        (
            pb.CheckHalfRequest(half_offset=0, max_check_times=-1),
            "max_check_times: must be between 0 (the default, 15) and 10000, got -1",
        ),
    ],
)
async def test_a_bad_check_is_refused(
    channel: grpc.aio.Channel, request_: transaction_pb2.CheckHalfRequest, says: str
) -> None:
    await send_half(channel)
    code, details, kind = await refused(checker(channel).CheckHalf(request_, timeout=5))
    assert (code, kind) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    assert details.startswith(says), details


# -- progress -----------------------------------------------------------------------------------


async def test_progress_is_kept_in_a_file_and_survives_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "broker"
    async with running_broker(settings(data)) as app:
        await put_topic(app, TOPIC, 2)
        async with grpc.aio.insecure_channel(app.address) as ch:
            before = await state(ch)
            assert (before.half_progress, before.op_progress, before.progress_updated_ms) == (
                -1,
                -1,
                0,
            )
            assert before.broker_name == "b1"
            halves = [await send_half(ch) for _ in range(3)]
            await end(ch, halves[0], pb.ROLLBACK)
            await checker(ch).CommitTransactionProgress(
                pb.CommitTransactionProgressRequest(half_progress=1, op_progress=1), timeout=5
            )
            after = await state(ch)
            assert (after.half_progress, after.op_progress) == (1, 1)
            assert after.progress_updated_ms > 0
            assert (after.half_min_offset, after.half_max_offset) == (0, 3)
            assert (after.op_min_offset, after.op_max_offset) == (0, 1)
            assert after.now_ms >= after.progress_updated_ms
    saved = json.loads((data / "transactionProgress.json").read_text())
    assert (saved["half_progress"], saved["op_progress"]) == (1, 1)
    async with (
        running_broker(settings(data)) as app,
        grpc.aio.insecure_channel(app.address) as ch,
    ):
        again = await state(ch)
        assert (again.half_progress, again.op_progress) == (1, 1)
        assert again.progress_updated_ms == after.progress_updated_ms
        # a copy before the progress: closed, as its op record (found by its key) says
        assert (await check(ch, 0)).outcome == pb.CLOSED
        assert (await check(ch, 1)).outcome == pb.NO_PRODUCER


@pytest.mark.parametrize(
    ("half", "op", "says"),
    [
        (-1, 0, "half_progress: must not be negative, got -1"),
        (0, -3, "op_progress: must not be negative, got -3"),
        (5, 0, "half_progress: 5 is beyond the end of RMQ_SYS_TRANS_HALF_TOPIC on broker b1"),
        (0, 2**62, "op_progress: 4611686018427387904 is beyond the end of"),
    ],
)
async def test_bad_progress_is_refused(
    channel: grpc.aio.Channel, half: int, op: int, says: str
) -> None:
    code, details, _ = await refused(
        checker(channel).CommitTransactionProgress(
            pb.CommitTransactionProgressRequest(half_progress=half, op_progress=op), timeout=5
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(says), details


async def test_closed_copies_before_the_progress_are_still_known_closed(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel)
    put = await check(channel, half.half_offset)
    await checker(channel).CommitTransactionProgress(
        pb.CommitTransactionProgressRequest(half_progress=1, op_progress=1), timeout=5
    )
    assert app.transactions is not None
    assert 0 not in app.transactions.closed  # forgotten in memory ...
    assert (await check(channel, 0)).outcome == pb.CLOSED  # ... and found in the op records
    assert (await check(channel, put.new_half_offset)).outcome == pb.NO_PRODUCER


async def test_a_decision_older_than_what_is_remembered_is_found_in_the_op_records(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel)
    assert (await end(channel, half, pb.COMMIT)).outcome == pb.COMMITTED
    assert app.transactions is not None
    # as after a restart that read only the newest op records: nothing remembered before here
    app.transactions.decided = DecidedTransactions(complete_from_phys=2**62)
    again = await end(channel, half, pb.COMMIT)
    assert (again.outcome, again.topic, again.queue_offset) == (pb.ALREADY_DONE, TOPIC, 0)
    code, _, _ = await refused(end(channel, half, pb.ROLLBACK))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert len(await read_topic(app, channel)) == 1


# -- scans and the pending list -----------------------------------------------------------------


async def test_scans_start_where_asked_and_stop_at_the_bound(channel: grpc.aio.Channel) -> None:
    for _ in range(5):
        await send_half(channel)
    c = checker(channel)
    got = await c.ScanHalf(pb.ScanHalfRequest(offset=1, max_entries=2), timeout=5)
    assert ([e.queue_offset for e in got.entries], got.next_offset, got.max_offset) == (
        [1, 2],
        3,
        5,
    )
    beyond = await c.ScanHalf(pb.ScanHalfRequest(offset=99), timeout=5)
    assert (list(beyond.entries), beyond.next_offset) == ([], 5)
    none = await c.ScanOps(pb.ScanOpsRequest(offset=0), timeout=5)
    assert (list(none.entries), none.next_offset, none.max_offset) == ([], 0, 0)
    code, details, _ = await refused(c.ScanHalf(pb.ScanHalfRequest(offset=-1), timeout=5))
    assert (code, details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "offset: must not be negative, got -1",
    )


async def test_pending_lists_the_newest_copy_of_each_undecided_transaction(
    channel: grpc.aio.Channel,
) -> None:
    a = await send_half(channel, payment(unique_id="A"))
    b = await send_half(channel, payment(unique_id="B"), group="other-group")
    c = await send_half(channel, payment(unique_id="C", topic="Refunds", queue_id=0))
    d = await send_half(channel, payment(unique_id="D"))
    await end(channel, d, pb.ROLLBACK)
    put = await check(channel, a.half_offset)  # A's newest copy is the one put again
    c_ = checker(channel)
    everything = await c_.ListPending(pb.ListPendingRequest(), timeout=5)
    assert everything.broker_name == "b1"
    assert not everything.more
    assert [(p.unique_id, p.offset, p.check_times, p.checking) for p in everything.pending] == [
        ("A", put.new_half_offset, 1, True),
        ("B", b.half_offset, 0, True),
        ("C", c.half_offset, 0, True),
    ]
    assert [p.first_stored_ms for p in everything.pending] == [
        a.store_timestamp_ms,
        b.store_timestamp_ms,
        c.store_timestamp_ms,
    ]
    by_group = await c_.ListPending(pb.ListPendingRequest(producer_group="other-group"), timeout=5)
    assert [p.unique_id for p in by_group.pending] == ["B"]
    by_topic = await c_.ListPending(pb.ListPendingRequest(topic="Refunds"), timeout=5)
    assert [(p.unique_id, p.topic) for p in by_topic.pending] == [("C", "Refunds")]
    one = await c_.ListPending(pb.ListPendingRequest(max_entries=1), timeout=5)
    assert ([p.unique_id for p in one.pending], one.more) == (["A"], True)
    code, details, _ = await refused(c_.ListPending(pb.ListPendingRequest(topic="a b"), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "topic 'a b': has a character outside [%|a-zA-Z0-9_-]"


async def test_the_same_decision_again_closes_a_copy_still_open(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel)
    put = await check(channel, half.half_offset)
    assert (await end(channel, half, pb.COMMIT)).outcome == pb.COMMITTED
    again = await end(channel, None, pb.COMMIT, unique_id=half.unique_id, half_offset=1)
    assert (again.outcome, again.queue_offset) == (pb.ALREADY_DONE, 0)
    assert (await check(channel, put.new_half_offset)).outcome == pb.CLOSED
    ops = await checker(channel).ScanOps(pb.ScanOpsRequest(offset=0), timeout=5)
    assert [(e.half_offset, e.decision) for e in ops.entries] == [
        (0, pb.TRANSACTION_DECISION_UNSPECIFIED),
        (0, pb.COMMIT),
        (1, pb.COMMIT),
    ]
    assert len(await read_topic(app, channel)) == 1


async def test_ending_by_id_closes_every_open_copy(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel)
    put = await check(channel, half.half_offset)
    done = await end(channel, None, pb.ROLLBACK, unique_id=half.unique_id, half_offset=-1)
    assert done.outcome == pb.ROLLED_BACK
    assert (await check(channel, put.new_half_offset)).outcome == pb.CLOSED
    ops = await checker(channel).ScanOps(pb.ScanOpsRequest(offset=0), timeout=5)
    assert [(e.half_offset, e.decision) for e in ops.entries] == [
        (0, pb.TRANSACTION_DECISION_UNSPECIFIED),
        (1, pb.ROLLBACK),
    ]
    assert await read_topic(app, channel) == []
