"""Consumer offsets persisted as a snapshot and a journal of changes, on real files: a
persistence writes only what changed, reloads see the newest offsets, damaged records and a
crash in the middle of a compaction never move an offset backwards, compaction bounds the
journal, and a replica's state applier reads the journal too."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from apogee.common.clock import ManualClock
from apogee.common.topics import STATE_TOPIC
from apogee.store import Message, MessageStore, StoreConfig
from apogee.testkit.store import dispatched
from apogee_broker.core.consume.offsets import (
    JOURNAL_KEY,
    JOURNAL_WHAT,
    ConsumerOffsets,
    ResetTo,
    read_offsets,
)
from apogee_broker.core.journal import FRAME, Journal, compact_bound
from apogee_broker.core.topics import TopicConfig, TopicManager
from apogee_broker.replication.state import OFFSET_COMMITS, PROP_STATE_KIND, StateApplier

pytestmark = pytest.mark.unit


def oj(path: Path) -> Journal:
    """The offsets' journal at ``path`` (a file, or any path when only encoding)."""
    return Journal(path, JOURNAL_KEY, JOURNAL_WHAT)


CONFIG = StoreConfig(commitlog_file_size=1 << 20, max_message_size=64 * 1024)
QUEUES = 4


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    clock = ManualClock()
    with MessageStore.open(tmp_path / "store", CONFIG, clock=clock, start_retention=False) as s:
        for q in range(QUEUES):
            for i in range(50):
                s.append(Message("T", f"m{i}".encode(), queue_id=q))
        dispatched(s)
        yield s


@pytest.fixture
def topics(tmp_path: Path) -> TopicManager:
    tm = TopicManager(tmp_path, broker_name="b1")
    tm.load()
    tm.put(TopicConfig("T", QUEUES, QUEUES))
    return tm


def offsets_at(tmp_path: Path, store: MessageStore, topics: TopicManager) -> ConsumerOffsets:
    o = ConsumerOffsets(tmp_path, store, topics)
    o.load()
    return o


def everything(o: ConsumerOffsets) -> dict[str, dict[tuple[str, int], int]]:
    return {g: o.group_offsets(g) for g in o.groups()}


def size_of(path: Path) -> int:
    """The file's size, 0 when there is none."""
    return path.stat().st_size if path.exists() else 0


def contents(path: Path) -> bytes:
    """The file's bytes, none when there is no file."""
    return path.read_bytes() if path.exists() else b""


def cut(path: Path, n: int) -> None:
    """Remove the last ``n`` bytes of ``path``, as a crash in the middle of an append."""
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - n)


def identity(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


async def test_one_change_among_10000_groups_appends_only_that_entry(
    tmp_path: Path, store: MessageStore, topics: TopicManager
) -> None:
    o = offsets_at(tmp_path, store, topics)
    for i in range(10_000):
        o.commit_many(f"g{i}", [("T", q, 1) for q in range(QUEUES)])
    assert await o.persist()  # the first: a snapshot of everything
    snapshot = tmp_path / "consumerOffset.json"
    journal = tmp_path / "consumerOffset.journal"
    assert snapshot.stat().st_size > 100_000
    assert not journal.exists()
    before = identity(snapshot)

    o.commit("g5000", "T", 2, 7)
    assert await o.persist()
    assert identity(snapshot) == before  # not rewritten
    assert journal.stat().st_size < 1024
    records = oj(journal).read().records
    assert [r.changes for r in records] == [{"T@g5000": {"2": 7}}]
    assert not await o.persist()  # nothing changed since: nothing written
    assert journal.stat().st_size < 1024

    again = offsets_at(tmp_path, store, topics)
    assert again.committed("g5000", "T", 2) == 7
    assert again.committed("g4999", "T", 2) == 1
    assert len(again.groups()) == 10_000


async def test_a_reload_applies_every_journal_record_in_order(
    tmp_path: Path, store: MessageStore, topics: TopicManager
) -> None:
    o = offsets_at(tmp_path, store, topics)
    o.commit("a", "T", 0, 1)
    await o.persist()
    snapshot = identity(tmp_path / "consumerOffset.json")
    o.commit("a", "T", 0, 5)
    o.commit("b", "T", 1, 3)
    await o.persist()
    o.commit("a", "T", 0, 9)  # the same queue again: the newest wins
    await o.persist()
    await o.reset("c", "T", ResetTo.LATEST)
    await o.persist()
    assert identity(tmp_path / "consumerOffset.json") == snapshot
    assert len(oj(tmp_path / "consumerOffset.journal").read().records) == 3

    again = offsets_at(tmp_path, store, topics)
    assert everything(again) == everything(o)
    assert again.committed("a", "T", 0) == 9
    assert again.group_offsets("c") == {("T", q): 50 for q in range(QUEUES)}
    assert read_offsets(tmp_path) == {
        "version": 1,
        "offsets": {"T@a": {"0": 9}, "T@b": {"1": 3}, "T@c": {str(q): 50 for q in range(QUEUES)}},
    }


def test_a_removed_offset_in_the_journal_is_removed_at_load(
    tmp_path: Path, store: MessageStore, topics: TopicManager
) -> None:
    (tmp_path / "consumerOffset.json").write_text(
        json.dumps({"version": 1, "seq": 4, "offsets": {"T@a": {"0": 2, "1": 3}, "T@b": {"0": 1}}})
    )
    oj(tmp_path / "consumerOffset.journal").append(
        oj(tmp_path).encode(5, {"T@a": {"1": None}, "T@b": {"0": None}}),
    )
    o = offsets_at(tmp_path, store, topics)
    assert everything(o) == {"a": {("T", 0): 2}}
    assert read_offsets(tmp_path) == {"version": 1, "offsets": {"T@a": {"0": 2}}}


async def three_records(tmp_path: Path, store: MessageStore, topics: TopicManager) -> Path:
    """A snapshot (a at 1) and three journal records: a at 2, then b at 4, then a at 3."""
    o = offsets_at(tmp_path, store, topics)
    o.commit("a", "T", 0, 1)
    await o.persist()
    for group, offset in (("a", 2), ("b", 4), ("a", 3)):
        o.commit(group, "T", 0, offset)
        await o.persist()
    journal = tmp_path / "consumerOffset.journal"
    assert len(oj(journal).read().records) == 3
    assert everything(offsets_at(tmp_path, store, topics)) == {
        "a": {("T", 0): 3},
        "b": {("T", 0): 4},
    }
    return journal


async def test_a_torn_last_record_is_ignored_and_the_state_before_it_kept(
    tmp_path: Path, store: MessageStore, topics: TopicManager, caplog: pytest.LogCaptureFixture
) -> None:
    journal = await three_records(tmp_path, store, topics)
    size = journal.stat().st_size
    cut(journal, 3)
    last = size - len(oj(tmp_path).encode(4, {"T@a": {"0": 3}}))
    with caplog.at_level(logging.WARNING):
        o = offsets_at(tmp_path, store, topics)
    assert everything(o) == {"a": {("T", 0): 2}, "b": {("T", 0): 4}}
    assert f"{journal}: a record of" in caplog.text
    assert f"at byte offset {last}" in caplog.text

    # the next persistence does not append after the damage: it writes a snapshot anew
    o.commit("b", "T", 0, 5)
    assert await o.persist()
    assert not journal.exists()
    assert everything(offsets_at(tmp_path, store, topics)) == {
        "a": {("T", 0): 2},
        "b": {("T", 0): 5},
    }


async def test_a_damaged_record_in_the_middle_ends_the_replay_there(
    tmp_path: Path, store: MessageStore, topics: TopicManager, caplog: pytest.LogCaptureFixture
) -> None:
    journal = await three_records(tmp_path, store, topics)
    data = bytearray(journal.read_bytes())
    second = len(oj(tmp_path).encode(2, {"T@a": {"0": 2}}))
    data[second + FRAME.size + 2] ^= 0xFF  # in the second record's payload
    journal.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        o = offsets_at(tmp_path, store, topics)
    # the record before the damage is applied; nothing after it (the third record is whole)
    assert everything(o) == {"a": {("T", 0): 2}}
    assert f"{journal}: a record failing its CRC at byte offset {second}" in caplog.text


async def fill_until_compacted(
    o: ConsumerOffsets, journal: Path, snapshot: Path
) -> tuple[bytes, list[tuple[int, int]]]:
    """Move 500 groups forwards, one offset per persistence, until a persistence writes a
    snapshot anew; returns the journal as it was just before, and (journal, snapshot) sizes
    after each persistence."""
    sizes: list[tuple[int, int]] = []
    for offset in range(1, 40):
        for i in range(500):
            o.commit_many(f"g{i}", [("T", q, offset) for q in range(QUEUES)])
        before = contents(journal)
        assert await o.persist()
        sizes.append((size_of(journal), size_of(snapshot)))
        if before and not size_of(journal):
            return before, sizes
    pytest.fail("the journal was never compacted")


async def test_compaction_past_the_bound_reloads_the_same_state(
    tmp_path: Path, store: MessageStore, topics: TopicManager
) -> None:
    o = offsets_at(tmp_path, store, topics)
    journal = tmp_path / "consumerOffset.journal"
    snapshot = tmp_path / "consumerOffset.json"
    _, sizes = await fill_until_compacted(o, journal, snapshot)
    assert len(sizes) > 3  # some persistences appended before the compaction
    for journal_size, snapshot_size in sizes:
        assert journal_size <= compact_bound(snapshot_size)
    assert json.loads(snapshot.read_text())["seq"] == len(sizes)
    assert everything(offsets_at(tmp_path, store, topics)) == everything(o)
    # and appending goes on after it
    o.commit("g1", "T", 0, 45)
    assert await o.persist()
    assert len(oj(journal).read().records) == 1
    assert everything(offsets_at(tmp_path, store, topics)) == everything(o)


async def test_a_crash_before_the_journal_is_reset_moves_no_offset_backwards(
    tmp_path: Path, store: MessageStore, topics: TopicManager
) -> None:
    o = offsets_at(tmp_path, store, topics)
    journal = tmp_path / "consumerOffset.journal"
    snapshot = tmp_path / "consumerOffset.json"
    old, sizes = await fill_until_compacted(o, journal, snapshot)
    latest = len(sizes)
    # the crash: the new snapshot is in place, the journal before it not removed yet
    journal.write_bytes(old)
    stale = oj(journal).read().records
    assert stale
    assert stale[-1].changes["T@g0"]["0"] < latest  # older offsets, if replayed

    again = offsets_at(tmp_path, store, topics)
    assert everything(again) == everything(o)
    assert again.committed("g0", "T", 0) == latest
    # the next persistence writes a snapshot anew rather than appending after stale records
    again.commit("g0", "T", 0, latest + 1)
    assert await again.persist()
    assert not journal.exists()
    assert everything(offsets_at(tmp_path, store, topics)) == everything(again)


def state_record(kind: str, content: dict[str, object]) -> Message:
    return Message(STATE_TOPIC, json.dumps(content).encode(), properties={PROP_STATE_KIND: kind})


async def test_a_replicas_applier_reads_the_journal_and_a_snapshot_starts_it_anew(
    tmp_path: Path, store: MessageStore, topics: TopicManager
) -> None:
    await three_records(tmp_path, store, topics)  # a at 3, b at 4, partly in the journal
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for name in ("consumerOffset.json", "consumerOffset.journal"):
        shutil.copyfile(tmp_path / name, data_dir / name)
    applier = StateApplier(store, data_dir)
    # commits (of a term as leader that persisted no snapshot) go on the file and its journal
    store.append(state_record(OFFSET_COMMITS, {"T@c": {"0": 7}}))
    dispatched(store)
    assert applier.catch_up() == 1
    assert read_offsets(data_dir) == {
        "version": 1,
        "offsets": {"T@a": {"0": 3}, "T@b": {"0": 4}, "T@c": {"0": 7}},
    }
    # a snapshot of the group's state replaces it all, and the journal goes with it
    store.append(state_record("offsets", {"version": 1, "offsets": {"T@a": {"0": 1}}}))
    dispatched(store)
    assert applier.catch_up() == 1
    assert not (data_dir / "consumerOffset.journal").exists()
    o = offsets_at(data_dir, store, topics)
    assert everything(o) == {"a": {("T", 0): 1}}
    o.commit("b", "T", 0, 2)
    assert await o.persist()  # appended to a journal of the follower's snapshot
    assert (data_dir / "consumerOffset.journal").exists()
    assert everything(offsets_at(data_dir, store, topics)) == {
        "a": {("T", 0): 1},
        "b": {("T", 0): 2},
    }
