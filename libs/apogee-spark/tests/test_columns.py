"""The column-by-column batch is the batch the per-message decoding gives, for every shape of
record a pull can hold: no properties, several keys, a compressed body, a duplicate property,
a redelivered message, and properties that do not split (taken the slow way)."""

from __future__ import annotations

import zlib

import pyarrow as pa  # type: ignore[import-untyped]
import pytest

from apogee.client.consumer.records import ReceivedMessage, decode_records
from apogee.codec import SYSFLAG_COMPRESSED, encode_record
from apogee.spark.columns import _row_by_row, _split_properties, to_record_batch
from apogee.spark.schema import arrow_schema

pytestmark = pytest.mark.unit

T0 = 1_790_000_000_000


def _messages(records: list[bytes]) -> list[ReceivedMessage]:
    return decode_records(b"".join(records), "broker-a", "Orders", 3, 0)


def _record(offset: int, body: bytes = b"x", **kw: object) -> bytes:
    kw.setdefault("born_timestamp_ms", T0 + offset)
    kw.setdefault("store_timestamp_ms", T0 + offset + 5)
    return encode_record("Orders", 3, offset, body, **kw)  # type: ignore[arg-type]


def _both(messages: list[ReceivedMessage], include: bool) -> tuple[pa.RecordBatch, pa.RecordBatch]:
    schema = arrow_schema(include)
    fast = to_record_batch(messages, schema, include)
    # a fresh decoding for the slow path: views cache what they parsed
    return fast, _row_by_row(messages, schema, include)


@pytest.mark.parametrize("include", [True, False])
def test_the_columns_match_the_per_message_decoding(include: bool) -> None:
    packed = zlib.compress(b"squeezed " * 100)
    records = [
        _record(0, b"plain", tags="TagA", keys=["k1"], unique_id="ID-0", properties={"a": "1"}),
        _record(1, b""),  # no tags, keys, id or properties at all
        _record(2, b"\x00\xffbin", keys=["k1", "k2", "k3"], unique_id="ID-2"),
        _record(3, packed, sys_flag=SYSFLAG_COMPRESSED, unique_id="ID-3", tags="Z"),
        _record(4, b"again", unique_id="ID-4", reconsume_times=2, properties={"é": "ü", "b": ""}),
    ]
    fast, slow = _both(_messages(records), include)
    assert fast.equals(slow)
    rows = fast.to_pylist()
    assert [r["queue_offset"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["message_id"] == "ID-0"
    assert rows[1]["message_id"] is None
    assert rows[0]["tags"] == "TagA"
    assert rows[1]["tags"] is None
    assert rows[1]["keys"] == []
    assert rows[2]["keys"] == ["k1", "k2", "k3"]
    assert rows[3]["body"] == b"squeezed " * 100
    assert rows[4]["delivery_attempt"] == 3
    assert rows[0]["delivery_attempt"] == 1
    assert (rows[0]["topic"], rows[0]["broker"], rows[0]["queue"]) == ("Orders", "broker-a", 3)
    assert rows[2]["store_timestamp"].timestamp() * 1000 == T0 + 7
    if include:
        assert rows[0]["properties"] == [("a", "1")]
        assert rows[1]["properties"] == []
        assert sorted(rows[4]["properties"]) == [("b", ""), ("é", "ü")]


def test_sections_that_do_not_split_are_left_to_the_slow_path() -> None:
    # what a foreign writer might store: a pair with no name separator, or bytes that are not
    # UTF-8; the per-message decoding reads the first as a name with an empty value and refuses
    # the second as a corrupt record, so the batch is built (or fails) that way
    assert _split_properties([b"a\x011\x02", b"lonely\x02"]) is None
    assert _split_properties([b"a\x01\xff\x02"]) is None
    split = _split_properties([b"a\x011\x02b\x012\x02", b"", b"c\x01\x02"])
    assert split is not None
    names, values, rows, starts = split
    assert names.to_pylist() == ["a", "b", "c"]
    assert values.to_pylist() == ["1", "2", ""]
    assert rows.tolist() == [0, 0, 2]
    assert starts.tolist() == [0, 2, 2, 3]
