"""Taking one field out of message bytes gives what protobuf itself reads."""

from __future__ import annotations

import pytest

from apogee.rpc.protowire import WireError, read_varint, split_field, varint
from apogee.v1 import common_pb2, consumer_pb2

pytestmark = pytest.mark.unit


def _records_of(msg: consumer_pb2.PullResponse) -> tuple[bytes, bytes]:
    raw = msg.SerializeToString()
    rest, start, end = split_field(raw, 0, len(raw), 2)
    return rest, raw[start:end] if start >= 0 else b"<absent>"


def test_the_field_comes_out_and_the_rest_parses_to_the_other_fields() -> None:
    full = consumer_pb2.PullResponse(
        status=consumer_pb2.PULL_FOUND,
        records=bytes(range(256)) * 300,
        count=7,
        next_offset=-3,  # a negative int64: a 10-byte varint
        min_offset=1 << 40,
        max_offset=5,
        broker_name="broker-a",
    )
    rest, records = _records_of(full)
    assert records == full.records
    parsed = consumer_pb2.PullResponse.FromString(rest)
    full.ClearField("records")
    assert parsed == full


def test_an_absent_field_leaves_the_message_whole() -> None:
    msg = consumer_pb2.PullResponse(status=consumer_pb2.PULL_NO_NEW_MESSAGE, next_offset=9)
    rest, records = _records_of(msg)
    assert records == b"<absent>"
    assert rest == msg.SerializeToString()


def test_a_repeated_occurrence_wins_as_protobuf_keeps_it() -> None:
    first = consumer_pb2.PullResponse(records=b"old", count=1).SerializeToString()
    second = consumer_pb2.PullResponse(records=b"new", next_offset=4).SerializeToString()
    raw = first + second  # concatenated messages merge; the last scalar wins
    rest, start, end = split_field(raw, 0, len(raw), 2)
    assert raw[start:end] == consumer_pb2.PullResponse.FromString(raw).records == b"new"
    assert consumer_pb2.PullResponse.FromString(rest) == consumer_pb2.PullResponse(
        count=1, next_offset=4
    )


def test_a_nested_message_is_found_inside_its_parent() -> None:
    inner = consumer_pb2.PullResponse(records=b"r" * 100, broker_name="b")
    env = consumer_pb2.PullStreamResponse(
        id=12, response=inner, status=common_pb2.Status(code=0, message="")
    ).SerializeToString()
    pad = b"\xff" * 5  # the message need not start at 0
    raw = pad + env + pad
    rest, at, end = split_field(raw, len(pad), len(pad) + len(env), 2)
    assert consumer_pb2.PullStreamResponse.FromString(rest).id == 12
    _, start, stop = split_field(raw, at, end, 2)
    assert raw[start:stop] == b"r" * 100


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"\x12\x05abc", "past the message's end"),  # a length beyond the bytes
        (b"\x08\xff\xff", "varint"),  # a varint cut short
        (b"\x0b", "wire type 3"),  # a group start: not written by proto3
        (b"\x02\x00", "field number 0"),
        (b"\x09\x00\x00", "past the message's end"),  # a fixed64 cut short
    ],
)
def test_bytes_that_are_not_a_message_are_refused(raw: bytes, words: str) -> None:
    with pytest.raises(WireError, match=words):
        split_field(raw, 0, len(raw), 2)


def test_varints_round_trip() -> None:
    for n in (0, 1, 127, 128, 300, 1 << 35, (1 << 64) - 1):
        b = varint(n)
        assert read_varint(b, 0, len(b)) == (n, len(b))
    assert read_varint(varint(-1), 0, 10) == ((1 << 64) - 1, 10)
