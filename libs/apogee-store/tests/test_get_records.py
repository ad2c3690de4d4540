"""get_records: whole CommitLog records of a queue, as a pull answers them: in queue order, within
max_count and max_bytes (at least one message), across queue and log files, records interleaved
with other queues', exact tag filtering, statuses, and checks against a damaged queue."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from apogee.codec import StoredMessage, decode
from apogee.common.clock import ManualClock
from apogee.common.errors import CorruptRecordError, InvalidArgumentError
from apogee.common.selector import compile_sql
from apogee.store import (
    AppendResult,
    GetStatus,
    Message,
    MessageStore,
    RecordsResult,
    StoreConfig,
    tag_hash,
)
from apogee.store.consumequeue import ENTRY
from apogee.store.reading import DENSE_SLACK
from apogee.testkit.store import OpenStore, dispatched

pytestmark = pytest.mark.unit

SIZE = struct.Struct("<i")
HOUR_S = 3600


def split(records: bytes) -> list[StoredMessage]:
    """Decode back-to-back records the way a client does, CRC checked."""
    out: list[StoredMessage] = []
    pos = 0
    while pos < len(records):
        (size,) = SIZE.unpack_from(records, pos)
        out.append(decode(records, f"byte {pos}", True, pos, size))
        pos += size
    return out


def bodies(result: RecordsResult) -> list[bytes]:
    msgs = split(result.records)
    assert len(msgs) == result.count
    return [m.body for m in msgs]


def read_all(store: MessageStore, topic: str, queue_id: int, **kwargs: object) -> list[bytes]:
    """Pull the whole queue from 0, as a consumer would, checking offsets as it goes."""
    out: list[bytes] = []
    offset = 0
    while True:
        got = store.get_records(topic, queue_id, offset, **kwargs)  # type: ignore[arg-type]
        if got.status is not GetStatus.FOUND:
            assert got.status is GetStatus.NO_NEW_MESSAGE
            return out
        msgs = split(got.records)
        assert [m.queue_offset for m in msgs] == list(range(offset, offset + got.count))
        assert {(m.topic, m.queue_id) for m in msgs} == {(topic, queue_id)}
        out += [m.body for m in msgs]
        offset = got.next_offset


def test_contiguous_records_come_back_whole_and_in_order(store: MessageStore) -> None:
    results = store.append([Message("C", f"m{i}".encode(), tags="t") for i in range(10)])
    dispatched(store)
    got = store.get_records("C", 0, 0, max_count=32, max_bytes=1 << 20)
    assert got.status is GetStatus.FOUND
    assert (got.count, got.next_offset, got.min_offset, got.max_offset) == (10, 10, 0, 10)
    assert bodies(got) == [f"m{i}".encode() for i in range(10)]
    # the bytes are the log's own
    first, last = results[0], results[-1]
    assert got.records == store.commitlog.read(
        first.phys_offset, last.phys_offset + last.size - first.phys_offset
    )
    # and the messages the same as get() decodes
    assert split(got.records) == store.get("C", 0, 0, max_count=32).messages


@pytest.mark.parametrize("max_count", [1, 3, 9])
def test_max_count(store: MessageStore, max_count: int) -> None:
    store.append([Message("M", bytes([i]) * 10) for i in range(12)])
    dispatched(store)
    got = store.get_records("M", 0, 2, max_count=max_count, max_bytes=1 << 20)
    assert got.count == max_count
    assert [m.queue_offset for m in split(got.records)] == list(range(2, 2 + max_count))
    assert got.next_offset == 2 + max_count


def test_max_bytes_and_at_least_one_message(store: MessageStore) -> None:
    results = store.append([Message("B", bytes(1000)) for _ in range(10)])
    dispatched(store)
    size = results[0].size
    got = store.get_records("B", 0, 0, max_count=32, max_bytes=3 * size + size // 2)
    assert (got.count, got.next_offset, len(got.records)) == (3, 3, 3 * size)
    exact = store.get_records("B", 0, 0, max_count=32, max_bytes=4 * size)
    assert exact.count == 4
    tiny = store.get_records("B", 0, 5, max_count=32, max_bytes=1)
    assert (tiny.status, tiny.count, tiny.next_offset) == (GetStatus.FOUND, 1, 6)
    assert len(tiny.records) == size


def test_interleaved_queues_dense_and_sparse(store: MessageStore) -> None:
    # one batch per round for four queues: each queue's records are interleaved with others'
    for r in range(6):
        store.append([Message("I", f"q{q}-{r}".encode(), queue_id=q) for q in range(4)])
    # queue 9 gets one small message per round between big ones of queue 8: a sparse window
    for r in range(4):
        store.append(
            [Message("I", bytes(15000), queue_id=8) for _ in range(DENSE_SLACK // 15000 + 1)]
            + [Message("I", f"small-{r}".encode(), queue_id=9)]
        )
    dispatched(store)
    for q in range(4):
        got = store.get_records("I", q, 0, max_count=100, max_bytes=1 << 20)
        assert bodies(got) == [f"q{q}-{r}".encode() for r in range(6)]
        assert got.next_offset == 6
    sparse = store.get_records("I", 9, 1, max_count=100, max_bytes=1 << 20)
    assert bodies(sparse) == [b"small-1", b"small-2", b"small-3"]
    assert [m.queue_offset for m in split(sparse.records)] == [1, 2, 3]


def test_reads_across_queue_files_and_log_files(store: MessageStore) -> None:
    # 64 entries per ConsumeQueue file and 256 KiB log files in the test configuration
    sent: list[bytes] = []
    for r in range(60):
        batch = [Message("X", f"{r}-{i}".encode() * 200, queue_id=i % 2) for i in range(6)]
        store.append(batch)
        sent += [m.body for m in batch]
    dispatched(store)
    assert len(list((store.root / "commitlog").iterdir())) >= 2
    assert store.max_offset("X", 0) == 180
    for q in range(2):
        assert read_all(store, "X", q, max_count=1000, max_bytes=1 << 30) == sent[q::2]
        assert read_all(store, "X", q, max_count=7, max_bytes=5000) == sent[q::2]
    # one call fills max_count across ConsumeQueue files (64 entries each here)
    one = store.get_records("X", 0, 10, max_count=150, max_bytes=1 << 30)
    assert (one.count, one.next_offset) == (150, 160)


def test_statuses(open_store: OpenStore, config: StoreConfig, clock: ManualClock) -> None:
    store = open_store(dataclasses.replace(config, files_deleted_per_round=1))
    assert store.get_records("Nobody", 0, 0, 32, 1024).status is GetStatus.NO_SUCH_QUEUE
    while store.commitlog.max_offset <= 2 * config.commitlog_file_size:
        store.append(Message("S", bytes(4096)))
    dispatched(store)
    hi = store.max_offset("S", 0)
    at_max = store.get_records("S", 0, hi, 32, 1024)
    assert (at_max.status, at_max.count, at_max.records, at_max.next_offset) == (
        GetStatus.NO_NEW_MESSAGE,
        0,
        b"",
        hi,
    )
    beyond = store.get_records("S", 0, hi + 5, 32, 1024)
    assert (beyond.status, beyond.next_offset, beyond.max_offset) == (
        GetStatus.OFFSET_OVERFLOW,
        hi,
        hi,
    )
    clock.advance(73 * HOUR_S)
    assert store.retention.run_once().commitlog_files == 1
    lo = store.min_offset("S", 0)
    assert lo > 0
    small = store.get_records("S", 0, 0, 32, 1024)
    assert (small.status, small.next_offset, small.min_offset) == (
        GetStatus.OFFSET_TOO_SMALL,
        lo,
        lo,
    )
    assert split(store.get_records("S", 0, lo, 1, 1024).records)[0].queue_offset == lo


def test_bad_arguments(store: MessageStore) -> None:
    with pytest.raises(InvalidArgumentError, match="max_count: must be positive, got 0"):
        store.get_records("T", 0, 0, 0, 100)
    with pytest.raises(InvalidArgumentError, match="max_bytes: must be positive, got 0"):
        store.get_records("T", 0, 0, 1, 0)
    with pytest.raises(InvalidArgumentError, match="has a character outside"):
        store.get_records("a b", 0, 0, 1, 100)


def test_tag_filter_is_exact_despite_hash_collisions(
    store: MessageStore, crc32_twins: tuple[str, str]
) -> None:
    tag_a, tag_b = crc32_twins
    assert tag_hash(tag_a) == tag_hash(tag_b)
    tags = [tag_a, tag_b, "other", None, tag_a, tag_a, tag_b]
    store.append([Message("F", f"{i}".encode(), tags=t) for i, t in enumerate(tags)])
    dispatched(store)
    only_a = store.get_records("F", 0, 0, 32, 1 << 20, frozenset({tag_a}))
    assert bodies(only_a) == [b"0", b"4", b"5"]
    assert {m.tags for m in split(only_a.records)} == {tag_a}
    assert only_a.next_offset == 7
    only_b = store.get_records("F", 0, 0, 32, 1 << 20, frozenset({tag_b}))
    assert bodies(only_b) == [b"1", b"6"]
    a_or_other = store.get_records("F", 0, 0, 2, 1 << 20, frozenset({tag_a, "other"}))
    assert bodies(a_or_other) == [b"0", b"2"]
    assert a_or_other.next_offset == 3  # just past the last message returned
    # only colliding tags ahead: passed over, and the next read starts after them
    none = store.get_records("F", 0, 1, 32, 1 << 20, frozenset({"nothing"}))
    assert (none.status, none.count, none.next_offset) == (GetStatus.NO_MATCHED_MESSAGE, 0, 7)
    twin_only = store.get_records("F", 0, 6, 32, 1 << 20, frozenset({tag_a}))
    assert (twin_only.status, twin_only.next_offset) == (GetStatus.NO_MATCHED_MESSAGE, 7)
    # "" and "*" mean every message: no filter (an empty set too)
    assert store.get_records("F", 0, 0, 32, 1 << 20, frozenset()).count == 7


def test_tag_filter_respects_max_bytes(store: MessageStore) -> None:
    results = store.append(
        [Message("FB", bytes(500), tags="A" if i % 2 else "B") for i in range(10)]
    )
    dispatched(store)
    size = results[0].size
    got = store.get_records("FB", 0, 0, 32, 2 * size, frozenset({"A"}))
    assert [m.queue_offset for m in split(got.records)] == [1, 3]
    assert got.next_offset == 4  # just past the last message returned
    fuller = store.get_records("FB", 0, 0, 32, 2 * size + 100, frozenset({"A"}))
    assert [m.queue_offset for m in split(fuller.records)] == [1, 3]
    assert fuller.next_offset == 5  # the third "A" (offset 5) does not fit: for the next read
    one = store.get_records("FB", 0, 0, 32, 1, frozenset({"A"}))
    assert ([m.queue_offset for m in split(one.records)], one.next_offset) == ([1], 2)


def test_a_queue_entry_pointing_elsewhere_is_refused(store: MessageStore) -> None:
    results = store.append([Message("D", f"d{i}".encode()) for i in range(5)])
    dispatched(store)
    cq = store.consume_queue("D", 0)
    assert cq is not None
    # entry 0 now points at the record of offset 1
    mf = cq.files.files[0]
    mf.write(0, ENTRY.pack(results[1].phys_offset, results[1].size, 0))
    with pytest.raises(CorruptRecordError, match=r"D/0 offset 0 .*does not match its queue entry"):
        store.get_records("D", 0, 0, 32, 1 << 20)
    # the rest of the queue still reads
    assert bodies(store.get_records("D", 0, 2, 32, 1 << 20)) == [b"d2", b"d3", b"d4"]


def test_a_message_larger_than_max_bytes_in_a_filtered_read(store: MessageStore) -> None:
    store.append([Message("L", bytes(8000), tags="A"), Message("L", b"small", tags="A")])
    dispatched(store)
    got = store.get_records("L", 0, 0, 32, 100, frozenset({"A"}))
    assert (got.count, got.next_offset) == (1, 1)
    assert len(split(got.records)[0].body) == 8000


def test_entries_whose_records_retention_removed_are_passed_over(store: MessageStore) -> None:
    # a queue still pointing into a CommitLog file that is gone (retention ran between the
    # two): the read starts at the first record still there
    results: list[AppendResult] = []
    while store.commitlog.max_offset <= store.cfg.commitlog_file_size:
        results += store.append(Message("R", bytes(4000)))
    results += store.append([Message("R", bytes(4000)) for _ in range(10)])
    dispatched(store)
    store.commitlog.files.drop_first(1)
    kept = next(r for r in results if r.phys_offset >= store.commitlog.min_offset)
    got = store.get_records("R", 0, 0, 5, 1 << 20)
    assert got.status is GetStatus.FOUND
    assert [m.queue_offset for m in split(got.records)] == list(
        range(kept.queue_offset, kept.queue_offset + 5)
    )
    assert got.next_offset == kept.queue_offset + 5
    assert store.get("R", 0, 0, 5).messages[0].queue_offset == kept.queue_offset


def test_bytes_behind(store: MessageStore) -> None:
    results = store.append([Message("H", bytes(100)) for _ in range(3)])
    dispatched(store)
    end = store.commitlog.max_offset
    assert [store.bytes_behind("H", 0, i) for i in range(3)] == [
        end - r.phys_offset for r in results
    ]
    assert store.bytes_behind("H", 0, 3) is None  # nothing there yet
    assert store.bytes_behind("H", 1, 0) is None  # a queue never written


def test_a_property_filter_selects_by_properties_tags_and_keys(store: MessageStore) -> None:
    colours = ["red", "blue", "red", None, "green", "red"]
    store.append(
        [
            Message(
                "Q",
                f"{i}".encode(),
                tags="A" if i % 2 else "B",
                keys=[f"k{i}"],
                properties={"color": c, "size": str(i)} if c else {"size": str(i)},
            )
            for i, c in enumerate(colours)
        ]
    )
    dispatched(store)
    red = store.get_records("Q", 0, 0, 32, 1 << 20, None, compile_sql("color = 'red'"))
    assert bodies(red) == [b"0", b"2", b"5"]
    assert red.next_offset == 6
    big_red = compile_sql("color = 'red' AND size > 1")
    assert bodies(store.get_records("Q", 0, 0, 32, 1 << 20, None, big_red)) == [b"2", b"5"]
    # tags and the condition must both hold; TAGS and KEYS are properties to a condition
    a_red = store.get_records(
        "Q", 0, 0, 32, 1 << 20, frozenset({"A"}), compile_sql("color = 'red'")
    )
    assert bodies(a_red) == [b"5"]
    by_key = compile_sql("KEYS = 'k3' OR TAGS = 'B' AND color IS NULL")
    assert bodies(store.get_records("Q", 0, 0, 32, 1 << 20, None, by_key)) == [b"3"]
    # nothing matches: passed over, and the next read starts after them
    none = store.get_records("Q", 0, 0, 32, 1 << 20, None, compile_sql("color = 'pink'"))
    assert (none.status, none.count, none.next_offset) == (GetStatus.NO_MATCHED_MESSAGE, 0, 6)
    # the byte budget holds as with tags: the first match always, the rest while they fit
    one = store.get_records("Q", 0, 0, 32, 1, None, compile_sql("color = 'red'"))
    assert (bodies(one), one.next_offset) == ([b"0"], 1)
