"""Topic message types over real gRPC against a real broker: a topic of a type accepts messages
of that type only, a MIXED topic (a topic made without a type) every type, and a refused
message gets MESSAGE_TYPE_MISMATCH while the others of its request are stored. Every send path
is checked: messages, send records (the SDK's), and transactional halves."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from apogee.codec.send import encode_properties, encode_send_record
from apogee.common.topics import MessageType
from apogee.testkit.broker import running_broker, small_settings
from apogee.testkit.broker_txn import refused
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2, transaction_pb2, transaction_pb2_grpc

pytestmark = pytest.mark.integration

TYPES = [t.value for t in MessageType]
#: The types a message can be (MIXED is a topic's type only).
KINDS = [t for t in TYPES if t != "MIXED"]
#: A topic made without a type: MIXED.
UNTYPED = "T-UNTYPED"
GROUP = "txn-producers"
MISMATCH = "MESSAGE_TYPE_MISMATCH"


def topic_of(kind: str) -> str:
    return f"T-{kind}"


def accepted(topic_type: str, kind: str) -> bool:
    return topic_type in (kind, "MIXED")


@pytest.fixture
async def channel(tmp_path: Path) -> AsyncIterator[grpc.aio.Channel]:
    async with (
        running_broker(small_settings(tmp_path / "b", broker_name="b1")) as app,
        grpc.aio.insecure_channel(app.address) as ch,
    ):
        admin = broker_pb2_grpc.BrokerAdminStub(ch)
        for name, message_type in [(topic_of(t), t) for t in TYPES] + [(UNTYPED, "")]:
            await admin.PutTopic(
                broker_pb2.PutTopicRequest(
                    topic=common_pb2.TopicConfig(
                        name=name,
                        read_queues=2,
                        write_queues=2,
                        perm=6,
                        message_type=message_type,
                    )
                ),
                timeout=5,
            )
        yield ch


def message(kind: str, topic: str, body: bytes = b"m") -> common_pb2.Message:
    """A message of type ``kind`` (NORMAL, FIFO or DELAY) on the messages path."""
    if kind == "FIFO":
        return common_pb2.Message(topic=topic, body=body, properties={"__SHARDINGKEY": "order-7"})
    if kind == "DELAY":
        return common_pb2.Message(topic=topic, body=body, delay_level=2)
    return common_pb2.Message(topic=topic, body=body, properties={"region": "eu"})


async def send(ch: grpc.aio.Channel, *msgs: common_pb2.Message) -> list[common_pb2.Status]:
    resp = await broker_pb2_grpc.BrokerStub(ch).SendMessages(
        broker_pb2.SendMessagesRequest(messages=list(msgs)), timeout=5
    )
    return [r.status for r in resp.results]


def record(kind: str, topic: str, body: bytes = b"r") -> bytes:
    """A send record (as the SDK sends) of type ``kind``: NORMAL, FIFO or DELAY."""
    user = {"__SHARDINGKEY": "order-7"} if kind == "FIFO" else {"region": "eu"}
    props = encode_properties(None, (), f"U{body.hex()}{kind}", user)
    delay = 2 if kind == "DELAY" else 0
    return bytes(encode_send_record(topic.encode(), body, props, delay_level=delay))


async def send_records(ch: grpc.aio.Channel, *records: bytes) -> list[str]:
    """Each record's error kind, ``""`` for one stored (or scheduled)."""
    resp = await broker_pb2_grpc.BrokerStub(ch).SendMessages(
        broker_pb2.SendMessagesRequest(records=b"".join(records)), timeout=5
    )
    reasons = [""] * (len(resp.queue_offsets) // 8)
    for r in resp.results:
        reasons[r.index] = r.status.reason
    return reasons


@pytest.mark.parametrize("topic_type", TYPES)
@pytest.mark.parametrize("kind", ["NORMAL", "FIFO", "DELAY"])
async def test_a_sent_message_is_accepted_by_its_type_and_mixed_only(
    channel: grpc.aio.Channel, kind: str, topic_type: str
) -> None:
    [status] = await send(channel, message(kind, topic_of(topic_type)))
    if accepted(topic_type, kind):
        assert status.reason == ""
    else:
        assert status.reason == MISMATCH
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert f"is a {kind} message" in status.message


@pytest.mark.parametrize("topic_type", TYPES)
@pytest.mark.parametrize("kind", ["NORMAL", "FIFO", "DELAY"])
async def test_a_send_record_is_accepted_by_its_type_and_mixed_only(
    channel: grpc.aio.Channel, kind: str, topic_type: str
) -> None:
    [reason] = await send_records(channel, record(kind, topic_of(topic_type)))
    assert reason == ("" if accepted(topic_type, kind) else MISMATCH)


@pytest.mark.parametrize("topic_type", TYPES)
async def test_a_half_is_accepted_by_transaction_and_mixed_topics_only(
    channel: grpc.aio.Channel, topic_type: str
) -> None:
    call = transaction_pb2_grpc.TransactionStub(channel).SendHalf(
        transaction_pb2.SendHalfRequest(
            producer_group=GROUP,
            message=common_pb2.Message(topic=topic_of(topic_type), body=b"pay", queue_id=-1),
        ),
        timeout=5,
    )
    if accepted(topic_type, "TRANSACTION"):
        half = await call
        assert half.unique_id
        return
    code, sentence, kind = await refused(call)
    assert (code, kind) == (grpc.StatusCode.INVALID_ARGUMENT, MISMATCH)
    assert sentence == (
        f"topic 'T-{topic_type}' accepts {topic_type} messages only, and message 0 is a "
        "TRANSACTION message (it is a transactional half message): send it to a TRANSACTION "
        "or MIXED topic"
    )


async def test_send_halves_answers_each_half_by_its_topic(channel: grpc.aio.Channel) -> None:
    resp = await transaction_pb2_grpc.TransactionStub(channel).SendHalves(
        transaction_pb2.SendHalvesRequest(
            producer_group=GROUP,
            messages=[
                common_pb2.Message(topic=topic_of(t), body=b"pay", queue_id=0)
                for t in ("TRANSACTION", "NORMAL", "MIXED")
            ],
        ),
        timeout=5,
    )
    assert [r.status.reason for r in resp.results] == ["", MISMATCH, ""]
    assert resp.results[0].half.unique_id
    assert resp.results[2].half.unique_id


async def test_a_topic_made_without_a_type_accepts_every_type(channel: grpc.aio.Channel) -> None:
    statuses = await send(channel, *(message(k, UNTYPED) for k in ("NORMAL", "FIFO", "DELAY")))
    assert [s.reason for s in statuses] == ["", "", ""]
    assert await send_records(channel, *(record(k, UNTYPED) for k in ("NORMAL", "FIFO"))) == [
        "",
        "",
    ]
    half = await transaction_pb2_grpc.TransactionStub(channel).SendHalf(
        transaction_pb2.SendHalfRequest(
            producer_group=GROUP, message=common_pb2.Message(topic=UNTYPED, body=b"pay")
        ),
        timeout=5,
    )
    assert half.unique_id


async def test_every_message_of_a_request_is_checked_not_only_the_first_of_its_topic(
    channel: grpc.aio.Channel,
) -> None:
    fifo = topic_of("FIFO")
    statuses = await send(
        channel, message("FIFO", fifo), message("NORMAL", fifo), message("FIFO", fifo)
    )
    assert [s.reason for s in statuses] == ["", MISMATCH, ""]
    assert statuses[1].message == (
        "topic 'T-FIFO' accepts FIFO messages only, and message 1 is a NORMAL message (it has no "
        "delay, message group or transaction): send it to a NORMAL or MIXED topic"
    )
    reasons = await send_records(
        channel, record("FIFO", fifo, b"1"), record("NORMAL", fifo, b"2"), record("FIFO", fifo)
    )
    assert reasons == ["", MISMATCH, ""]


async def test_the_refusal_says_what_made_the_message_its_type(channel: grpc.aio.Channel) -> None:
    normal = topic_of("NORMAL")
    at = int(time.time() * 1000) + 3_600_000  # due in an hour
    timer = common_pb2.Message(topic=normal, body=b"t", deliver_at_ms=at)
    statuses = await send(channel, message("DELAY", normal), timer, message("FIFO", normal))
    assert [s.reason for s in statuses] == [MISMATCH] * 3
    whys = [
        "is a DELAY message (it has delay level 2)",
        f"is a DELAY message (it has a delivery time (deliver_at_ms {at}))",
        "is a FIFO message (it has a message group (__SHARDINGKEY))",
    ]
    for status, why in zip(statuses, whys, strict=True):
        assert why in status.message


async def test_a_record_has_a_message_group_only_under_that_exact_name(
    channel: grpc.aio.Channel,
) -> None:
    normal, fifo = topic_of("NORMAL"), topic_of("FIFO")

    def raw(topic: str, props: str) -> bytes:
        return bytes(encode_send_record(topic.encode(), b"x", props.encode()))

    first = "__SHARDINGKEY\x01g\x02UNIQ_KEY\x01U1\x02"  # the group as the first property
    later = "UNIQ_KEY\x01U2\x02__SHARDINGKEY\x01g\x02"
    lookalike = "UNIQ_KEY\x01U3\x02X__SHARDINGKEY\x01g\x02__SHARDINGKEYS\x01g\x02"
    assert await send_records(channel, raw(fifo, first), raw(fifo, later)) == ["", ""]
    assert await send_records(channel, raw(normal, first), raw(normal, lookalike)) == [
        MISMATCH,
        "",
    ]
    assert await send_records(channel, raw(fifo, lookalike)) == [MISMATCH]
