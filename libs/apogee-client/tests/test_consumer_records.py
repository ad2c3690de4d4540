"""Decoding pulled records: what a real store writes comes back as the producer sent it, and
every kind of damage is refused with an error naming the broker, topic, queue and offset."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from apogee.client.consumer.records import ReceivedMessage, decode_records
from apogee.client.message import encode_body
from apogee.codec import SYSFLAG_COMPRESSED, encode_record
from apogee.codec import Message as StoreMessage
from apogee.common.errors import CorruptRecordError
from apogee.store import MessageStore, StoreConfig

pytestmark = pytest.mark.unit


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    s = MessageStore.open(
        tmp_path / "store",
        StoreConfig(
            commitlog_file_size=1 << 20,
            max_message_size=64 * 1024,
            consume_queue_entries_per_file=64,
        ),
        store_host="10.1.2.3:10911",
        start_retention=False,
    )
    try:
        yield s
    finally:
        s.close()


def _pulled(store: MessageStore, msgs: list[StoreMessage]) -> bytes:
    """The records of ``msgs`` as the store holds them, back to back (what a pull returns)."""
    results = store.append(msgs)
    return b"".join(store.commitlog.read(r.phys_offset, r.size) for r in results)


def test_records_written_by_a_store_decode_to_what_was_sent(store: MessageStore) -> None:
    big = b"compress me " * 1000
    packed, flag = encode_body(big, compress_over=4096)
    assert flag == SYSFLAG_COMPRESSED
    buf = _pulled(
        store,
        [
            StoreMessage(
                "Orders",
                b"first",
                queue_id=2,
                tags="created",
                keys=["order-1", "customer-9"],
                properties={"region": "eu", "a": "b"},
                unique_id="ID-1",
                flag=7,
                born_timestamp=1_700_000_000_123,
                born_host="192.168.1.20:4000",
                reconsume_times=3,
            ),
            StoreMessage("Orders", packed, queue_id=2, sys_flag=flag, unique_id="ID-2"),
            StoreMessage("Orders", b"third", queue_id=2),
        ],
    )
    msgs = decode_records(buf, "broker-a", "Orders", 2, 0)
    assert [m.queue_offset for m in msgs] == [0, 1, 2]
    first, second, third = msgs
    assert (first.topic, first.broker_name, first.queue_id) == ("Orders", "broker-a", 2)
    assert first.body == b"first"
    assert first.tags == "created"
    assert first.keys == ("order-1", "customer-9")
    assert dict(first.properties) == {"region": "eu", "a": "b"}
    assert first.unique_id == first.message_id == "ID-1"
    assert first.flag == 7
    assert first.born_timestamp_ms == 1_700_000_000_123
    assert first.store_timestamp_ms > 0
    assert first.born_host == "192.168.1.20:4000"
    assert first.store_host == "10.1.2.3:10911"
    assert first.reconsume_times == 3
    assert first.phys_offset == 0
    assert first.size == second.phys_offset  # back to back in the log
    assert sum(m.size for m in msgs) == len(buf)
    assert (second.body, second.compressed, second.sys_flag) == (big, True, SYSFLAG_COMPRESSED)
    assert (third.tags, third.keys, third.unique_id != "") == ("", (), True)
    assert dict(third.properties) == {}
    assert repr(first).startswith("ReceivedMessage(topic='Orders', broker_name='broker-a'")


def test_encode_record_writes_what_the_store_writes(store: MessageStore) -> None:
    [r] = store.append(
        StoreMessage(
            "T", b"body", queue_id=1, tags="x", keys=["k"], unique_id="U", born_timestamp=5
        )
    )
    stored = store.commitlog.read(r.phys_offset, r.size)
    ours = encode_record(
        "T",
        1,
        r.queue_offset,
        b"body",
        tags="x",
        keys=("k",),
        unique_id="U",
        phys_offset=r.phys_offset,
        born_timestamp_ms=5,
        store_timestamp_ms=r.store_timestamp,
        store_host="10.1.2.3:10911",
    )
    assert ours == stored


def test_empty_response_decodes_to_nothing() -> None:
    assert decode_records(b"", "b", "T", 0, 0) == []


def test_tag_filtered_pulls_may_skip_offsets() -> None:
    buf = encode_record("T", 0, 10, b"a") + encode_record("T", 0, 14, b"b")
    assert [m.queue_offset for m in decode_records(buf, "b", "T", 0, 8)] == [10, 14]


def test_received_messages_come_only_from_decoding() -> None:
    with pytest.raises(TypeError, match="decode_records"):
        ReceivedMessage()


def _expect_corrupt(buf: bytes, *, first: int = 0, topic: str = "T", queue: int = 0) -> str:
    with pytest.raises(CorruptRecordError) as info:
        decode_records(buf, "broker-x", topic, queue, first)
    text = str(info.value)
    assert f"broker broker-x: {topic}/{queue}" in text
    return text


def test_crc_mismatch_is_caught_unless_turned_off() -> None:
    good = encode_record("T", 0, 0, b"hello world")
    bad = bytearray(encode_record("T", 0, 1, b"hello world"))
    bad[115] ^= 0xFF  # a byte of the body
    text = _expect_corrupt(good + bytes(bad))
    assert "T/0 at offset 1 (byte " in text
    assert text.endswith("CRC mismatch")
    unchecked = decode_records(good + bytes(bad), "broker-x", "T", 0, 0, verify_crc=False)
    assert [m.body for m in unchecked] == [b"hello world", b"hel\x93o world"]


def test_bad_magic_and_truncation_are_caught() -> None:
    good = encode_record("T", 0, 5, b"x" * 50)
    bad_magic = good[:4] + b"\0\0\0\0" + good[8:]
    assert "magic 0x0 is not a message's" in _expect_corrupt(bad_magic, first=5)
    truncated = good + good[:60]
    text = _expect_corrupt(truncated, first=5)
    assert "after offset 5" in text
    assert "shorter than a record header" in text
    cut = good + encode_record("T", 0, 6, b"y" * 50)[:-3]
    assert "at offset 6" in _expect_corrupt(cut, first=5)


def test_size_that_does_not_match_its_parts_is_caught() -> None:
    good = bytearray(encode_record("T", 0, 0, b"payload"))
    good[104:108] = (3).to_bytes(4, "little")  # body length
    assert "does not match its parts" in _expect_corrupt(bytes(good))


def test_records_of_another_topic_or_queue_are_refused() -> None:
    other_topic = encode_record("Other", 0, 0, b"x")
    assert "the record is of Other/0" in _expect_corrupt(other_topic)
    same_length = encode_record("U", 0, 0, b"x")
    assert "the record is of U/0" in _expect_corrupt(same_length)
    other_queue = encode_record("T", 3, 0, b"x")
    assert "the record is of T/3" in _expect_corrupt(other_queue)


def test_offsets_must_ascend_from_the_pull_offset() -> None:
    below = encode_record("T", 0, 4, b"x")
    text = _expect_corrupt(below, first=5)
    assert "at offset 4" in text
    assert "must ascend from 5" in text
    repeated = encode_record("T", 0, 5, b"x") + encode_record("T", 0, 5, b"y")
    assert "the record before was at 5" in _expect_corrupt(repeated, first=5)


def test_damage_found_lazily_is_reported_with_the_message() -> None:
    # a body flagged compressed that does not inflate: only found when the body is read
    buf = encode_record("T", 0, 0, b"not zlib", sys_flag=SYSFLAG_COMPRESSED)
    [m] = decode_records(buf, "broker-x", "T", 0, 0)
    with pytest.raises(CorruptRecordError, match="T/0 at offset 0 from broker broker-x"):
        _ = m.body
