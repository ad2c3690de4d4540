"""Appending send records: bytes a sender encoded, placed by the log without decoding them.

The same store read paths (get, get_records, lookup by id and key, recovery) must see them
exactly as if the messages had been appended as :class:`Message` objects.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from apogee.codec import decode
from apogee.codec.send import (
    QUEUE_AT,
    QUEUE_ID,
    RecordRef,
    encode_properties,
    encode_send_record,
)
from apogee.common.clock import ManualClock
from apogee.common.errors import InvalidArgumentError
from apogee.store import FlushMode, Message, MessageStore, StoreConfig, tag_hash
from apogee.testkit.store import OpenStore, dispatched

pytestmark = pytest.mark.unit


def record(
    body: bytes,
    queue_id: int = 0,
    topic: str = "Orders",
    tags: str | None = None,
    keys: tuple[str, ...] = (),
    uid: str = "",
    props: dict[str, str] | None = None,
    born: int = 0,
) -> tuple[bytearray, RecordRef]:
    uid = uid or f"U{body.hex()}"
    rec = encode_send_record(
        topic.encode(),
        body,
        encode_properties(tags, keys, uid, props),
        queue_id=queue_id,
        born_timestamp=born,
    )
    return rec, (topic, queue_id, len(rec), tag_hash(tags), keys, uid)


def block(*recs: tuple[bytearray, RecordRef]) -> tuple[bytes, list[RecordRef]]:
    return b"".join(r for r, _ in recs), [ref for _, ref in recs]


def test_records_round_trip_like_messages(store: MessageStore, clock: ManualClock) -> None:
    data, refs = block(
        record(b"first", 3, tags="TagA", keys=("k1", "k2"), props={"color": "blue"}, born=42),
        record(b"second", 3),
        record(b"third", 1, tags="TagB"),
    )
    results = store.append_records(data, refs, born_host="10.1.2.3:4567")
    assert [(r.queue_id, r.queue_offset) for r in results] == [(3, 0), (3, 1), (1, 0)]
    assert results[1].phys_offset == results[0].phys_offset + results[0].size
    dispatched(store)
    first, second = store.get("Orders", 3, 0).messages
    assert (first.body, first.tags, first.keys, first.unique_id) == (
        b"first",
        "TagA",
        ["k1", "k2"],
        "U" + b"first".hex(),
    )
    assert first.properties["color"] == "blue"
    assert (first.born_timestamp, second.born_timestamp) == (42, clock.time_ms())
    assert first.store_timestamp == clock.time_ms()
    assert first.born_host == "10.1.2.3:4567"
    assert (first.queue_offset, first.phys_offset) == (0, results[0].phys_offset)
    # the CRC was computed over the finished record
    raw = store.commitlog.read(results[0].phys_offset, results[0].size)
    assert decode(raw, "test", verify_crc=True).body == b"first"
    assert store.by_unique_id(first.unique_id) is not None
    assert [m.body for m in store.by_key("Orders", "k2")] == [b"first"]
    [third] = store.get("Orders", 1, 0, tags={"TagB"}).messages
    assert third.body == b"third"


def test_records_and_messages_share_queue_offsets(store: MessageStore) -> None:
    store.append(Message("Orders", b"m0", queue_id=2))
    data, refs = block(record(b"r1", 2), record(b"r2", 2))
    store.append_records(data, refs)
    store.append(Message("Orders", b"m3", queue_id=2))
    dispatched(store)
    got = store.get("Orders", 2, 0).messages
    assert [(m.body, m.queue_offset) for m in got] == [
        (b"m0", 0),
        (b"r1", 1),
        (b"r2", 2),
        (b"m3", 3),
    ]


@pytest.mark.parametrize("count", [40, 300])
def test_a_block_spanning_file_ends_rolls_like_a_batch(
    open_store: OpenStore, store_dir: Path, count: int
) -> None:
    store = open_store()
    sent = [bytes([i % 251]) * 3000 + i.to_bytes(4, "big") for i in range(count)]
    recs = [record(body, i % 4) for i, body in enumerate(sent)]
    for start in range(0, count, 100):
        data, refs = block(*recs[start : start + 100])
        store.append_records(data, refs)
    dispatched(store)
    bodies = [m.body for q in range(4) for m in store.get("Orders", q, 0, max_count=count).messages]
    assert sorted(bodies) == sorted(sent)
    store.close()
    # a clean reopen recovers every record (CRCs checked when files are verified)
    again = open_store(dataclasses.replace(store.cfg, recovery_verify_files_after_clean_stop=True))
    assert sum(again.max_offset("Orders", q) for q in range(4)) == count


def test_a_mismatched_block_writes_nothing(store: MessageStore) -> None:
    good, bad = record(b"good"), record(b"bad", 1)
    data, refs = block(good, bad)
    wrong = [refs[0], (*refs[1][:1], 2, *refs[1][2:])]  # the ref says queue 2, the record 1
    with pytest.raises(InvalidArgumentError, match=r"records\[1\]"):
        store.append_records(data, wrong)
    with pytest.raises(InvalidArgumentError, match="bytes follow the last record"):
        store.append_records(data + b"x", refs)
    assert store.commitlog.max_offset == 0
    assert store.max_offset("Orders", 0) == 0


def test_a_sender_sets_the_queue_per_attempt(store: MessageStore) -> None:
    rec, ref = record(b"moved", 0)
    QUEUE_ID.pack_into(rec, QUEUE_AT, 5)
    store.append_records(bytes(rec), [(ref[0], 5, *ref[2:])])
    dispatched(store)
    assert [m.body for m in store.get("Orders", 5, 0).messages] == [b"moved"]


def test_sync_flush_acknowledges_records_once_durable(
    open_store: OpenStore, config: StoreConfig
) -> None:
    store = open_store(dataclasses.replace(config, flush_mode=FlushMode.SYNC))
    data, refs = block(record(b"durable"))
    outcome: list[BaseException | None] = []
    durable = threading.Event()

    def on_durable(err: BaseException | None) -> None:
        outcome.append(err)
        durable.set()

    [first] = store.append_records_async(data, refs, on_durable)
    assert durable.wait(10)
    assert outcome == [None]
    assert store.commitlog.files.flushed_where >= first.phys_offset + first.size
    store.append_records(*block(record(b"after")))  # returns once durable
    dispatched(store)
    assert store.max_offset("Orders", 0) == 2
