"""The record layout as drawn: every field where the drawing puts it, and records that encode
and decode back to what was written, through both decoders."""

from __future__ import annotations

import pytest

from apogee.codec import (
    BLANK,
    HEAD,
    HEADER,
    HEADER_SIZE,
    OFFSET,
    PROP_KEYS,
    PROP_TAGS,
    PROP_UNIQ_KEY,
    RecordView,
    decode,
    decode_properties,
    decode_records,
    encode_properties,
    encode_record,
)
from apogee.common.errors import CorruptRecordError

pytestmark = pytest.mark.unit


def test_fields_sit_where_the_drawing_puts_them() -> None:
    assert HEADER_SIZE == HEADER.size == 112
    assert (HEAD.size, BLANK.size) == (12, 8)
    assert OFFSET == {
        "size": 0,
        "magic": 4,
        "crc": 8,
        "queue_id": 12,
        "flag": 16,
        "queue_offset": 20,
        "phys_offset": 28,
        "sys_flag": 36,
        "born_timestamp": 40,
        "store_timestamp": 48,
        "born_host_raw": 56,
        "store_host_raw": 74,
        "reconsume_times": 92,
        "prepared_txn_offset": 96,
        "body_length": 104,
        "topic_length": 108,
        "properties_length": 110,
    }


def _record() -> bytes:
    return encode_record(
        "Orders",
        3,
        41,
        b"payload",
        tags="created",
        keys=("k1", "k2"),
        unique_id="ID-1",
        properties={"region": "eu"},
        phys_offset=4096,
        flag=5,
        born_timestamp_ms=1_700_000_000_000,
        store_timestamp_ms=1_700_000_000_007,
        born_host="10.0.0.1:5000",
        store_host="[::1]:10911",
        reconsume_times=2,
    )


def test_a_record_decodes_to_what_was_encoded_eagerly_and_lazily() -> None:
    raw = _record()
    m = decode(raw, "test", verify_crc=True)
    assert (m.topic, m.queue_id, m.queue_offset, m.phys_offset, m.flag) == (
        "Orders",
        3,
        41,
        4096,
        5,
    )
    assert (m.body, m.tags, m.keys, m.unique_id) == (b"payload", "created", ["k1", "k2"], "ID-1")
    assert (m.born_host, m.store_host, m.reconsume_times) == ("10.0.0.1:5000", "[::1]:10911", 2)
    assert m.properties["region"] == "eu"
    (v,) = decode_records(raw, "broker-a", "Orders", 3, 41, cls=RecordView)
    assert (v.body, v.tags, v.keys, v.unique_id) == (b"payload", "created", ("k1", "k2"), "ID-1")
    assert dict(v.properties) == {"region": "eu"}
    assert (v.born_host, v.store_host, v.size) == ("10.0.0.1:5000", "[::1]:10911", len(raw))
    assert (v.born_timestamp_ms, v.store_timestamp_ms) == (1_700_000_000_000, 1_700_000_000_007)


def test_a_flipped_bit_anywhere_after_the_crc_is_caught() -> None:
    raw = bytearray(_record())
    raw[-1] ^= 1  # the last byte of the properties
    with pytest.raises(CorruptRecordError, match="CRC mismatch"):
        decode(bytes(raw), "test", verify_crc=True)
    with pytest.raises(CorruptRecordError, match="CRC mismatch"):
        decode_records(bytes(raw), "broker-a", "Orders", 3, 41, cls=RecordView)


def test_views_come_only_from_decoding() -> None:
    with pytest.raises(TypeError, match="RecordView objects come from decode_records"):
        RecordView()


def test_properties_text_round_trips() -> None:
    text = encode_properties("t", ("a", "b"), "ID", {"x": "1"})
    assert decode_properties(text) == {
        PROP_TAGS: "t",
        PROP_KEYS: "a b",
        PROP_UNIQ_KEY: "ID",
        "x": "1",
    }
    assert encode_properties() == ""
