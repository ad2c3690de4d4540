"""ConsumeQueues and the index rebuilt from the CommitLog alone; lookups by unique id, by key
(with time ranges and hash collisions) and by physical offset; offsets for timestamps."""

from __future__ import annotations

import dataclasses
import shutil
import zlib
from pathlib import Path

import pytest

from apogee.common.clock import ManualClock
from apogee.common.errors import CorruptRecordError
from apogee.store import AppendResult, Message, MessageStore, StoreConfig, StoredMessage
from apogee.testkit.store import OpenStore, dispatched

pytestmark = pytest.mark.unit


TOPICS = ["Alpha", "Beta", "Gamma"]
QUEUES = 2
PER_QUEUE = 100


def populate(store: MessageStore, clock: ManualClock) -> list[AppendResult]:
    """600 messages over 3 topics x 2 queues, each with its own key: two CommitLog files,
    several ConsumeQueue files per queue and three index files."""
    results: list[AppendResult] = []
    for i in range(PER_QUEUE):
        batch = [
            Message(
                topic=t,
                body=f"{t}-{q}-{i}-".encode() * 25,
                queue_id=q,
                tags=f"tag{i % 3}",
                keys=[f"key-{t}-{q}-{i}"],
            )
            for t in TOPICS
            for q in range(QUEUES)
        ]
        results += store.append(batch)
        clock.advance(1)
    dispatched(store)
    return results


def snapshot(store: MessageStore) -> dict[tuple[str, int], list[StoredMessage]]:
    return {
        (t, q): store.get(t, q, 0, max_count=1000).messages for t in TOPICS for q in range(QUEUES)
    }


@pytest.mark.parametrize(
    "deleted", [("consumequeue",), ("index",), ("consumequeue", "index")], ids="+".join
)
def test_rebuilt_from_the_commitlog(
    open_store: OpenStore, store_dir: Path, clock: ManualClock, deleted: tuple[str, ...]
) -> None:
    store = open_store()
    sent = populate(store, clock)
    assert store.commitlog.max_offset > store.cfg.commitlog_file_size
    before = snapshot(store)
    assert all(len(v) == PER_QUEUE for v in before.values())
    index_files = sorted(p.name for p in (store_dir / "index").iterdir())
    assert len(index_files) == 3  # 1200 entries, 400 per file
    store.close()

    for name in deleted:
        shutil.rmtree(store_dir / name)
    store = open_store()
    report = store.recovery
    assert report.clean_shutdown
    assert report.rebuilt_consume_queues == ("consumequeue" in deleted)
    assert report.rebuilt_index == ("index" in deleted)
    assert report.redispatch_from == 0
    assert report.entries_redispatched == len(sent)
    assert report.last_valid_offset == sent[-1].phys_offset + sent[-1].size

    assert snapshot(store) == before
    assert store.queue_max_offsets() == {(t, q): PER_QUEUE for t in TOPICS for q in range(QUEUES)}
    assert len(list((store_dir / "consumequeue" / "Alpha" / "0").iterdir())) == 2  # 64 per file
    if "index" in deleted:
        assert sorted(p.name for p in (store_dir / "index").iterdir()) == index_files
    for r in sent[::7]:
        by_id = store.by_unique_id(r.unique_id)
        assert by_id is not None
        assert by_id.phys_offset == r.phys_offset
        [key] = r.keys
        # each message comes back once, even where the index now holds it twice
        assert [m.phys_offset for m in store.by_key(r.topic, key)] == [r.phys_offset]
    assert len(store.get("Beta", 1, 0, max_count=1000, tags={"tag1"}).messages) == 33

    # appends carry on where each queue ended, and survive another reopen
    [new] = store.append(Message(topic="Gamma", body=b"new", queue_id=1, keys=["fresh"]))
    assert new.queue_offset == PER_QUEUE
    dispatched(store)
    store.close()
    store = open_store()
    assert store.recovery.entries_redispatched == 0
    assert store.get("Gamma", 1, PER_QUEUE).messages[0].body == b"new"
    assert [m.body for m in store.by_key("Gamma", "fresh")] == [b"new"]


# -- lookups ------------------------------------------------------------------------------------


def test_by_unique_id(store: MessageStore) -> None:
    results = store.append(
        [Message(topic="U", body=f"m{i}".encode(), queue_id=i % 4) for i in range(30)]
    )
    [own] = store.append(Message(topic="U2", body=b"mine", unique_id="MY-OWN-ID"))
    dispatched(store)
    for i, r in enumerate(results):
        found = store.by_unique_id(r.unique_id)
        assert found is not None
        assert (found.body, found.phys_offset, found.queue_id) == (
            f"m{i}".encode(),
            r.phys_offset,
            i % 4,
        )
    mine = store.by_unique_id("MY-OWN-ID")
    assert mine is not None
    assert (mine.topic, mine.body, mine.phys_offset) == ("U2", b"mine", own.phys_offset)
    assert store.by_unique_id("NO-SUCH-ID") is None
    assert store.by_unique_id(results[0].unique_id[:-1] + "X") is None


def test_an_id_stored_twice_finds_both_newest_first(
    store: MessageStore, clock: ManualClock
) -> None:
    """A retried send may be stored twice (at-least-once): a lookup by its id must reach every
    copy, not only the newest."""
    [first] = store.append(Message(topic="U", body=b"first", unique_id="TWICE"))
    store.append(Message(topic="U", body=b"between"))
    clock.advance(5)
    [again] = store.append(Message(topic="U", body=b"again", unique_id="TWICE", queue_id=1))
    dispatched(store)
    found = store.all_by_unique_id("TWICE")
    assert [(m.body, m.phys_offset) for m in found] == [
        (b"again", again.phys_offset),
        (b"first", first.phys_offset),
    ]
    newest = store.by_unique_id("TWICE")
    assert newest is not None
    assert newest.body == b"again"
    assert store.all_by_unique_id("TWICE", max_count=1) == found[:1]
    assert store.all_by_unique_id("NEVER") == []


def test_by_key_within_a_time_range(store: MessageStore, clock: ManualClock) -> None:
    t0 = clock.time_ms()
    [a] = store.append(Message(topic="K", body=b"a", keys=["k", "first"]))
    clock.advance(10)
    [b] = store.append(Message(topic="K", body=b"b", keys=["k"], queue_id=1))
    store.append(Message(topic="Elsewhere", body=b"other topic", keys=["k"]))
    clock.advance(10)
    [c] = store.append(Message(topic="K", body=b"c", keys=["other", "k"]))
    dispatched(store)

    def bodies(
        begin: int = 0, end: int = 2**62, key: str = "k", max_count: int = 64
    ) -> list[bytes]:
        return [m.body for m in store.by_key("K", key, begin, end, max_count)]

    assert bodies() == [b"c", b"b", b"a"]  # newest first
    assert bodies(t0 + 5_000, t0 + 15_000) == [b"b"]
    assert bodies(t0, t0) == [b"a"]  # both ends included
    assert bodies(t0 + 20_000, t0 + 30_000) == [b"c"]
    assert bodies(t0 + 1, t0 + 9_999) == []  # nothing stored in between
    assert bodies(t0 - 60_000, t0 - 1) == []  # all after the range
    assert bodies(t0 + 10_001, t0 + 19_999) == []
    assert bodies(max_count=2) == [b"c", b"b"]
    assert bodies(key="first") == [b"a"]
    assert bodies(key="missing") == []
    assert [m.body for m in store.by_key("Elsewhere", "k")] == [b"other topic"]
    assert {m.store_timestamp for m in store.by_key("K", "k")} == {
        a.store_timestamp,
        b.store_timestamp,
        c.store_timestamp,
    }


def test_many_messages_with_one_key_all_come_back(store: MessageStore) -> None:
    # 300 messages x (unique id + key) = 600 index entries: the key's chain spans two files
    results = store.append(
        [Message(topic="Hot", body=str(i).encode(), keys=["same"]) for i in range(300)]
    )
    dispatched(store)
    assert len(list((store.root / "index").iterdir())) == 2
    found = store.by_key("Hot", "same", max_count=1000)
    assert [m.phys_offset for m in found] == [r.phys_offset for r in reversed(results)]
    assert [m.body for m in store.by_key("Hot", "same", max_count=5)] == [
        str(i).encode() for i in range(299, 294, -1)
    ]


def test_message_at(store: MessageStore) -> None:
    results = store.append([Message(topic="P", body=f"p{i}".encode()) for i in range(5)])
    for i, r in enumerate(results):
        m = store.message_at(r.phys_offset)
        assert (m.body, m.queue_offset, m.phys_offset, m.size) == (
            f"p{i}".encode(),
            i,
            r.phys_offset,
            r.size,
        )
    with pytest.raises(CorruptRecordError, match="no message record starts here"):
        store.message_at(results[1].phys_offset + 1)
    end = results[-1].phys_offset + results[-1].size
    with pytest.raises(CorruptRecordError, match=rf"beyond the end of the log \({end}\)"):
        store.message_at(end)


def test_every_key_in_one_slot(open_store: OpenStore, config: StoreConfig) -> None:
    store = open_store(dataclasses.replace(config, index_slots=1))
    results = store.append(
        [
            Message(topic="Slot", body=str(i).encode(), keys=[f"k{i % 50}", f"unique{i}"])
            for i in range(150)
        ]
    )
    dispatched(store)
    for k in range(50):
        got = store.by_key("Slot", f"k{k}")
        assert [m.body for m in got] == [str(i).encode() for i in (k + 100, k + 50, k)]
    for i in (0, 77, 149):
        assert [m.body for m in store.by_key("Slot", f"unique{i}")] == [str(i).encode()]
        found = store.by_unique_id(results[i].unique_id)
        assert found is not None
        assert found.body == str(i).encode()
    assert store.by_key("Slot", "k50") == []


def test_crc32_colliding_keys_never_mix(store: MessageStore, crc32_twins: tuple[str, str]) -> None:
    a, b = crc32_twins
    assert a != b
    assert zlib.crc32(f"C#{a}".encode()) == zlib.crc32(f"C#{b}".encode())  # index keys collide
    [ra] = store.append(Message(topic="C", body=b"A", keys=[a], unique_id=a))
    [rb] = store.append(Message(topic="C", body=b"B", keys=[b], unique_id=b))
    [ra2] = store.append(Message(topic="C", body=b"A2", keys=[a]))
    dispatched(store)
    assert [m.phys_offset for m in store.by_key("C", a)] == [ra2.phys_offset, ra.phys_offset]
    assert [m.phys_offset for m in store.by_key("C", b)] == [rb.phys_offset]
    found_a = store.by_unique_id(a)
    found_b = store.by_unique_id(b)
    assert found_a is not None
    assert found_b is not None
    assert (found_a.body, found_b.body) == (b"A", b"B")


def test_crc32_colliding_key_used_often_does_not_hide_the_other(
    store: MessageStore, crc32_twins: tuple[str, str]
) -> None:
    a, b = crc32_twins
    [ra] = store.append(Message(topic="C", body=b"A", keys=[a], unique_id=a))
    # a busy key (and a repeated id) with the same hash: its newer entries come first
    store.append([Message(topic="C", body=b"B", keys=[b], unique_id=b) for _ in range(100)])
    dispatched(store)
    assert [m.phys_offset for m in store.by_key("C", a, max_count=1)] == [ra.phys_offset]
    assert len(store.by_key("C", b, max_count=1000)) == 100
    found = store.by_unique_id(a)
    assert found is not None
    assert found.phys_offset == ra.phys_offset


# -- offsets for timestamps ---------------------------------------------------------------------


def test_offset_for_timestamp(store: MessageStore, clock: ManualClock) -> None:
    stamps = []
    for i in range(20):
        [r] = store.append(Message(topic="Time", body=str(i).encode(), queue_id=2))
        stamps.append(r.store_timestamp)
        clock.advance(1 + i % 3)  # uneven gaps
    # a batch shares one stamp
    batch = store.append([Message(topic="Time", body=b"x", queue_id=2) for _ in range(3)])
    dispatched(store)
    assert [r.queue_offset for r in batch] == [20, 21, 22]

    def oft(ts: int) -> int:
        return store.offset_for_timestamp("Time", 2, ts)

    for i, ts in enumerate(stamps):
        assert oft(ts) == i  # exact hits
        assert oft(ts + 1) == i + 1  # between two stamps: the next one
    assert oft(batch[0].store_timestamp) == 20  # the first of equal stamps
    assert oft(stamps[0] - 3_600_000) == 0  # before the first: the min offset
    assert oft(batch[0].store_timestamp + 1) == 23  # after the last: the max offset
    assert store.offset_for_timestamp("Time", 0, stamps[0]) == 0  # a queue never written
