"""ConsumerOffsets on a real store: commit rules, persistence (periodic, at stop, survives a
restart), damaged files, resets; and QueueLocks: exclusive, renewed, expiring, released."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from apogee.common.clock import ManualClock
from apogee.common.errors import (
    InvalidArgumentError,
    InvalidQueueIdError,
    PermissionDeniedError,
    UnknownTopicError,
)
from apogee.store import Message, MessageStore, StoreConfig
from apogee.testkit.store import dispatched
from apogee.testkit.waiting import eventually
from apogee_broker.core.consume.locks import QueueLocks
from apogee_broker.core.consume.offsets import (
    ConsumerOffsets,
    QueueOffsets,
    ResetTo,
    read_offsets,
)
from apogee_broker.core.topics import TopicConfig, TopicManager

pytestmark = pytest.mark.unit

CONFIG = StoreConfig(commitlog_file_size=1 << 20, max_message_size=64 * 1024)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(tmp_path: Path, clock: ManualClock) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "store", CONFIG, clock=clock, start_retention=False) as s:
        yield s


@pytest.fixture
def topics(tmp_path: Path) -> TopicManager:
    tm = TopicManager(tmp_path, broker_name="b1")
    tm.load()
    tm.put(TopicConfig("T", 4, 4))
    tm.put(TopicConfig("WriteOnly", 2, 2, perm=2))
    return tm


@pytest.fixture
def offsets(tmp_path: Path, store: MessageStore, topics: TopicManager) -> ConsumerOffsets:
    o = ConsumerOffsets(tmp_path, store, topics, persist_interval_s=0.05)
    o.load()
    return o


def fill(store: MessageStore, clock: ManualClock, queue_id: int, n: int) -> None:
    for i in range(n):
        store.append(Message("T", f"m{i}".encode(), queue_id=queue_id))
        clock.advance(1)
    dispatched(store)


def test_commit_rules(offsets: ConsumerOffsets, store: MessageStore, clock: ManualClock) -> None:
    fill(store, clock, 0, 5)
    offsets.commit("g", "T", 0, 3)
    offsets.commit("g", "T", 0, 5)  # the max offset itself: everything consumed
    assert offsets.committed("g", "T", 0) == 5
    with pytest.raises(InvalidArgumentError, match=r"^offset: must not be negative, got -1$"):
        offsets.commit("g", "T", 0, -1)
    with pytest.raises(
        InvalidArgumentError, match=r"^offset: 6 is beyond the max offset 5 of queue T/0$"
    ):
        offsets.commit("g", "T", 0, 6)
    with pytest.raises(InvalidQueueIdError, match=r"^queue_id 4: must be between 0 and 3"):
        offsets.commit("g", "T", 4, 0)
    with pytest.raises(UnknownTopicError):
        offsets.commit("g", "Nope", 0, 0)
    with pytest.raises(InvalidArgumentError, match=r"^group: 'a@b' has a character outside"):
        offsets.commit("a@b", "T", 0, 0)
    # all or nothing, and the bad one named by its index
    with pytest.raises(InvalidArgumentError, match=r"^offsets\[1\]: 9 is beyond"):
        offsets.commit_many("g", [("T", 0, 1), ("T", 0, 9)])
    assert offsets.committed("g", "T", 0) == 5
    assert offsets.query("g", "T", []) == [
        QueueOffsets(0, 5, 0, 5),
        QueueOffsets(1, -1, 0, 0),
        QueueOffsets(2, -1, 0, 0),
        QueueOffsets(3, -1, 0, 0),
    ]
    assert offsets.query("g", "T", [0]) == [QueueOffsets(0, 5, 0, 5)]
    assert offsets.groups() == {"g"}


async def test_persisted_periodically_at_stop_and_read_back(
    tmp_path: Path,
    offsets: ConsumerOffsets,
    store: MessageStore,
    topics: TopicManager,
    clock: ManualClock,
) -> None:
    fill(store, clock, 1, 3)
    path = tmp_path / "consumerOffset.json"
    offsets.start()
    try:
        offsets.commit("g1", "T", 1, 2)
        # the background loop writes it within a few intervals
        await eventually(path.exists, 2, f"{path.name} written")
        assert read_offsets(tmp_path) == {"version": 1, "offsets": {"T@g1": {"1": 2}}}
        offsets.commit("g2", "T", 1, 3)
    finally:
        await offsets.stop()  # writes what changed since
    content = read_offsets(tmp_path)
    assert content is not None
    assert content["offsets"] == {"T@g1": {"1": 2}, "T@g2": {"1": 3}}
    again = ConsumerOffsets(tmp_path, store, topics)
    assert again.load() == 2
    assert (again.committed("g1", "T", 1), again.committed("g2", "T", 1)) == (2, 3)
    assert not await again.persist()  # nothing changed: nothing written


async def test_a_damaged_file_falls_back_to_its_backup(
    tmp_path: Path,
    offsets: ConsumerOffsets,
    store: MessageStore,
    topics: TopicManager,
    clock: ManualClock,
) -> None:
    fill(store, clock, 0, 3)
    path = tmp_path / "consumerOffset.json"
    # an earlier version's file: the first persistence writes a snapshot, this one the backup
    path.write_text(json.dumps({"version": 1, "offsets": {"T@g": {"0": 1}}}))
    offsets.load()
    offsets.commit("g", "T", 0, 2)
    await offsets.persist()
    offsets.commit("g", "T", 0, 3)
    await offsets.persist()
    path.write_text('{"version": 1, "offs')  # torn
    again = ConsumerOffsets(tmp_path, store, topics)
    again.load()
    assert again.committed("g", "T", 0) == 1  # the backup's
    path.write_text('{"version": 7}')  # parses, but is not an offsets file
    again = ConsumerOffsets(tmp_path, store, topics)
    again.load()
    assert again.committed("g", "T", 0) == 1


async def test_both_files_damaged_start_empty_and_are_kept(
    tmp_path: Path, store: MessageStore, topics: TopicManager, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "consumerOffset.json"
    path.write_text("{")
    (tmp_path / "consumerOffset.json.bak").write_text("[")
    o = ConsumerOffsets(tmp_path, store, topics)
    with caplog.at_level(logging.ERROR):
        assert o.load() == 0
    assert "unreadable" in caplog.text
    assert (tmp_path / "consumerOffset.json.damaged").read_text() == "{"
    assert (tmp_path / "consumerOffset.json.bak.damaged").read_text() == "["
    assert await o.persist()  # a good file replaces the damaged one
    assert read_offsets(tmp_path) == {"version": 1, "offsets": {}}


def test_bad_entries_are_skipped_the_rest_kept(
    tmp_path: Path, store: MessageStore, topics: TopicManager
) -> None:
    (tmp_path / "consumerOffset.json").write_text(
        json.dumps(
            {
                "version": 1,
                "offsets": {
                    "T@good": {"0": 4, "1": 2},
                    "nogroup": {"0": 1},
                    "T@neg": {"0": -3},
                    "bad topic@g": {"0": 1},
                },
            }
        )
    )
    o = ConsumerOffsets(tmp_path, store, topics)
    assert o.load() == 2
    assert o.group_offsets("good") == {("T", 0): 4, ("T", 1): 2}
    assert o.groups() == {"good"}


async def test_resets(offsets: ConsumerOffsets, store: MessageStore, clock: ManualClock) -> None:
    start = clock.time_ms()
    fill(store, clock, 0, 10)  # stored at start, start + 1 s, ...
    fill(store, clock, 2, 4)
    assert await offsets.reset("g", "T", ResetTo.LATEST) == [(0, 10), (1, 0), (2, 4), (3, 0)]
    assert await offsets.reset("g", "T", ResetTo.EARLIEST) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    at = await offsets.reset("g", "T", ResetTo.TIMESTAMP, start + 3_500)
    assert at == [(0, 4), (1, 0), (2, 0), (3, 0)]
    assert offsets.committed("g", "T", 0) == 4
    with pytest.raises(InvalidArgumentError, match="timestamp_ms: must not be negative"):
        await offsets.reset("g", "T", ResetTo.TIMESTAMP, -1)
    with pytest.raises(UnknownTopicError):
        await offsets.reset("g", "Nope", ResetTo.EARLIEST)


# -- locks ----------------------------------------------------------------------------------------


@pytest.fixture
def locks(topics: TopicManager, clock: ManualClock) -> QueueLocks:
    return QueueLocks(topics, expiry_ms=60_000, clock=clock)


def test_locks_are_exclusive_renewed_and_expire(locks: QueueLocks, clock: ManualClock) -> None:
    assert locks.lock("g", "c1", [("T", 0), ("T", 1)]) == [("T", 0), ("T", 1)]
    assert locks.lock("g", "c2", [("T", 1), ("T", 2)]) == [("T", 2)]
    assert locks.lock("other", "c2", [("T", 1)]) == [("T", 1)]  # groups are separate
    assert locks.holder("g", "T", 1) == "c1"
    clock.advance(50)
    assert locks.lock("g", "c1", [("T", 0)]) == [("T", 0)]  # renewed
    clock.advance(10)  # T/1 and T/2 not renewed for 60 s: free; T/0 renewed 10 s ago
    assert locks.holder("g", "T", 1) is None
    assert locks.holder("g", "T", 0) == "c1"
    assert locks.lock("g", "c2", [("T", 0), ("T", 1)]) == [("T", 1)]
    assert locks.held_by("g", "c2") == [("T", 1)]


def test_unlock_and_drop(locks: QueueLocks) -> None:
    locks.lock("g", "c1", [("T", 0), ("T", 1), ("T", 2)])
    locks.unlock("g", "c2", [("T", 0)])  # not its lock: nothing happens
    assert locks.holder("g", "T", 0) == "c1"
    locks.unlock("g", "c1", [("T", 0)])
    assert locks.holder("g", "T", 0) is None
    assert locks.drop_client("g", "c1") == 2
    assert locks.held_by("g", "c1") == []
    assert locks.lock("g", "c2", [("T", 1)]) == [("T", 1)]


def test_lock_requests_are_checked(locks: QueueLocks) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^client_id: must not be empty$"):
        locks.lock("g", "", [("T", 0)])
    with pytest.raises(InvalidArgumentError, match=r"^group: must not be empty$"):
        locks.lock("", "c", [("T", 0)])
    with pytest.raises(InvalidQueueIdError, match="must be between 0 and 3"):
        locks.lock("g", "c", [("T", 0), ("T", 7)])
    assert locks.holder("g", "T", 0) is None  # nothing of a refused request is locked
    with pytest.raises(PermissionDeniedError, match="'WriteOnly': is not readable on broker b1"):
        locks.lock("g", "c", [("WriteOnly", 0)])
    with pytest.raises(UnknownTopicError):
        locks.unlock("g", "c", [("Nope", 0)])
