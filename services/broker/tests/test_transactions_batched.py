"""SendHalves and EndTransactions over real gRPC against a real broker: each half and each end
of a shared request is answered on its own, in order, as the single call would answer it; and
the memory of recent halves that lets an end skip reading its half back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.codec import Message
from apogee.common.topics import TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC
from apogee.store import AppendResult
from apogee.testkit.broker import running_broker, small_settings
from apogee.testkit.broker_txn import GROUP, TOPIC, payment, pb, put_topic, read, read_topic
from apogee.v1 import common_pb2, transaction_pb2, transaction_pb2_grpc
from apogee_broker.app import BrokerApp
from apogee_broker.core.txn.records import stored_copy
from apogee_broker.core.txn.state import RecentHalves

pytestmark = pytest.mark.integration


def settings(data_dir: Path, **extra: Any) -> Any:
    return small_settings(data_dir, broker_name="b1", max_messages_per_request=8, **extra)


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[BrokerApp]:
    async with running_broker(settings(tmp_path / "broker")) as app:
        await put_topic(app, TOPIC, 2)
        yield app


@pytest.fixture
async def channel(app: BrokerApp) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(app.address) as ch:
        yield ch


def txn(ch: grpc.aio.Channel) -> transaction_pb2_grpc.TransactionAsyncStub:
    return transaction_pb2_grpc.TransactionStub(ch)


async def send_halves(
    stub: transaction_pb2_grpc.TransactionAsyncStub,
    *messages: common_pb2.Message,
    group: str = GROUP,
) -> transaction_pb2.SendHalvesResponse:
    return await stub.SendHalves(
        pb.SendHalvesRequest(producer_group=group, messages=messages), timeout=5
    )


def end_of(
    half: transaction_pb2.SendHalfResponse,
    decision: pb.TransactionDecision.ValueType,
    **kw: Any,
) -> transaction_pb2.EndTransactionRequest:
    values: dict[str, Any] = {
        "producer_group": GROUP,
        "unique_id": half.unique_id,
        "half_offset": half.half_offset,
        "decision": decision,
        "source": pb.PRODUCER,
        "client_id": "producer-1",
    }
    values.update(kw)
    return pb.EndTransactionRequest(**values)


async def test_halves_sent_together_are_answered_one_by_one(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    stub = txn(channel)
    resp = await send_halves(
        stub,
        payment(unique_id="TX-A"),
        payment(unique_id="TX-B", delay_level=3),
        payment(unique_id="TX-C", queue_id=-1),
        payment(unique_id="TX-D", topic=TRANS_HALF_TOPIC),
        payment(unique_id="TX-E", properties={"DELAY": "2"}),
    )
    assert resp.broker_name == "b1"
    a, b, c, d, e = resp.results
    assert (a.status.code, a.half.unique_id, a.half.half_offset, a.half.queue_id) == (
        0,
        "TX-A",
        0,
        1,
    )
    assert (c.status.code, c.half.unique_id, c.half.half_offset) == (0, "TX-C", 1)
    assert (b.status.reason, b.HasField("half")) == ("INVALID_ARGUMENT", False)
    assert b.status.message.startswith(
        "messages[1].delay_level: is 3; a transactional message cannot be delayed"
    )
    assert d.status.reason == "PERMISSION_DENIED"
    assert "is a system topic" in d.status.message
    assert (e.status.reason, e.status.message.split(":")[0]) == (
        "INVALID_PROPERTY",
        "property 'DELAY'",
    )
    stored = await read(channel, TRANS_HALF_TOPIC, 0)
    assert [m.unique_id for m in stored] == ["TX-A", "TX-C"]
    assert await read_topic(app, channel) == []


async def test_a_request_of_nothing_or_of_too_much_is_refused_whole(
    channel: grpc.aio.Channel,
) -> None:
    stub = txn(channel)
    cases: list[tuple[Any, str]] = [
        (stub.SendHalves(pb.SendHalvesRequest(producer_group=GROUP)), "messages: must not be"),
        (
            stub.SendHalves(pb.SendHalvesRequest(producer_group=GROUP, messages=[payment()] * 9)),
            "messages: 9 half messages in one request; at most 8 are allowed "
            "(max_messages_per_request)",
        ),
        (
            stub.SendHalves(pb.SendHalvesRequest(producer_group="", messages=[payment()])),
            "producer_group: must not be empty",
        ),
        (stub.EndTransactions(pb.EndTransactionsRequest()), "ends: must not be empty"),
        (
            stub.EndTransactions(
                pb.EndTransactionsRequest(
                    ends=[pb.EndTransactionRequest(producer_group=GROUP, unique_id="X")] * 9
                )
            ),
            "ends: 9 ends in one request; at most 8 are allowed (max_messages_per_request)",
        ),
    ]
    for call, sentence in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith(sentence), err.value.details()


async def test_ends_together_each_get_what_the_single_call_would_answer(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    stub = txn(channel)
    sent = await send_halves(stub, *(payment(unique_id=f"TX-{i}") for i in range(5)))
    h = [r.half for r in sent.results]
    resp = await stub.EndTransactions(
        pb.EndTransactionsRequest(
            ends=[
                end_of(h[0], pb.COMMIT),
                end_of(h[1], pb.ROLLBACK),
                end_of(h[2], pb.UNKNOWN, source=pb.CHECK),
                end_of(h[3], pb.COMMIT, producer_group="someone-else"),
                end_of(h[4], pb.TRANSACTION_DECISION_UNSPECIFIED),
                end_of(h[4], pb.COMMIT, unique_id="NO-SUCH", half_offset=99),
            ]
        ),
        timeout=5,
    )
    committed, rolled, unknown, group, decision, offset = resp.results
    assert (committed.status.code, committed.end.outcome, committed.end.topic) == (
        0,
        pb.COMMITTED,
        TOPIC,
    )
    assert (rolled.end.outcome, unknown.end.outcome) == (pb.ROLLED_BACK, pb.STILL_PENDING)
    assert group.status.reason == "INVALID_ARGUMENT"
    assert group.status.message == (
        "producer_group: 'someone-else' is not the group of transaction 'TX-3' (its half was "
        f"sent by group '{GROUP}')"
    )
    assert decision.status.message.startswith(
        "decision: must be COMMIT, ROLLBACK or UNKNOWN (what the producer knows of its local "
        "transaction), got TRANSACTION_DECISION_UNSPECIFIED"
    )
    assert offset.status.message.startswith(
        f"half_offset: 99 is beyond the end of {TRANS_HALF_TOPIC}"
    )
    [real] = await read_topic(app, channel)
    assert (real.unique_id, real.body, real.tags, real.keys) == (
        "TX-0",
        b"pay 10",
        "paid",
        ["order-7"],
    )
    assert real.properties["region"] == "eu"
    ops = await read(channel, TRANS_OP_HALF_TOPIC, 0)
    assert sorted((op.properties["TXN_ID"], op.properties["TXN_OP"]) for op in ops) == [
        ("TX-0", "COMMIT"),
        ("TX-1", "ROLLBACK"),
    ]
    # the ones left open end later, one by one, as before
    again = await stub.EndTransactions(
        pb.EndTransactionsRequest(
            ends=[end_of(h[0], pb.COMMIT), end_of(h[2], pb.COMMIT), end_of(h[1], pb.COMMIT)]
        ),
        timeout=5,
    )
    done, late, other = again.results
    assert (done.end.outcome, late.end.outcome) == (pb.ALREADY_DONE, pb.COMMITTED)
    assert (other.status.code, other.status.reason) == (9, "TRANSACTION_DECIDED")
    assert sorted(m.unique_id for m in await read_topic(app, channel)) == [
        "TX-0",
        "TX-2",
    ]


async def test_a_transaction_named_twice_in_one_request_is_committed_once(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    stub = txn(channel)
    [sent] = (await send_halves(stub, payment(unique_id="TWICE"))).results
    h = sent.half
    resp = await stub.EndTransactions(
        pb.EndTransactionsRequest(
            ends=[
                end_of(h, pb.COMMIT),
                end_of(h, pb.COMMIT),
                end_of(h, pb.COMMIT, half_offset=-1),
            ]
        ),
        timeout=5,
    )
    outcomes = sorted(r.end.outcome for r in resp.results)
    assert outcomes == [pb.COMMITTED, pb.ALREADY_DONE, pb.ALREADY_DONE]
    assert [m.unique_id for m in await read_topic(app, channel)] == ["TWICE"]
    assert len(await read(channel, TRANS_OP_HALF_TOPIC, 0)) == 1


async def test_after_a_restart_an_end_reads_its_half_back(tmp_path: Path) -> None:
    data = tmp_path / "broker"
    async with running_broker(settings(data)) as app:
        await put_topic(app, TOPIC, 2)
        async with grpc.aio.insecure_channel(app.address) as ch:
            sent = await send_halves(
                txn(ch),
                payment(unique_id="R-1", flag=5, born_timestamp_ms=1_700_000_000_000),
                payment(unique_id="R-2"),
            )
    async with running_broker(settings(data)) as app:
        assert app.transactions is not None
        assert len(app.transactions.recent) == 0  # nothing remembered: both are read back
        async with grpc.aio.insecure_channel(app.address) as ch:
            stub = txn(ch)
            h1, h2 = (r.half for r in sent.results)
            resp = await stub.EndTransactions(
                pb.EndTransactionsRequest(ends=[end_of(h1, pb.COMMIT), end_of(h2, pb.ROLLBACK)]),
                timeout=5,
            )
            assert [r.end.outcome for r in resp.results] == [pb.COMMITTED, pb.ROLLED_BACK]
            [real] = await read_topic(app, ch)
            assert (real.unique_id, real.flag, real.born_timestamp) == (
                "R-1",
                5,
                1_700_000_000_000,
            )


# -- the memory of recent halves -----------------------------------------------------------------


def _copy(offset: int, body: bytes = b"x") -> Any:
    msg = Message("RMQ_SYS_TRANS_HALF_TOPIC", body, 0, None, (), {"REAL_TOPIC": "T"}, f"U{offset}")
    where = AppendResult(
        "RMQ_SYS_TRANS_HALF_TOPIC", 0, offset, offset * 100, 200, 0, (), f"U{offset}", 1
    )
    return stored_copy(msg, where)


@pytest.mark.unit
def test_recent_halves_forget_the_oldest_beyond_their_bounds() -> None:
    recent = RecentHalves(max_count=3, max_bytes=10)
    for i in range(4):
        recent.add(_copy(i))
    assert len(recent) == 3
    assert recent.get(0) is None
    assert recent.get(3) is not None
    recent.add(_copy(4, b"123456789"))  # 9 bytes: only it and one more fit in 10
    assert [o for o in range(5) if recent.get(o) is not None] == [3, 4]
    assert recent.nbytes == 10
    recent.forget(4)
    recent.forget(4)  # forgetting twice is harmless
    assert (len(recent), recent.nbytes) == (1, 1)


@pytest.mark.unit
def test_a_remembered_half_reads_as_the_stored_one() -> None:
    c = _copy(7)
    assert (c.info.queue_offset, c.info.phys_offset, c.info.unique_id, c.info.real_topic) == (
        7,
        700,
        "U7",
        "T",
    )
    assert (c.info.check_times, c.info.first_stored_ms, c.info.store_timestamp) == (0, 1, 1)
