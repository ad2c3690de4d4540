"""Client-side validation: the exact sentences a user sees, raised before anything is queued;
compression on the wire; producer options."""

from __future__ import annotations

import os
import random
import struct
import zlib

import pytest

from apogee.client import Message, Producer, SendHook, SendResult, SendStatus, StoredMessage
from apogee.client.message import decode_body, encode_body
from apogee.client.producer import wire
from apogee.client.producer.validation import (
    MessageValidator,
    validate_batch,
    validate_message,
)
from apogee.codec import SYSFLAG_COMPRESSED, decode
from apogee.codec import StoredMessage as RecordView
from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    InvalidPropertyError,
    InvalidTopicError,
    MessageTooLargeError,
    PermissionDeniedError,
    PropertiesTooLargeError,
)
from apogee.rpc.protowire import varint
from apogee.v1 import broker_pb2, common_pb2

pytestmark = pytest.mark.unit

MiB = 1024 * 1024


def msg(**kw: object) -> Message:
    fields: dict[str, object] = {"topic": "Orders", "body": b"x"}
    fields.update(kw)
    return Message(**fields)  # type: ignore[arg-type]


INVALID = [
    (msg(topic=""), InvalidTopicError, "topic '': must not be empty"),
    (
        msg(topic="a b"),
        InvalidTopicError,
        "topic 'a b': has a character outside [%|a-zA-Z0-9_-]",
    ),
    (
        msg(topic="t" * 128),
        InvalidTopicError,
        f"topic {'t' * 128!r}: is 128 characters; at most 127 are allowed",
    ),
    (
        msg(topic="TBW102"),
        PermissionDeniedError,
        "topic 'TBW102': is a system topic; clients cannot send to it",
    ),
    (msg(body=b""), InvalidArgumentError, "body: must not be empty"),
    (msg(body="text"), InvalidArgumentError, "body: must be bytes, got str"),
    (
        msg(body=b"x" * (4 * MiB + 1)),
        MessageTooLargeError,
        "body is 4194305 bytes: the maximum is 4194304 bytes (max_message_size)",
    ),
    (
        msg(tags="a\x01b"),
        InvalidPropertyError,
        "property 'tags': a value must not contain \\x01 or \\x02",
    ),
    (
        msg(keys=["ok", "has space"]),
        InvalidPropertyError,
        "property 'keys': key 'has space' must be non-empty, without spaces, \\x01 or \\x02",
    ),
    (
        msg(keys=[""]),
        InvalidPropertyError,
        "property 'keys': key '' must be non-empty, without spaces, \\x01 or \\x02",
    ),
    (
        msg(properties={"k\x02": "v"}),
        InvalidPropertyError,
        "property 'k\\x02': a property name must be non-empty, without \\x01 or \\x02",
    ),
    (
        msg(properties={"trace": "a\x01b"}),
        InvalidPropertyError,
        "property 'trace': a value must not contain \\x01 or \\x02",
    ),
    (
        msg(properties={"line\nbreak": "x"}),
        InvalidPropertyError,
        "property 'line\\nbreak': a property name must not contain control characters, got '\\n'",
    ),
    (
        msg(properties={"KEYS": "x"}),
        InvalidPropertyError,
        "property 'KEYS': is reserved; use Message.tags, Message.keys or the message id",
    ),
    (
        msg(properties={"REAL_TOPIC": "Victim"}, delay_level=1),
        InvalidPropertyError,
        "property 'REAL_TOPIC': is set by brokers only; use Message.delay_level or "
        "Message.deliver_at for a delayed message",
    ),
    (
        msg(properties={"DELAY": "1"}),
        InvalidPropertyError,
        "property 'DELAY': is set by brokers only; use Message.delay_level or "
        "Message.deliver_at for a delayed message",
    ),
    (
        msg(properties={"TIMER_X": "1"}),
        InvalidPropertyError,
        "property 'TIMER_X': is set by brokers only; use Message.delay_level or "
        "Message.deliver_at for a delayed message",
    ),
    (
        msg(properties={"big": "v" * 40_000}),
        PropertiesTooLargeError,
        "properties are 40047 bytes: the maximum is 32767 bytes (max_properties_size), "
        "tags, keys and unique id included",
    ),
    (
        msg(delay_level=19),
        InvalidArgumentError,
        "delay_level: must be an integer from 0 to 18, got 19",
    ),
    (
        msg(delay_level=True),
        InvalidArgumentError,
        "delay_level: must be an integer from 0 to 18, got True",
    ),
]


@pytest.mark.parametrize(("message", "error", "text"), INVALID)
def test_invalid_messages(message: Message, error: type[ApogeeError], text: str) -> None:
    with pytest.raises(error) as info:
        validate_message(message)
    assert type(info.value) is error
    assert str(info.value) == text
    assert not info.value.retriable


@pytest.mark.parametrize(("message", "error", "text"), INVALID)
def test_a_validator_that_remembers_refuses_the_same(
    message: Message, error: type[ApogeeError], text: str
) -> None:
    """The producer's validator skips the checks of a topic and tags it saw pass; a message
    that breaks any rule still gets the same error, whatever passed before it."""
    check = MessageValidator()
    for good in (msg(), msg(tags="t"), msg(topic="Other"), msg(body=b"y" * 100)):
        check(good)
    with pytest.raises(error) as info:
        check(message)
    assert type(info.value) is error
    assert str(info.value) == text
    check(msg())  # and it still passes what is valid


def test_a_validator_does_not_remember_what_failed() -> None:
    check = MessageValidator()
    for _ in range(2):
        with pytest.raises(PermissionDeniedError):
            check(msg(topic="TBW102"))
        with pytest.raises(InvalidPropertyError):
            check(msg(tags="a\x01b"))


def test_valid_messages_pass() -> None:
    validate_message(msg(tags="created", keys="o-17", properties={"a": "b"}, delay_level=18))
    validate_message(msg(body=b"x" * 4 * MiB))


def test_a_single_key_string_is_one_key() -> None:
    assert msg(keys="o-17").keys == ("o-17",)


@pytest.mark.parametrize(
    ("batch", "error", "text"),
    [
        ([], InvalidArgumentError, "messages: a batch must be a non-empty sequence of messages"),
        (
            [msg(), msg(topic="Other")],
            InvalidArgumentError,
            "messages: a batch has one topic; message 1 is for 'Other', the first for 'Orders'",
        ),
        (
            [msg(), msg(delay_level=3)],
            InvalidArgumentError,
            "delay_level: delay is not supported for batch sends; message 1 has level 3",
        ),
        (
            [msg(body=b"x" * (2 * MiB)), msg(body=b"y" * (2 * MiB + 1))],
            MessageTooLargeError,
            "batch is 4194305 bytes: the maximum is 4194304 bytes (max_message_size) "
            "for a whole batch",
        ),
        ([msg(), msg(body=b"")], InvalidArgumentError, "body: must not be empty"),
    ],
)
def test_invalid_batches(batch: list[Message], error: type[ApogeeError], text: str) -> None:
    with pytest.raises(error) as info:
        validate_batch(batch)
    assert str(info.value) == text


async def test_the_producer_refuses_bad_messages_before_queueing_them() -> None:
    seen: list[Message] = []
    async with Producer("127.0.0.1:1", group="g", hooks=[SendHook(before=seen.append)]) as producer:
        with pytest.raises(InvalidTopicError):
            await producer.send(msg(topic="bad topic"))
        with pytest.raises(InvalidArgumentError, match="body: must not be empty"):
            producer.send_nowait(msg(body=b""))
        with pytest.raises(InvalidPropertyError):
            await producer.send_oneway(msg(keys=["a b"]))
        with pytest.raises(InvalidArgumentError, match="a batch has one topic"):
            await producer.send_batch([msg(), msg(topic="B")])
        with pytest.raises(InvalidArgumentError, match="sharding_key: must be str or bytes"):
            await producer.send_ordered(msg(), 3)  # type: ignore[arg-type]
        assert producer.stats().requests == 0
        assert seen == []  # no hook ran: nothing was sent


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({"send_timeout": 0}, "send_timeout: must be a number above 0, got 0"),
        ({"retries": -1}, "retries: must be an integer of at least 0, got -1"),
        ({"max_in_flight": 0}, "max_in_flight: must be an integer of at least 1, got 0"),
        ({"group": "a b"}, "group: 'a b' must be 1 to 255 characters from [%|a-zA-Z0-9_-]"),
        ({"namesrv": "nohost"}, "namesrv: 'nohost' is not host:port"),
        ({"namesrv": ""}, "namesrv: must name at least one host:port"),
    ],
)
def test_bad_producer_options(options: dict[str, object], text: str) -> None:
    args: dict[str, object] = {"namesrv": "127.0.0.1:9876"}
    args.update(options)
    with pytest.raises(InvalidArgumentError) as info:
        Producer(**args)  # type: ignore[arg-type]
    assert str(info.value) == text


def test_unknown_producer_option() -> None:
    with pytest.raises(TypeError, match="unknown producer option"):
        Producer("127.0.0.1:9876", sendtimeout=3)  # type: ignore[call-arg]


def test_namesrv_list_forms() -> None:
    p = Producer("127.0.0.1:9876; 127.0.0.1:9877")
    assert p.config.namesrv == ("127.0.0.1:9876", "127.0.0.1:9877")
    assert Producer(["h:1", "h:2"]).config.namesrv == ("h:1", "h:2")


def test_compression_only_above_the_threshold_and_only_when_smaller() -> None:
    text = b"apogee " * 2000  # 14000 bytes, compresses well
    packed, flag = encode_body(text, 4096)
    assert flag == SYSFLAG_COMPRESSED
    assert len(packed) < len(text)
    assert zlib.decompress(packed) == text
    assert decode_body(packed, flag) == text
    assert encode_body(text[:4096], 4096) == (text[:4096], 0)  # not above the threshold
    noise = os.urandom(8000)
    assert encode_body(noise, 4096) == (noise, 0)  # would not shrink
    assert encode_body(text, -1) == (text, 0)  # never


def records_of(request: bytes) -> tuple[str, list[RecordView]]:
    """The producer group and the send records of a serialized request, each decoded as the
    broker reads it (the delay level and delivery time sit in the offset slots)."""
    parsed = broker_pb2.SendMessagesRequest.FromString(request)
    assert not parsed.messages
    data = parsed.records
    out = []
    pos = 0
    while pos < len(data):
        size = int.from_bytes(data[pos : pos + 4], "little")
        out.append(decode(data[pos : pos + size], "request", verify_crc=False))
        pos += size
    return parsed.producer_group, out


def test_compressed_message_on_the_wire_round_trip() -> None:
    body = b"0123456789" * 1000
    m = msg(body=body, tags="t", keys=["k1", "k2"], properties={"p": "v"})
    first = wire.encode(m, "UID", 1234, compress_over=4096)
    second = wire.encode(m, "UID", 1234, compress_over=4096)
    wire.set_queue(first, 5)
    group, (a, b) = records_of(wire.request([first, second], wire.group_field("g")))
    assert group == "g"
    assert (a.queue_id, b.queue_id) == (5, 0)
    assert a.sys_flag & SYSFLAG_COMPRESSED
    assert a.body != body
    assert zlib.decompress(a.body) == body
    assert (a.topic, a.tags, a.keys, a.properties["p"]) == ("Orders", "t", ["k1", "k2"], "v")
    assert (a.unique_id, a.born_timestamp) == ("UID", 1234)
    stored = common_pb2.StoredMessage(
        topic="Orders", body=a.body, sys_flag=a.sys_flag, unique_id="UID"
    )
    view = StoredMessage.from_pb(stored, "broker-a")
    assert view.body == body
    assert view.compressed
    assert view.broker_name == "broker-a"


def test_small_bodies_travel_as_they_are() -> None:
    record = wire.encode(msg(body=b"small"), "UID", 1, compress_over=4096)
    [got] = records_of(wire.request([record], b""))[1]
    assert got.body == b"small"
    assert got.sys_flag == 0


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16_384, 2**31 - 1])
def test_varint_matches_protobuf(n: int) -> None:
    pb = common_pb2.Message(queue_id=n).SerializeToString()
    assert pb == (b"\x50" + varint(n) if n else b"")


def test_send_records_hold_every_field_of_the_message() -> None:
    """``wire.encode`` writes each message once as a send record; decoded as the broker reads
    it, every field is the message's, with the queue each attempt set."""
    rng = random.Random(7)
    for _ in range(500):
        m = msg(
            topic=rng.choice(["T", "Topic_x" * 18]),
            body=os.urandom(rng.choice([1, 127, 128, 1000, 16_383, 16_384, 70_000])),
            tags=rng.choice(["", "a", "ü" * 100]),
            keys=tuple(f"k{j}" for j in range(rng.randint(0, 3))),
            properties={f"p{j}": "v" * j for j in range(rng.randint(0, 3))},
            delay_level=rng.randint(0, 18),
        )
        uid = rng.choice(["UID", "0123456789ABCDEF0123456789ABCDEF"])
        born = rng.choice([0, 1, 1_790_000_000_000, 2**62])
        flag = rng.choice([0, 1, -1, 2**31 - 1, -(2**31)])
        record = wire.encode(m, uid, born, compress_over=-1, flag=flag)
        queue_id = rng.choice([0, 1, 127, 128, 1023, 2**31 - 1])
        wire.set_queue(record, queue_id)
        [got] = records_of(wire.request([record], b""))[1]
        assert (got.topic, got.body, got.tags, got.keys) == (
            m.topic,
            m.body,
            m.tags or None,
            list(m.keys),
        )
        assert got.properties == {
            **({"TAGS": m.tags} if m.tags else {}),
            **({"KEYS": " ".join(m.keys)} if m.keys else {}),
            "UNIQ_KEY": uid,
            **m.properties,
        }
        assert (got.queue_id, got.flag, got.born_timestamp, got.sys_flag) == (
            queue_id,
            flag,
            born,
            0,
        )
        # what the broker assigns is left zero; the delay level sits in the queue offset slot
        assert (got.queue_offset, got.phys_offset) == (m.delay_level, 0)
        assert (got.crc, got.store_timestamp, got.store_host_raw) == (0, 0, bytes(18))


def test_an_answer_is_read_per_request() -> None:
    resp = broker_pb2.SendMessagesResponse(
        broker_name="b1",
        queue_offsets=struct.pack("<3q", 5, -1, -1),
        store_timestamp_ms=7,
    )
    resp.results.add(
        status=common_pb2.Status(code=14, reason="FLUSH_TIMEOUT", message="not durable yet"),
        unique_id="B",
        topic="T",
        queue_id=1,
        queue_offset=6,
        store_timestamp_ms=8,
        index=1,
    )
    resp.results.add(
        status=common_pb2.Status(code=3, reason="INVALID_TOPIC", message="topic 'x y' is bad"),
        unique_id="C",
        topic="x y",
        index=2,
    )
    answer = wire.Answer(resp, "fallback")
    assert len(answer) == 3
    assert [answer.ok(i) for i in range(3)] == [True, False, False]
    ok = answer.outcome(0, "A", "T", 1)
    late = answer.outcome(1, "B", "T", 1)
    bad = answer.outcome(2, "C", "x y", 0)
    assert isinstance(ok, SendResult)
    assert isinstance(late, SendResult)
    assert (ok.message_id, ok.topic, ok.queue_id, ok.queue_offset) == ("A", "T", 1, 5)
    assert (ok.broker_name, ok.status, ok.store_timestamp_ms) == ("b1", SendStatus.OK, 7)
    assert (late.message_id, late.queue_offset, late.store_timestamp_ms, late.status) == (
        "B",
        6,
        8,
        SendStatus.FLUSH_DISK_TIMEOUT,
    )
    assert isinstance(bad, InvalidTopicError)
    assert "topic 'x y' is bad" in str(bad)
