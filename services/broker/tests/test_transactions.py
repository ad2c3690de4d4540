"""Transactional messages over real gRPC against a real broker: SendHalf, EndTransaction and
what a restart keeps (the decisions, rebuilt from the op queue)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.common.topics import TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC
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
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    transaction_pb2,
    transaction_pb2_grpc,
)
from apogee_broker.app import BrokerApp

pytestmark = pytest.mark.integration


def settings(data_dir: Path, **extra: Any) -> Any:
    return small_settings(data_dir, broker_name="b1", **extra)


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[BrokerApp]:
    async with running_broker(settings(tmp_path / "broker")) as app:
        await put_topic(app, TOPIC, 2)
        yield app


@pytest.fixture
async def channel(app: BrokerApp) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(app.address) as ch:
        yield ch


# -- SendHalf -----------------------------------------------------------------------------------


async def test_a_half_is_stored_in_the_half_queue_and_invisible_to_readers_of_its_topic(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel, payment(unique_id="TX-1"))
    assert (half.unique_id, half.half_offset, half.broker_name, half.queue_id) == (
        "TX-1",
        0,
        "b1",
        1,
    )
    assert half.store_timestamp_ms > 0
    assert await read_topic(app, channel) == []
    [stored] = await read(channel, TRANS_HALF_TOPIC, 0)
    props = stored.properties
    assert stored.unique_id == "TX-1"
    assert stored.body == b"pay 10"
    assert (stored.tags, stored.keys) == ("paid", ["order-7"])
    assert {k: props[k] for k in ("REAL_TOPIC", "REAL_QID", "TRAN_MSG", "PGROUP", "region")} == {
        "REAL_TOPIC": TOPIC,
        "REAL_QID": "1",
        "TRAN_MSG": "true",
        "PGROUP": GROUP,
        "region": "eu",
    }
    assert "TRANSACTION_CHECK_TIMES" not in props


async def test_the_broker_names_the_transaction_and_picks_queues_in_turn(
    channel: grpc.aio.Channel,
) -> None:
    sent = [await send_half(channel, payment(queue_id=-1)) for _ in range(4)]
    assert [s.queue_id for s in sent] == [0, 1, 0, 1]
    assert [s.half_offset for s in sent] == [0, 1, 2, 3]
    ids = [s.unique_id for s in sent]
    assert all(ids)
    assert len(set(ids)) == 4


@pytest.mark.parametrize(
    ("request_", "code", "kind", "says"),
    [
        (
            pb.SendHalfRequest(producer_group="", message=payment()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "producer_group: must not be empty",
        ),
        (
            pb.SendHalfRequest(producer_group="a b", message=payment()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "producer_group: 'a b' has a character outside [%|a-zA-Z0-9_-]",
        ),
        (
            pb.SendHalfRequest(producer_group=GROUP, message=payment(delay_level=3)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "message.delay_level: is 3; a transactional message cannot be delayed",
        ),
        (
            pb.SendHalfRequest(producer_group=GROUP, message=payment(deliver_at_ms=2_000_000)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "message.deliver_at_ms: is 2000000; a transactional message cannot be delayed",
        ),
        (
            pb.SendHalfRequest(producer_group=GROUP, message=payment(properties={"DELAY": "2"})),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_PROPERTY",
            "property 'DELAY': is set by brokers only; a transactional message cannot be delayed",
        ),
        (
            pb.SendHalfRequest(producer_group=GROUP, message=payment(properties={"PGROUP": "x"})),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_PROPERTY",
            "property 'PGROUP': is set by brokers only",
        ),
        (
            pb.SendHalfRequest(
                producer_group=GROUP, message=payment(properties={"TRAN_MSG": "true"})
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_PROPERTY",
            "property 'TRAN_MSG': is set by brokers only",
        ),
        (
            pb.SendHalfRequest(
                producer_group=GROUP, message=payment(topic=TRANS_HALF_TOPIC, queue_id=0)
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "PERMISSION_DENIED",
            "topic 'RMQ_SYS_TRANS_HALF_TOPIC': is a system topic; clients cannot send to it",
        ),
        (
            pb.SendHalfRequest(producer_group=GROUP, message=payment(topic="NoSuchTopic")),
            grpc.StatusCode.NOT_FOUND,
            "UNKNOWN_TOPIC",
            "topic 'NoSuchTopic' does not exist on broker b1",
        ),
        (
            pb.SendHalfRequest(
                producer_group=GROUP,
                message=payment(properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "0"}),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_PROPERTY",
            "property 'CHECK_IMMUNITY_TIME_IN_SECONDS': must be a whole number of seconds from "
            "1 to 86400",
        ),
        (
            pb.SendHalfRequest(
                producer_group=GROUP,
                message=payment(properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "1.5"}),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_PROPERTY",
            "got '1.5'",
        ),
        (
            pb.SendHalfRequest(producer_group=GROUP, message=payment(body=b"")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "message.body: must not be empty",
        ),
        (
            pb.SendHalfRequest(producer_group=GROUP, message=payment(queue_id=2)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_QUEUE_ID",
            "queue_id 2: must be between 0 and 1",
        ),
        (
            pb.SendHalfRequest(producer_group=GROUP, message=payment(unique_id="a b")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "unique_id: must not contain spaces or control characters",
        ),
        (
            pb.SendHalfRequest(producer_group=GROUP, message=payment(sys_flag=1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "message.body: is flagged compressed (sys_flag 0x1) but",
        ),
    ],
    ids=[
        "empty group",
        "bad group",
        "delay level",
        "deliver at",
        "DELAY property",
        "broker-only PGROUP",
        "broker-only TRAN_MSG",
        "reserved topic",
        "unknown topic",
        "immunity zero",
        "immunity not whole",
        "empty body",
        "queue out of range",
        "bad unique id",
        "not zlib",
    ],
)
async def test_a_bad_half_is_refused_naming_the_field_and_the_rule(
    app: BrokerApp,
    channel: grpc.aio.Channel,
    request_: transaction_pb2.SendHalfRequest,
    code: grpc.StatusCode,
    kind: str,
    says: str,
) -> None:
    stub = transaction_pb2_grpc.TransactionStub(channel)
    got_code, sentence, got_kind = await refused(stub.SendHalf(request_, timeout=5))
    assert (got_code, got_kind) == (code, kind), sentence
    assert says in sentence
    assert app.store is not None
    assert app.store.max_offset(TRANS_HALF_TOPIC, 0) == 0  # nothing stored


async def test_an_immunity_in_range_is_kept_and_scanned(channel: grpc.aio.Channel) -> None:
    half = await send_half(
        channel, payment(properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "30", "a": "b"})
    )
    check = transaction_pb2_grpc.TransactionCheckStub(channel)
    scan = await check.ScanHalf(pb.ScanHalfRequest(offset=0), timeout=5)
    [entry] = scan.entries
    assert (entry.unique_id, entry.immunity_ms, entry.topic, entry.producer_group) == (
        half.unique_id,
        30_000,
        TOPIC,
        GROUP,
    )


# -- EndTransaction -----------------------------------------------------------------------------


async def test_a_commit_stores_the_real_message_once_with_the_halfs_identity(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(
        channel, payment(unique_id="TX-C", born_timestamp_ms=1_700_000_000_000, flag=7)
    )
    done = await end(channel, half, pb.COMMIT)
    assert (done.outcome, done.topic, done.queue_id, done.queue_offset) == (
        pb.COMMITTED,
        TOPIC,
        1,
        0,
    )
    [real] = await read_topic(app, channel)
    assert (real.unique_id, real.body, real.tags, real.keys) == (
        "TX-C",
        b"pay 10",
        "paid",
        ["order-7"],
    )
    assert (real.born_timestamp, real.flag, real.queue_id) == (1_700_000_000_000, 7, 1)
    props = real.properties
    assert props["region"] == "eu"
    assert not TXN_PROPERTIES & set(props), props
    # the op record closes the half
    [op] = await read(channel, TRANS_OP_HALF_TOPIC, 0)
    assert (op.body, op.tags) == (b"0", "d")
    assert op.properties["TXN_ID"] == "TX-C"
    assert op.properties["TXN_OP"] == "COMMIT"

    again = await end(channel, half, pb.COMMIT)
    assert (again.outcome, again.topic, again.queue_id, again.queue_offset) == (
        pb.ALREADY_DONE,
        TOPIC,
        1,
        0,
    )
    assert len(await read_topic(app, channel)) == 1
    assert len(await read(channel, TRANS_OP_HALF_TOPIC, 0)) == 1  # no second op

    code, sentence, kind = await refused(end(channel, half, pb.ROLLBACK))
    assert (code, kind) == (grpc.StatusCode.FAILED_PRECONDITION, "TRANSACTION_DECIDED")
    assert sentence.startswith("transaction 'TX-C' was already committed at 20")
    assert sentence.endswith("; it cannot be rolled back now")


async def test_a_rolled_back_half_is_never_visible(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel)
    assert (await end(channel, half, pb.ROLLBACK)).outcome == pb.ROLLED_BACK
    assert (await end(channel, half, pb.ROLLBACK)).outcome == pb.ALREADY_DONE
    code, sentence, _ = await refused(end(channel, half, pb.COMMIT))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "was already rolled back at" in sentence
    assert await read_topic(app, channel) == []
    [op] = await read(channel, TRANS_OP_HALF_TOPIC, 0)
    assert op.properties["TXN_OP"] == "ROLLBACK"


async def test_unknown_changes_nothing(app: BrokerApp, channel: grpc.aio.Channel) -> None:
    half = await send_half(channel)
    assert (await end(channel, half, pb.UNKNOWN, source=pb.CHECK)).outcome == pb.STILL_PENDING
    assert await read_topic(app, channel) == []
    assert app.store is not None
    assert app.store.max_offset(TRANS_OP_HALF_TOPIC, 0) == 0
    assert (await end(channel, half, pb.COMMIT)).outcome == pb.COMMITTED


async def test_a_transaction_is_found_by_its_id_alone(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel, payment(unique_id="BY-ID"))
    done = await end(channel, None, pb.COMMIT, unique_id="BY-ID", half_offset=-1)
    assert (done.outcome, done.queue_offset) == (pb.COMMITTED, 0)
    again = await end(channel, half, pb.COMMIT)
    assert again.outcome == pb.ALREADY_DONE
    assert len(await read_topic(app, channel)) == 1


async def test_concurrent_commits_of_one_transaction_store_it_once(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel)
    outcomes = await asyncio.gather(*(end(channel, half, pb.COMMIT) for _ in range(8)))
    assert sorted(o.outcome for o in outcomes) == [pb.COMMITTED] + [pb.ALREADY_DONE] * 7
    assert len(await read_topic(app, channel)) == 1
    assert app.transactions is not None
    assert len(app.transactions.locks) == 0  # each transaction's lock is dropped after use


@pytest.mark.parametrize(
    ("changes", "code", "kind", "says"),
    [
        (
            {"unique_id": "NOPE", "half_offset": -1},
            grpc.StatusCode.NOT_FOUND,
            "NOT_FOUND",
            "transaction 'NOPE' not found: broker b1 holds no half message with this id",
        ),
        (
            {"unique_id": "OTHER"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "unique_id: 'OTHER' is not the transaction of the half at offset 0 (that is 'TX-E')",
        ),
        (
            {"group": "someone-else"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "producer_group: 'someone-else' is not the group of transaction 'TX-E' (its half "
            f"was sent by group '{GROUP}')",
        ),
        (
            {"group": ""},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "producer_group: must not be empty",
        ),
        (
            {"half_offset": 9},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "half_offset: 9 is beyond the end of RMQ_SYS_TRANS_HALF_TOPIC on broker b1 (its max "
            "offset is 1)",
        ),
        (
            {"half_offset": -2},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "half_offset: must be the half's offset (0 or more), or -1",
        ),
        (
            {"decision": pb.TRANSACTION_DECISION_UNSPECIFIED},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "decision: must be COMMIT, ROLLBACK or UNKNOWN (what the producer knows of its "
            "local transaction), got TRANSACTION_DECISION_UNSPECIFIED",
        ),
        (
            {"source": 42},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "source: must be PRODUCER, CHECK or OPERATOR (or unspecified, taken as PRODUCER), "
            "got 42",
        ),
        (
            {"unique_id": "a\tb"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "unique_id: must not contain spaces or control characters",
        ),
    ],
    ids=[
        "unknown id",
        "other id",
        "other group",
        "no group",
        "beyond",
        "negative",
        "no decision",
        "bad source",
        "bad id",
    ],
)
async def test_a_bad_end_is_refused_naming_the_field_and_the_rule(
    app: BrokerApp,
    channel: grpc.aio.Channel,
    changes: dict[str, Any],
    code: grpc.StatusCode,
    kind: str,
    says: str,
) -> None:
    half = await send_half(channel, payment(unique_id="TX-E"))
    request = pb.EndTransactionRequest(
        producer_group=changes.get("group", GROUP),
        unique_id=changes.get("unique_id", half.unique_id),
        half_offset=changes.get("half_offset", half.half_offset),
        decision=changes.get("decision", pb.COMMIT),
        source=changes.get("source", pb.PRODUCER),
    )
    stub = transaction_pb2_grpc.TransactionStub(channel)
    got_code, sentence, got_kind = await refused(stub.EndTransaction(request, timeout=5))
    assert (got_code, got_kind) == (code, kind), sentence
    assert says in sentence
    assert await read_topic(app, channel) == []
    assert (await end(channel, half, pb.COMMIT)).outcome == pb.COMMITTED  # still pending


async def test_an_operator_may_end_a_transaction_without_naming_its_group(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    half = await send_half(channel)
    done = await end(channel, half, pb.ROLLBACK, group="", source=pb.OPERATOR)
    assert done.outcome == pb.ROLLED_BACK


async def test_a_commit_whose_topic_is_gone_leaves_the_half_pending(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    await put_topic(app, "Doomed", 1)
    half = await send_half(channel, payment(topic="Doomed", queue_id=0))
    await broker_pb2_grpc.BrokerAdminStub(channel).DeleteTopic(
        broker_pb2.DeleteTopicRequest(topic="Doomed"), timeout=5
    )
    code, sentence, kind = await refused(end(channel, half, pb.COMMIT))
    assert (code, kind) == (grpc.StatusCode.NOT_FOUND, "UNKNOWN_TOPIC")
    assert sentence.startswith("topic 'Doomed' does not exist on broker b1 any more")
    assert "stays pending" in sentence
    await put_topic(app, "Doomed", 1)
    assert (await end(channel, half, pb.COMMIT)).outcome == pb.COMMITTED
    assert len(await read(channel, "Doomed", 0)) == 1


# -- restarts -----------------------------------------------------------------------------------


async def test_a_decision_survives_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "broker"
    async with running_broker(settings(data)) as app:
        await put_topic(app, TOPIC, 2)
        async with grpc.aio.insecure_channel(app.address) as ch:
            committed = await send_half(ch, payment(unique_id="KEPT"))
            rolled = await send_half(ch, payment(unique_id="DROPPED"))
            pending = await send_half(ch, payment(unique_id="OPEN"))
            assert (await end(ch, committed, pb.COMMIT)).outcome == pb.COMMITTED
            assert (await end(ch, rolled, pb.ROLLBACK)).outcome == pb.ROLLED_BACK
    async with running_broker(settings(data)) as app:
        assert app.transactions is not None
        assert len(app.transactions.decided) == 2
        async with grpc.aio.insecure_channel(app.address) as ch:
            again = await end(ch, committed, pb.COMMIT)
            assert (again.outcome, again.topic, again.queue_id, again.queue_offset) == (
                pb.ALREADY_DONE,
                TOPIC,
                1,
                0,
            )
            by_id = await end(ch, None, pb.COMMIT, unique_id="KEPT", half_offset=-1)
            assert by_id.outcome == pb.ALREADY_DONE
            code, _, _ = await refused(end(ch, rolled, pb.COMMIT))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert (await end(ch, pending, pb.COMMIT)).outcome == pb.COMMITTED
            bodies = [m.unique_id for m in await read_topic(app, ch)]
            assert sorted(bodies) == ["KEPT", "OPEN"]
