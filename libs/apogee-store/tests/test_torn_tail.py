"""A torn or garbled last record after a crash: recovery cuts the log exactly where that record
starts, keeps everything before it, zeroes what follows and lets appends carry on from there."""

from __future__ import annotations

from pathlib import Path

import pytest

from apogee.codec import HEADER_SIZE
from apogee.common.errors import CorruptRecordError
from apogee.store import AppendResult, GetStatus, Message, MessageStore
from apogee.testkit.store import OpenStore, dispatched

pytestmark = pytest.mark.unit


FILE_SIZE = 256 * 1024
QUEUES = 3


def zero_tail(raw: bytearray, pos: int, size: int) -> None:
    """The last 16 bytes never reached the disk."""
    raw[pos + size - 16 : pos + size] = bytes(16)


def zero_second_half(raw: bytearray, pos: int, size: int) -> None:
    """Only the first half of the record reached the disk."""
    half = size // 2
    raw[pos + half : pos + size] = bytes(size - half)


def zero_all_but_size(raw: bytearray, pos: int, size: int) -> None:
    """Only the first 4 bytes of the header reached the disk."""
    raw[pos + 4 : pos + size] = bytes(size - 4)


def garble_middle(raw: bytearray, pos: int, size: int) -> None:
    """Bytes in the middle of the body are wrong."""
    mid = pos + HEADER_SIZE + (size - HEADER_SIZE) // 2
    for i in range(mid, mid + 8):
        raw[i] ^= 0x5A


def garble_header(raw: bytearray, pos: int, size: int) -> None:
    """The queue offset field of the header is wrong (the CRC covers the header too)."""
    raw[pos + 20] ^= 0x01


DAMAGE = {
    f.__name__: f
    for f in (zero_tail, zero_second_half, zero_all_but_size, garble_middle, garble_header)
}


def write_messages(
    store: MessageStore, count: int, body_size: int, first: int = 0
) -> list[AppendResult]:
    """Append ``count`` messages one by one, message ``i`` with key ``k<i>``, over 3 queues."""
    results: list[AppendResult] = []
    for i in range(first, first + count):
        results += store.append(
            Message(
                topic="Torn",
                body=bytes([i % 256]) * body_size,
                queue_id=i % QUEUES,
                keys=[f"k{i}"],
                tags=f"t{i % 2}",
            )
        )
    dispatched(store)
    return results


def read_queues(store: MessageStore) -> dict[int, list[tuple[object, ...]]]:
    return {q: [m for m in store.get("Torn", q, 0, max_count=1000).messages] for q in range(QUEUES)}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
@pytest.mark.parametrize(
    ("count", "body_size"), [(30, 700), (30, 12_000)], ids=["one-file", "two-files"]
)
def test_torn_last_record_is_cut_off(
    open_store: OpenStore, store_dir: Path, damage: str, count: int, body_size: int
) -> None:
    store = open_store()
    results = write_messages(store, count, body_size)
    files = -(-store.commitlog.max_offset // FILE_SIZE)
    assert files == (1 if body_size < 1000 else 2)
    before = {r.phys_offset: store.message_at(r.phys_offset) for r in results}
    queues_before = read_queues(store)
    store.close()

    last = results[-1]
    start = last.phys_offset - last.phys_offset % FILE_SIZE
    path = store_dir / "commitlog" / f"{start:020d}"
    raw = bytearray(path.read_bytes())
    DAMAGE[damage](raw, last.phys_offset - start, last.size)
    path.write_bytes(bytes(raw))
    (store_dir / "abort").touch()  # as a crash leaves it

    store = open_store()
    report = store.recovery
    assert not report.clean_shutdown
    assert report.last_valid_offset == last.phys_offset
    assert report.bytes_truncated > 0
    assert report.files_quarantined == []
    assert report.stopped_because != ""

    # everything before the torn record reads back as it was
    for r in results[:-1]:
        assert store.message_at(r.phys_offset) == before[r.phys_offset]
    expected = {q: list(v) for q, v in queues_before.items()}
    expected[last.queue_id].pop()
    assert read_queues(store) == expected
    assert store.max_offset("Torn", last.queue_id) == last.queue_offset
    assert store.get("Torn", last.queue_id, last.queue_offset).status is GetStatus.NO_NEW_MESSAGE
    assert store.by_unique_id(last.unique_id) is None
    assert store.by_key("Torn", f"k{count - 1}") == []
    assert [m.phys_offset for m in store.by_key("Torn", f"k{count - 2}")] == [
        results[-2].phys_offset
    ]
    with pytest.raises(CorruptRecordError):
        store.message_at(last.phys_offset)
    # after the cut the file holds only zeros
    assert path.read_bytes()[last.phys_offset - start :].count(0) == FILE_SIZE - (
        last.phys_offset - start
    )

    # appends continue at the cut, in the torn record's queue slot
    [again] = store.append(Message(topic="Torn", body=b"again", queue_id=last.queue_id))
    [other] = store.append(Message(topic="Torn", body=b"other", queue_id=(last.queue_id + 1) % 3))
    assert again.phys_offset == last.phys_offset
    assert again.queue_offset == last.queue_offset
    assert other.phys_offset == again.phys_offset + again.size
    dispatched(store)
    store.close()

    store = open_store()
    assert store.recovery.clean_shutdown
    assert store.recovery.last_valid_offset == other.phys_offset + other.size
    for r in results[:-1]:
        assert store.message_at(r.phys_offset) == before[r.phys_offset]
    got = store.get("Torn", last.queue_id, last.queue_offset)
    assert [m.body for m in got.messages] == [b"again"]
    assert store.message_at(again.phys_offset).body == b"again"
    assert store.get("Torn", other.queue_id, other.queue_offset).messages[0].body == b"other"
    found = store.by_unique_id(again.unique_id)
    assert found is not None
    assert found.body == b"again"


def test_crash_with_an_intact_log_loses_nothing(open_store: OpenStore, store_dir: Path) -> None:
    store = open_store()
    results = write_messages(store, 20, 500)
    queues_before = read_queues(store)
    store.close()
    (store_dir / "abort").touch()

    store = open_store()
    report = store.recovery
    assert not report.clean_shutdown
    assert report.last_valid_offset == results[-1].phys_offset + results[-1].size
    assert report.bytes_truncated == 0
    assert report.stopped_because == ""
    assert read_queues(store) == queues_before
    [nxt] = store.append(Message(topic="Torn", body=b"next"))
    assert nxt.phys_offset == report.last_valid_offset
    assert nxt.queue_offset == len(queues_before[0])


@pytest.mark.parametrize("checkpoint", ["stale", "garbled", "missing"])
def test_torn_tail_with_a_stale_or_bad_checkpoint(
    open_store: OpenStore, store_dir: Path, checkpoint: str
) -> None:
    store = open_store()
    first = write_messages(store, 20, 12_000)
    store.flush()  # the checkpoint now says: durable and dispatched up to here
    old_checkpoint = (store_dir / "checkpoint").read_bytes()
    rest = write_messages(store, 20, 12_000, first=20)
    results = first + rest
    assert results[-1].phys_offset > FILE_SIZE  # the torn record is in the second file
    before = {r.phys_offset: store.message_at(r.phys_offset) for r in results}
    store.close()

    last = results[-1]
    path = store_dir / "commitlog" / f"{FILE_SIZE:020d}"
    raw = bytearray(path.read_bytes())
    zero_second_half(raw, last.phys_offset - FILE_SIZE, last.size)
    path.write_bytes(bytes(raw))
    if checkpoint == "stale":
        (store_dir / "checkpoint").write_bytes(old_checkpoint)
    elif checkpoint == "garbled":
        (store_dir / "checkpoint").write_bytes(b"\xff" * len(old_checkpoint))
    else:
        (store_dir / "checkpoint").unlink()
    (store_dir / "abort").touch()

    store = open_store()
    report = store.recovery
    assert not report.clean_shutdown
    assert report.last_valid_offset == last.phys_offset
    assert report.bytes_truncated > 0
    if checkpoint == "stale":
        assert report.redispatch_from == first[-1].phys_offset + first[-1].size
        assert report.entries_redispatched == len(rest) - 1
    else:  # no usable checkpoint: everything is checked and re-dispatched
        assert (report.verify_from, report.redispatch_from) == (0, 0)
        assert report.entries_redispatched == len(results) - 1
    for r in results[:-1]:
        assert store.message_at(r.phys_offset) == before[r.phys_offset]
        got = store.get("Torn", r.queue_id, r.queue_offset, max_count=1)
        assert [m for m in got.messages] == [before[r.phys_offset]]
        assert [m.phys_offset for m in store.by_key("Torn", r.keys[0])] == [r.phys_offset]
    assert store.max_offset("Torn", last.queue_id) == last.queue_offset
    [again] = store.append(Message(topic="Torn", body=b"again", queue_id=last.queue_id))
    assert (again.phys_offset, again.queue_offset) == (last.phys_offset, last.queue_offset)
