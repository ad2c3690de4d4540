"""Replica stores: a follower copies its leader's CommitLog bytes unchanged (``read_log`` on the
leader, ``append_replica`` on the follower) and builds its own queues and index from them; a
log cut back with ``truncate`` never shows its old tail again, not even after a crash mid-cut."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from apogee.codec import BLANK, BLANK_MAGIC, HEADER_SIZE
from apogee.common.errors import CorruptRecordError, InvalidArgumentError, OffsetDeletedError
from apogee.store import (
    AppendResult,
    FlushMode,
    Message,
    MessageStore,
    StoreConfig,
    StoredMessage,
    consistent_point,
)
from apogee.store.commitlog import parse_record
from apogee.store.records import default_tag_code
from apogee.testkit.processes import kill_child_when_stopped
from apogee.testkit.store import OpenStore, dispatched

pytestmark = pytest.mark.unit

KiB = 1024
FILE_SIZE = 64 * KiB
CONFIG = StoreConfig(
    commitlog_file_size=FILE_SIZE,
    max_message_size=8 * KiB,
    consume_queue_entries_per_file=16,
    index_slots=31,
    index_entries_per_file=128,
)
TOPICS = ("RepA", "RepB")
QUEUES = 3


def fill(store: MessageStore, count: int, first: int = 0, tag: str = "t") -> list[AppendResult]:
    """``count`` messages over two topics and three queues, bodies of 0.5 to 6 KiB (64 KiB files
    roll every dozen or so)."""
    out: list[AppendResult] = []
    for i in range(first, first + count):
        out += store.append(
            Message(
                topic=TOPICS[i % 2],
                queue_id=i % QUEUES,
                body=bytes([i % 251]) * (512 + (i * 1543) % (6 * KiB)),
                keys=[f"k{i}"],
                tags=f"{tag}{i % 2}",
            )
        )
    dispatched(store)
    return out


def replicate(leader: MessageStore, follower: MessageStore, max_bytes: int) -> list[bytes]:
    """Copy the leader's log to the follower; returns the chunks read."""
    chunks: list[bytes] = []
    while data := leader.read_log(follower.commitlog.end, max_bytes):
        end = follower.commitlog.end
        assert follower.append_replica(end, data) == follower.commitlog.end
        chunks.append(data)
    dispatched(follower)
    return chunks


def log_files(store: MessageStore) -> dict[str, bytes]:
    return {mf.path.name: bytes(mf.mm) for mf in store.commitlog.files.files}


def queue_contents(store: MessageStore) -> dict[tuple[str, int], list[StoredMessage]]:
    return {
        (t, q): store.get(t, q, 0, max_count=10_000).messages for t in TOPICS for q in range(QUEUES)
    }


def stored_ids(store: MessageStore) -> set[str]:
    """The unique ids of every message readable through the queues."""
    return {m.unique_id for msgs in queue_contents(store).values() for m in msgs}


def records_per_queue(store: MessageStore) -> dict[tuple[str, int], list[int]]:
    """The queue offsets of each queue's records, walking the whole log record by record."""
    data = store.read_log(store.commitlog.min_offset, 1 << 30)
    out: dict[tuple[str, int], list[int]] = {}
    at, phys = 0, store.commitlog.min_offset
    with memoryview(data) as mv:
        while at < len(data):
            room = FILE_SIZE - phys % FILE_SIZE
            size, result = parse_record(mv, at, phys, room, default_tag_code)
            if result is None:
                at, phys = at + BLANK.size, phys + room
                continue
            out.setdefault((result.topic, result.queue_id), []).append(result.queue_offset)
            at, phys = at + size, phys + size
    assert phys == store.commitlog.end
    return out


def assert_queues_match_log(store: MessageStore) -> None:
    """Each queue runs from 0 to its max offset, exactly over its records in the log."""
    per_queue = records_per_queue(store)
    for cq in store.cqs:
        key = (cq.topic, cq.queue_id)
        assert per_queue.get(key, []) == list(range(cq.max_offset)), key
        assert store.commitlog.queue_offsets.get(key, 0) == cq.max_offset
        for offset in range(cq.max_offset):
            entry = cq.entry(offset)
            assert entry is not None
            msg = store.message_at(entry[0])
            assert (msg.topic, msg.queue_id, msg.queue_offset) == (*key, offset)


@pytest.fixture(params=[FlushMode.ASYNC, FlushMode.SYNC], ids=["async", "sync"])
def cfg(request: pytest.FixtureRequest) -> StoreConfig:
    return dataclasses.replace(CONFIG, flush_mode=request.param)


@pytest.fixture
def leader(open_store: OpenStore, tmp_path: Path, cfg: StoreConfig) -> MessageStore:
    return open_store(cfg, root=tmp_path / "leader")


@pytest.fixture
def follower(open_store: OpenStore, tmp_path: Path, cfg: StoreConfig) -> MessageStore:
    return open_store(cfg, root=tmp_path / "follower")


# -- replication --------------------------------------------------------------------------------


@pytest.mark.parametrize("max_bytes", [1, 20 * KiB, 1 << 20], ids=["one-record", "20k", "1m"])
def test_follower_copy_is_byte_identical_and_reads_the_same(
    leader: MessageStore,
    follower: MessageStore,
    open_store: OpenStore,
    tmp_path: Path,
    cfg: StoreConfig,
    max_bytes: int,
) -> None:
    results = fill(leader, 60)
    assert len(leader.commitlog.files.files) >= 3  # the copy crosses file ends

    chunks = replicate(leader, follower, max_bytes)

    if max_bytes == 1:  # at least one record per read, even when larger than asked
        assert len(chunks) == len(results) + len(leader.commitlog.files.files) - 1
    assert follower.commitlog.end == leader.commitlog.end
    assert log_files(follower) == log_files(leader)
    assert queue_contents(follower) == queue_contents(leader)
    assert follower.queue_max_offsets() == leader.queue_max_offsets()
    for r in results[::7]:
        assert follower.by_unique_id(r.unique_id) == leader.by_unique_id(r.unique_id)
    if cfg.flush_mode is FlushMode.SYNC:  # append_replica returned once durable
        assert follower.commitlog.files.flushed_where == follower.commitlog.end
    assert follower.read_log(follower.commitlog.end, 1) == b""

    follower.close()
    again = open_store(cfg, root=tmp_path / "follower")
    assert again.recovery.last_valid_offset == leader.commitlog.end
    assert queue_contents(again) == queue_contents(leader)
    # the follower's own appends go on from the copied queue offsets
    [r] = again.append(Message(topic="RepA", queue_id=0, body=b"own"))
    assert r.phys_offset == leader.commitlog.end
    assert r.queue_offset == leader.max_offset("RepA", 0)


def test_a_read_crosses_a_file_end_after_its_blank_marker(
    leader: MessageStore, follower: MessageStore
) -> None:
    results = fill(leader, 30)
    first_of_2nd = next(r for r in results if r.phys_offset >= FILE_SIZE)
    before = results[results.index(first_of_2nd) - 1]
    replicate_to = before.phys_offset
    while follower.commitlog.end < replicate_to:  # copy up to the last record of file 1
        end = follower.commitlog.end
        follower.append_replica(end, leader.read_log(end, replicate_to - end))

    data = leader.read_log(before.phys_offset, before.size + BLANK.size + first_of_2nd.size)

    size, magic = BLANK.unpack_from(data, before.size)
    assert magic == BLANK_MAGIC
    assert size == FILE_SIZE - (before.phys_offset + before.size)
    assert len(data) == before.size + BLANK.size + first_of_2nd.size
    new_end = follower.append_replica(before.phys_offset, data)
    assert new_end == first_of_2nd.phys_offset + first_of_2nd.size
    dispatched(follower)
    assert follower.message_at(first_of_2nd.phys_offset) == leader.message_at(
        first_of_2nd.phys_offset
    )
    assert log_files(follower)[f"{0:020d}"] == log_files(leader)[f"{0:020d}"]


def test_data_ending_with_a_blank_marker_leaves_the_log_at_the_next_file(
    leader: MessageStore, follower: MessageStore
) -> None:
    results = fill(leader, 30)
    first_of_2nd = next(r for r in results if r.phys_offset >= FILE_SIZE)
    before = results[results.index(first_of_2nd) - 1]
    replicate(leader, follower, 1 << 20)
    follower.truncate(before.phys_offset)
    data = leader.read_log(before.phys_offset, before.size + BLANK.size)
    assert len(data) == before.size + BLANK.size

    assert follower.append_replica(before.phys_offset, data) == FILE_SIZE
    assert follower.commitlog.end == FILE_SIZE
    assert follower.read_log(FILE_SIZE, 1) == b""  # nothing in the next file yet
    rest = replicate(leader, follower, 1 << 20)
    assert rest
    assert log_files(follower) == log_files(leader)


def test_a_corrupted_byte_is_refused_and_nothing_is_written(
    leader: MessageStore, follower: MessageStore
) -> None:
    results = fill(leader, 8)
    data = bytearray(leader.read_log(0, 1 << 20))
    third = results[2]
    data[third.phys_offset + HEADER_SIZE + 5] ^= 0xFF  # in its body

    with pytest.raises(CorruptRecordError) as caught:
        follower.append_replica(0, bytes(data))

    assert str(caught.value) == (
        f"corrupt record in physical offset {third.phys_offset}: CRC mismatch"
    )
    assert follower.commitlog.end == 0
    assert all(bytes(mf.mm).count(0) == FILE_SIZE for mf in follower.commitlog.files.files)
    assert follower.queue_max_offsets() == {}
    # the good bytes still go in afterwards
    replicate(leader, follower, 1 << 20)
    assert log_files(follower) == log_files(leader)


@pytest.mark.parametrize("cut", [1, HEADER_SIZE + 3], ids=["in-the-size", "mid-body"])
def test_a_record_cut_short_is_refused(
    leader: MessageStore, follower: MessageStore, cut: int
) -> None:
    results = fill(leader, 3)
    data = leader.read_log(0, 1 << 20)
    last = results[-1]
    with pytest.raises(CorruptRecordError, match=f"physical offset {last.phys_offset}: "):
        follower.append_replica(0, data[: last.phys_offset + cut])
    assert follower.commitlog.end == 0


def test_wrong_phys_is_refused(leader: MessageStore, follower: MessageStore) -> None:
    results = fill(leader, 4)
    data = leader.read_log(0, 1 << 20)
    with pytest.raises(InvalidArgumentError) as caught:
        follower.append_replica(results[1].phys_offset, data[results[1].phys_offset :])
    assert str(caught.value) == (
        f"phys: must be the end of the log (0), got {results[1].phys_offset}"
    )
    # bytes of another place in the log, claimed for this one: their offsets do not match
    with pytest.raises(CorruptRecordError, match="corrupt record in physical offset 0: header"):
        follower.append_replica(0, data[results[1].phys_offset :])
    assert follower.commitlog.end == 0
    assert follower.append_replica(0, b"") == 0


def test_a_record_that_does_not_continue_its_queue_is_refused(
    leader: MessageStore, follower: MessageStore
) -> None:
    # both logs hold one record of the same size at 0, in different queues
    follower.append(Message(topic="RepA", queue_id=0, body=b"x" * 100))
    leader.append(Message(topic="RepA", queue_id=1, body=b"y" * 100))
    [r] = leader.append(Message(topic="RepA", queue_id=0, body=b"z" * 100))
    dispatched(leader)
    with pytest.raises(CorruptRecordError) as caught:
        follower.append_replica(r.phys_offset, leader.read_log(r.phys_offset, 1 << 20))
    assert str(caught.value) == (
        f"corrupt record in physical offset {r.phys_offset}: queue offset 0 of RepA/0 does not "
        "continue its queue here (its next offset is 1)"
    )
    assert follower.commitlog.end == r.phys_offset


def test_read_log_bounds(
    open_store: OpenStore, tmp_path: Path, leader: MessageStore, cfg: StoreConfig
) -> None:
    results = fill(leader, 5)
    with pytest.raises(InvalidArgumentError, match="phys: must be where a record starts"):
        leader.read_log(results[1].phys_offset + 4, 100)
    with pytest.raises(InvalidArgumentError, match="phys: must not be past the end"):
        leader.read_log(leader.commitlog.end + 1, 100)
    with pytest.raises(InvalidArgumentError, match="max_bytes: must be positive"):
        leader.read_log(0, 0)
    # one record when max_bytes is smaller; whole records only otherwise
    assert len(leader.read_log(results[1].phys_offset, 1)) == results[1].size
    assert len(leader.read_log(0, results[0].size + results[1].size - 1)) == results[0].size

    aged = open_store(cfg, root=tmp_path / "aged", disk_usage=lambda: 1.0)
    fill(aged, 30)
    assert aged.retention.run_once().commitlog_files > 0
    low = aged.commitlog.min_offset
    with pytest.raises(OffsetDeletedError):
        aged.read_log(0, 100)
    assert aged.read_log(low, 1)


# -- truncation ---------------------------------------------------------------------------------


def test_truncate_then_append_continues_and_the_old_tail_never_returns(
    open_store: OpenStore, tmp_path: Path, leader: MessageStore, cfg: StoreConfig
) -> None:
    results = fill(leader, 40)
    cut_at = results[12]
    kept = {r.unique_id for r in results[:12]}
    end = leader.commitlog.end
    files_before = len(leader.commitlog.files.files)

    assert leader.truncate(cut_at.phys_offset) == end - cut_at.phys_offset

    assert leader.commitlog.end == cut_at.phys_offset
    assert len(leader.commitlog.files.files) < files_before
    assert not (tmp_path / "leader" / "truncate").exists()
    assert_queues_match_log(leader)
    for r in results[12:]:
        assert leader.by_unique_id(r.unique_id) is None
    assert leader.by_key(cut_at.topic, "k12") == []
    new = fill(leader, 5, first=1000, tag="new")
    assert new[0].phys_offset == cut_at.phys_offset
    assert new[0].queue_offset == cut_at.queue_offset  # the cut record's queue slot is reused
    leader.close()

    again = open_store(cfg, root=tmp_path / "leader")
    assert again.recovery.last_valid_offset == new[-1].phys_offset + new[-1].size
    assert again.recovery.truncation_redone_to is None
    assert_queues_match_log(again)
    assert stored_ids(again) == kept | {r.unique_id for r in new}
    last = again.commitlog.files.last
    assert last is not None
    assert bytes(last.mm)[last.wrote :].count(0) == FILE_SIZE - last.wrote


def test_truncate_zeroes_stray_bytes_past_a_hole_in_the_file(
    open_store: OpenStore, tmp_path: Path, cfg: StoreConfig
) -> None:
    """Bytes past the log's end, beyond a stretch never written (a hole of a sparse file under
    async flush) and more than a megabyte of zeros, are zeroed by a cut too: they sit at the
    offsets they name and would read as records once appends reach them."""
    size = 4 << 20
    store = open_store(dataclasses.replace(cfg, commitlog_file_size=size), root=tmp_path / "big")
    results = fill(store, 3)
    mf = store.commitlog.files.last
    assert mf is not None
    cut = results[1].phys_offset
    stray = bytes(mf.mm[cut : cut + results[1].size])  # a copy of a whole record
    os.pwrite(mf.fd, stray, size - (1 << 20))

    store.truncate(cut)

    rest = bytes(mf.mm[cut:])
    assert rest.count(0) == len(rest)


def test_truncate_refuses_offsets_that_are_not_record_starts(leader: MessageStore) -> None:
    results = fill(leader, 5)
    end = leader.commitlog.end
    cases = [
        (
            results[2].phys_offset + 1,
            f"must be where a record starts; {results[2].phys_offset + 1}",
        ),
        (end + 1, f"must be within the log [0, {end}], got {end + 1}"),
        (-1, "must not be negative, got -1"),
    ]
    for offset, rule in cases:
        with pytest.raises(InvalidArgumentError) as caught:
            leader.truncate(offset)
        assert str(caught.value).startswith(f"offset: {rule}")
    assert leader.truncate(end) == 0
    assert leader.commitlog.end == end
    assert_queues_match_log(leader)
    fill(leader, 1, first=5)  # the store still works after the refusals


def test_truncate_to_a_file_start_and_to_a_blank_marker(leader: MessageStore) -> None:
    results = fill(leader, 30)
    first_of_2nd = next(r for r in results if r.phys_offset >= FILE_SIZE)
    before = results[results.index(first_of_2nd) - 1]
    blank_at = before.phys_offset + before.size

    leader.truncate(FILE_SIZE)  # the log keeps file 1 whole, its blank marker included
    assert leader.commitlog.end == FILE_SIZE
    assert_queues_match_log(leader)
    leader.truncate(blank_at)  # now file 1 ends before its marker: appends go on there
    assert leader.commitlog.end == blank_at
    assert [f.start for f in leader.commitlog.files.files] == [0]
    [r] = leader.append(Message(topic="RepB", queue_id=2, body=b"small"))
    assert r.phys_offset == blank_at
    dispatched(leader)
    assert_queues_match_log(leader)


def test_a_diverged_follower_cuts_back_to_the_consistent_point_and_catches_up(
    leader: MessageStore, follower: MessageStore
) -> None:
    fill(leader, 20)  # epoch 1, written by the leader
    replicate(leader, follower, 64 * KiB)
    point = leader.commitlog.end
    # the follower led epoch 2 for a moment and appended what the leader never saw
    fill(follower, 6, first=500, tag="lost")
    # epoch 3: the leader is back and appends more
    fill(leader, 15, first=20)
    leader_epochs = [(1, 0), (3, point)]
    follower_epochs = [(1, 0), (2, point)]

    agreed = consistent_point(
        leader_epochs, leader.commitlog.end, follower_epochs, follower.commitlog.end
    )
    assert agreed == point
    follower.truncate(agreed)
    replicate(leader, follower, 64 * KiB)

    assert log_files(follower) == log_files(leader)
    assert queue_contents(follower) == queue_contents(leader)
    assert_queues_match_log(follower)


# -- a crash in the middle of a truncation --------------------------------------------------------

CHILD = """
import json, os, sys, threading
import apogee.store.store as store_module
from apogee.store import MessageStore, StoreConfig, FlushMode

args = json.loads(sys.argv[1])
def hook(step):
    if step == args["stop_at"]:
        print("STOPPED " + step, flush=True)
        threading.Event().wait()  # killed here by the parent
store_module.TRUNCATE_HOOK = hook
cfg = StoreConfig(**{**args["config"], "flush_mode": FlushMode(args["flush_mode"])})
store = MessageStore.open(args["path"], cfg, start_retention=False)
print("OPEN", flush=True)
store.truncate(args["offset"])
print("FINISHED", flush=True)
"""


def run_child_until(path: Path, cfg: StoreConfig, offset: int, stop_at: str) -> None:
    """Run a truncation in a child process and kill it with SIGKILL where ``stop_at`` says."""
    config = {
        k: v
        for k, v in dataclasses.asdict(cfg).items()
        if k
        in (
            "commitlog_file_size",
            "max_message_size",
            "consume_queue_entries_per_file",
            "index_slots",
            "index_entries_per_file",
        )
    }
    args = {
        "path": str(path),
        "config": config,
        "flush_mode": cfg.flush_mode.value,
        "offset": offset,
        "stop_at": stop_at,
    }
    kill_child_when_stopped(CHILD, args, "the truncation step")


@pytest.mark.integration
@pytest.mark.parametrize("stop_at", ["marked", "log cut"])
def test_a_truncation_killed_midway_is_redone_at_open(
    open_store: OpenStore, tmp_path: Path, cfg: StoreConfig, stop_at: str
) -> None:
    root = tmp_path / "victim"
    store = open_store(cfg, root=root)
    results = fill(store, 40)
    cut_at = results[9]
    kept = {r.unique_id for r in results[:9]}
    store.close()

    run_child_until(root, cfg, cut_at.phys_offset, stop_at)
    assert (root / "truncate").exists()

    again = open_store(cfg, root=root)
    # the cut tail is gone for good: the log ends at the cut, the queues and index agree
    assert stored_ids(again) == kept
    for r in results[9:]:
        assert again.by_unique_id(r.unique_id) is None
    assert again.commitlog.end == cut_at.phys_offset
    assert_queues_match_log(again)
    report = again.recovery
    assert report.truncation_redone_to == cut_at.phys_offset
    assert f"redid an interrupted truncation to {cut_at.phys_offset}" in report.summary()
    assert not report.clean_shutdown
    assert report.last_valid_offset == cut_at.phys_offset
    assert not (root / "truncate").exists()

    new = fill(again, 3, first=900, tag="after")
    assert new[0].phys_offset == cut_at.phys_offset
    again.close()
    third = open_store(cfg, root=root)
    assert third.recovery.truncation_redone_to is None
    assert stored_ids(third) == kept | {r.unique_id for r in new}
    assert_queues_match_log(third)


def test_a_damaged_truncation_marker_stops_the_open(
    open_store: OpenStore, tmp_path: Path, cfg: StoreConfig
) -> None:
    root = tmp_path / "damaged"
    open_store(cfg, root=root).close()
    (root / "truncate").write_bytes(b"\x00" * 7)
    with pytest.raises(Exception, match="truncate: a truncation marker must be 20 bytes"):
        open_store(cfg, root=root)
