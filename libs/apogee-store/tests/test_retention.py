"""Retention: old CommitLog files go oldest first (never the last one), queue and index files that
only point into them follow, readers are told the earliest offset, and a full disk deletes files
whatever their age."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from apogee.common.clock import ManualClock
from apogee.common.errors import OffsetDeletedError
from apogee.store import AppendResult, GetStatus, Message, MessageStore, StoreConfig
from apogee.testkit.store import OpenStore, dispatched
from apogee.testkit.waiting import wait_until

pytestmark = pytest.mark.unit


FILE_SIZE = 256 * 1024
HOUR_S = 3600


def fill(store: MessageStore, files: int) -> list[AppendResult]:
    """Append 4 KiB messages (two keys each) to queue R/0 until the log has ``files`` files."""
    assert store.cfg.commitlog_file_size == FILE_SIZE
    results: list[AppendResult] = []
    i = 0
    while store.commitlog.max_offset <= (files - 1) * FILE_SIZE:
        results += store.append(
            Message(topic="R", body=bytes([i % 256]) * 4096, keys=[f"a{i}", f"b{i}"])
        )
        i += 1
    dispatched(store)
    return results


def log_files(store: MessageStore) -> list[str]:
    return sorted(p.name for p in (store.root / "commitlog").iterdir())


def names(*starts: int) -> list[str]:
    return [f"{s * FILE_SIZE:020d}" for s in starts]


def first_kept(results: list[AppendResult], log_min: int) -> AppendResult:
    return next(r for r in results if r.phys_offset >= log_min)


def test_old_files_go_oldest_first_never_the_last(
    open_store: OpenStore, config: StoreConfig, clock: ManualClock
) -> None:
    store = open_store(dataclasses.replace(config, files_deleted_per_round=2))
    results = fill(store, files=4)
    assert log_files(store) == names(0, 1, 2, 3)
    index_before = len(list((store.root / "index").iterdir()))
    assert index_before >= 2

    # nothing is old yet
    assert store.retention.run_once().commitlog_files == 0
    assert log_files(store) == names(0, 1, 2, 3)

    clock.advance(73 * HOUR_S)  # past the 72h retention
    first = store.retention.run_once()
    assert first.commitlog_files == 2  # files_deleted_per_round
    assert log_files(store) == names(2, 3)
    assert store.commitlog.min_offset == 2 * FILE_SIZE

    second = store.retention.run_once()
    assert second.commitlog_files == 1
    assert log_files(store) == names(3)  # the file being written stays

    third = store.retention.run_once()
    assert third.commitlog_files == 0
    assert log_files(store) == names(3)

    # queue and index files that only pointed into deleted files are gone too
    assert first.queue_files + second.queue_files >= 1
    assert first.index_files + second.index_files >= 1
    assert len(list((store.root / "index").iterdir())) < index_before

    # the queue now starts at the first message still in the log
    earliest = first_kept(results, 3 * FILE_SIZE)
    assert store.min_offset("R", 0) == earliest.queue_offset
    too_small = store.get("R", 0, 0)
    assert too_small.status is GetStatus.OFFSET_TOO_SMALL
    assert too_small.messages == []
    assert too_small.next_offset == earliest.queue_offset
    assert store.get("R", 0, earliest.queue_offset - 1).status is GetStatus.OFFSET_TOO_SMALL
    kept = store.get("R", 0, earliest.queue_offset, max_count=1000)
    assert kept.status is GetStatus.FOUND
    assert [m.phys_offset for m in kept.messages] == [
        r.phys_offset for r in results if r.phys_offset >= 3 * FILE_SIZE
    ]

    # reads of deleted records say where the log starts now
    with pytest.raises(OffsetDeletedError) as caught:
        store.message_at(results[0].phys_offset)
    assert str(caught.value) == (
        f"physical offset {results[0].phys_offset} was deleted by retention; "
        f"the earliest available is {3 * FILE_SIZE}"
    )
    assert caught.value.details["earliest"] == 3 * FILE_SIZE
    assert store.by_unique_id(results[0].unique_id) is None
    assert store.by_key("R", "a0") == []
    last = results[-1]
    assert [m.phys_offset for m in store.by_key("R", f"a{len(results) - 1}")] == [last.phys_offset]
    assert store.offset_for_timestamp("R", 0, 0) == earliest.queue_offset

    # appends carry on
    [new] = store.append(Message(topic="R", body=b"new"))
    assert new.queue_offset == len(results)


def test_retention_survives_reopen(
    open_store: OpenStore, config: StoreConfig, clock: ManualClock
) -> None:
    store = open_store()
    results = fill(store, files=3)
    clock.advance(100 * HOUR_S)
    assert store.retention.run_once().commitlog_files == 2
    earliest = first_kept(results, 2 * FILE_SIZE)
    store.close()

    store = open_store()
    assert log_files(store) == names(2)
    assert store.min_offset("R", 0) == earliest.queue_offset
    got = store.get("R", 0, 0)
    assert (got.status, got.next_offset) == (GetStatus.OFFSET_TOO_SMALL, earliest.queue_offset)
    assert store.get("R", 0, earliest.queue_offset).messages[0].phys_offset == (
        earliest.phys_offset
    )
    [new] = store.append(Message(topic="R", body=b"after"))
    assert new.queue_offset == len(results)


def test_age_comes_from_the_file_times(open_store: OpenStore, clock: ManualClock) -> None:
    store = open_store()
    fill(store, files=4)
    store.flush()  # nothing is written to the old files after this
    old = time.time() - 100 * HOUR_S
    for name in names(0, 1):
        os.utime(store.root / "commitlog" / name, (old, old))
    result = store.retention.run_once()
    assert result.commitlog_files == 2
    assert result.reason == "older than 72h"
    assert log_files(store) == names(2, 3)


def test_disk_above_high_water_deletes_whatever_the_age(open_store: OpenStore) -> None:
    usage = [0.10]
    store = open_store(disk_usage=lambda: usage[0])
    results = fill(store, files=4)
    assert store.retention.run_once().commitlog_files == 0  # young files, disk not full

    usage[0] = 0.99
    result = store.retention.run_once()
    assert result.commitlog_files == 3
    assert result.reason == "disk above 75%"
    assert log_files(store) == names(3)
    assert store.min_offset("R", 0) == first_kept(results, 3 * FILE_SIZE).queue_offset
    assert store.retention.run_once().commitlog_files == 0  # never the last file


def test_disk_above_high_water_given_at_open(open_store: OpenStore) -> None:
    store = open_store(disk_usage=lambda: 0.99)
    fill(store, files=2)
    assert store.retention.run_once().commitlog_files == 1
    assert log_files(store) == names(1)


def test_only_during_the_delete_hours(
    open_store: OpenStore, config: StoreConfig, clock: ManualClock
) -> None:
    clock.advance(73 * HOUR_S)  # files written from now on are past retention already
    hour = time.localtime(clock.time_ms() / 1000).tm_hour
    other_hours = tuple(h for h in range(24) if h != hour)
    store = open_store(dataclasses.replace(config, retention_delete_hours=other_hours))
    fill(store, files=3)
    # the files are older than 72h by the clock, but this hour is not a delete hour
    assert store.retention.run_once().commitlog_files == 0
    assert log_files(store) == names(0, 1, 2)
    clock.advance(HOUR_S)  # the next hour is a delete hour
    assert store.retention.run_once().commitlog_files == 2
    assert log_files(store) == names(2)


def test_retention_thread_runs_on_its_own(
    open_store: OpenStore, config: StoreConfig, clock: ManualClock, store_dir: Path
) -> None:
    store = open_store(
        dataclasses.replace(config, retention_check_interval_s=0.05),
        disk_usage=lambda: 0.99,
        start_retention=True,
    )
    fill(store, files=3)
    wait_until(
        lambda: log_files(store) == names(2),
        10,
        "the oldest file deleted",
        detail=lambda: str(log_files(store)),
    )
    store.close()
    assert sorted(p.name for p in (store_dir / "commitlog").iterdir()) == names(2)
