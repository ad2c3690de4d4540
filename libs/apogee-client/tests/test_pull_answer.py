"""A pull answer read off its stream bytes: the records stay where they arrived, and the
messages decoded from them are the same as when protobuf copies them out."""

from __future__ import annotations

import pytest

from apogee.client._rpc import IN_PLACE_FROM, PullAnswer, read_pull_envelope
from apogee.client.consumer.records import ReceivedMessage, decode_records
from apogee.codec import encode_record
from apogee.common.errors import CorruptRecordError
from apogee.v1 import common_pb2, consumer_pb2

pytestmark = pytest.mark.unit


def _answer(count: int) -> consumer_pb2.PullResponse:
    records = b"".join(
        encode_record("Orders", 3, 100 + i, f"body {i}".encode() * 60, tags="t", unique_id=f"u{i}")
        for i in range(count)
    )
    return consumer_pb2.PullResponse(
        status=consumer_pb2.PULL_FOUND,
        records=records,
        count=count,
        next_offset=100 + count,
        min_offset=0,
        max_offset=100 + count + 5,
        broker_name="broker-a",
    )


def _seen(msgs: list[ReceivedMessage]) -> list[tuple[int, bytes, str, str, int]]:
    return [(m.queue_offset, m.body, m.tags, m.unique_id, m.size) for m in msgs]


def _decode(answer: PullAnswer) -> list[ReceivedMessage]:
    return decode_records(
        answer.records, "broker-a", "Orders", 3, 100, start=answer.start, end=answer.end
    )


@pytest.mark.parametrize("count", [1, 400])
def test_an_answer_decodes_as_protobuf_reads_it(count: int) -> None:
    resp = _answer(count)
    raw = consumer_pb2.PullStreamResponse(id=77, response=resp).SerializeToString()
    assert (len(raw) >= IN_PLACE_FROM) == (count == 400)  # both ways are covered
    env = read_pull_envelope(raw)
    assert env.id == 77
    assert not env.HasField("status")
    answer = env.response
    if count == 400:
        assert answer.records is raw  # not copied
    for name in ("status", "count", "next_offset", "min_offset", "max_offset", "broker_name"):
        assert getattr(answer.response, name) == getattr(resp, name), name
    expected = decode_records(resp.records, "broker-a", "Orders", 3, 100)
    assert _seen(_decode(answer)) == _seen(expected)
    assert len(expected) == count


def test_an_answer_without_records_or_with_a_status() -> None:
    status = common_pb2.Status(code=5, message="UNKNOWN_TOPIC: no such topic")
    failed = consumer_pb2.PullStreamResponse(id=3, status=status)
    env = read_pull_envelope(failed.SerializeToString())
    assert env.HasField("status")
    assert env.status == status
    assert env.response.start == env.response.end  # nothing to decode
    padding = common_pb2.Status(code=0, message="x" * IN_PLACE_FROM)
    large_empty = consumer_pb2.PullStreamResponse(
        id=4,
        response=consumer_pb2.PullResponse(status=consumer_pb2.PULL_NO_NEW_MESSAGE),
        status=padding,
    )
    env = read_pull_envelope(large_empty.SerializeToString())
    assert env.response.response.status == consumer_pb2.PULL_NO_NEW_MESSAGE
    assert _decode(env.response) == []


def test_damage_in_place_names_the_byte_within_the_records() -> None:
    resp = _answer(400)
    second = len(encode_record("Orders", 3, 100, b"body 0" * 60, tags="t", unique_id="u0"))
    records = bytearray(resp.records)
    records[second + 120] ^= 0xFF  # a body byte of the second record
    resp.records = bytes(records)
    raw = consumer_pb2.PullStreamResponse(id=1, response=resp).SerializeToString()
    answer = read_pull_envelope(raw).response
    with pytest.raises(CorruptRecordError, match=rf"at offset 101 \(byte {second} of"):
        _decode(answer)


def test_records_outside_the_buffer_are_refused() -> None:
    with pytest.raises(ValueError, match="do not lie in"):
        decode_records(b"abc", "b", "T", 0, 0, start=2, end=9)
