"""State records (:mod:`apogee_broker.replication.state`) turned back into files: the newest
snapshot of each kind wins, a log cut below what was applied is read again, and POP journal
records and recalls are applied in order (twice, after a crash, to the same state)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apogee.common.topics import STATE_TOPIC, TopicConfig
from apogee.store import Message, MessageStore, StoreConfig
from apogee_broker.core.consume.offsets import ConsumerOffsets, read_offsets
from apogee_broker.core.pop.journal import FRAME, KIND_CURSOR, KIND_DONE, KIND_POP, Entry, encode
from apogee_broker.core.pop.table import PopTable
from apogee_broker.core.schedule.recalls import Recalls
from apogee_broker.core.topics import TopicManager
from apogee_broker.replication.state import (
    FILES,
    OFFSET_COMMITS,
    OFFSETS,
    POP,
    POP_WHOLE,
    PROP_STATE_KIND,
    RECALL,
    TOPIC_CHANGES,
    StateApplier,
    _change_records,
    _whole_records,
    split_records,
)

pytestmark = pytest.mark.unit


def record(kind: str, content: dict[str, object]) -> Message:
    return Message(STATE_TOPIC, json.dumps(content).encode(), properties={PROP_STATE_KIND: kind})


def test_the_newest_snapshot_of_each_kind_becomes_its_file(tmp_path: Path) -> None:
    with MessageStore.open(
        tmp_path / "store", StoreConfig(commitlog_file_size=1 << 20, max_message_size=64 << 10)
    ) as s:
        for kind in FILES:
            s.append([record(kind, {"n": 1}), record(kind, {"n": 2})])
        s.append(record("something-newer", {"n": 9}))  # a kind this version does not know
        assert s.wait_dispatched()
        applier = StateApplier(s, tmp_path)
        assert applier.behind()
        assert applier.catch_up() == len(FILES)
        for name in FILES.values():
            content = json.loads((tmp_path / name).read_text())
            content.pop("seq", None)  # the offsets' snapshot numbers its journal's start
            assert content == {"n": 2}
        assert not applier.behind()
        assert applier.catch_up() == 0
        # the files remember how far they go: a new applier (a restart) reads nothing again
        assert StateApplier(s, tmp_path).catch_up() == 0


def test_a_log_cut_below_what_was_applied_is_read_again(tmp_path: Path) -> None:
    with MessageStore.open(
        tmp_path / "store", StoreConfig(commitlog_file_size=1 << 20, max_message_size=64 << 10)
    ) as s:
        (kept,) = s.append(record("topics", {"topics": "kept"}))
        s.append(record("topics", {"topics": "cut"}))
        assert s.wait_dispatched()
        applier = StateApplier(s, tmp_path)
        applier.catch_up()
        assert json.loads((tmp_path / "topics.json").read_text()) == {"topics": "cut", "seq": 1}
        s.truncate(kept.phys_offset + kept.size)  # a follower cuts what its leader never had
        assert applier.catch_up() == 1
        # read again from the start: a whole snapshot, which starts the journal anew
        assert json.loads((tmp_path / "topics.json").read_text()) == {"topics": "kept", "seq": 2}


def pop_record(kind: str, entries: list[Entry]) -> Message:
    body = b"".join(encode(e) for e in entries)
    return Message(STATE_TOPIC, body, properties={PROP_STATE_KIND: kind})


def pop_state(directory: Path) -> dict[tuple[str, str, int], tuple[int, list[int]]]:
    """(group, topic, queue) -> (cursor, offsets in flight) as a broker would load them."""
    table = PopTable(directory)
    table.load()
    try:
        groups_and_topics = table.keys()
        return {
            (g, t, q): (qp.cursor, sorted(qp.inflight))
            for g, t in groups_and_topics
            for q, qp in (table.queues(g, t) or {}).items()
        }
    finally:
        table.close()


def handed(offset: int) -> Entry:
    return Entry(KIND_POP, "g", "T", 0, offset, 100 * offset, 10, 1, 60_000, offset)


def test_pop_journal_records_and_recalls_are_applied_in_order(tmp_path: Path) -> None:
    with MessageStore.open(
        tmp_path / "store", StoreConfig(commitlog_file_size=1 << 20, max_message_size=64 << 10)
    ) as s:
        s.append(pop_record(POP_WHOLE, [Entry(KIND_CURSOR, "g", "T", 0, 5), handed(3)]))
        s.append(pop_record(POP, [handed(5), Entry(KIND_CURSOR, "g", "T", 0, 6)]))
        s.append(pop_record(POP, [Entry(KIND_DONE, "g", "T", 0, 3)]))
        s.append(
            Message(
                STATE_TOPIC, b"99999999999999 recalled-1\n", properties={PROP_STATE_KIND: RECALL}
            )
        )
        assert s.wait_dispatched()
        applier = StateApplier(s, tmp_path)
        assert applier.catch_up() == 2
        expected = {("g", "T", 0): (6, [5])}
        assert pop_state(tmp_path / "pop") == expected
        recalls = Recalls(tmp_path)
        assert recalls.load() == 1
        assert "recalled-1" in recalls
        # a crash before state.applied was written: the same records are applied again
        (tmp_path / "state.applied").unlink()
        assert StateApplier(s, tmp_path).catch_up() == 2
        assert pop_state(tmp_path / "pop") == expected
        assert Recalls(tmp_path).load() == 1
        # a whole state replaces the journal: what a former leader wrote alone goes
        s.append(pop_record(POP_WHOLE, [Entry(KIND_CURSOR, "g", "T", 0, 7)]))
        assert s.wait_dispatched()
        assert applier.catch_up() == 1
        assert pop_state(tmp_path / "pop") == {("g", "T", 0): (7, [])}


def test_pop_records_are_cut_at_whole_journal_records() -> None:
    blob = b"".join(encode(handed(i)) for i in range(100))
    parts = split_records(blob, 1000)
    assert b"".join(parts) == blob
    assert len(parts) > 1
    assert all(len(p) <= 1000 for p in parts)
    for part in parts:  # each part is whole records: its frames end where it ends
        pos = 0
        while pos < len(part):
            (length, _) = FRAME.unpack_from(part, pos)
            pos += FRAME.size + length
        assert pos == len(part)
    assert split_records(b"", 1000) == []


def offsets_record(kind: str, content: dict[str, object]) -> Message:
    return Message(STATE_TOPIC, json.dumps(content).encode(), properties={PROP_STATE_KIND: kind})


def test_offset_commits_apply_on_top_of_the_newest_snapshot(tmp_path: Path) -> None:
    with MessageStore.open(
        tmp_path / "store", StoreConfig(commitlog_file_size=1 << 20, max_message_size=64 << 10)
    ) as s:
        # commits with no snapshot yet go on the file as it is (none: an empty table)
        s.append(offsets_record(OFFSET_COMMITS, {"T@g": {"0": 3}}))
        assert s.wait_dispatched()
        applier = StateApplier(s, tmp_path)
        assert applier.catch_up() == 1
        assert read_offsets(tmp_path) == {"version": 1, "offsets": {"T@g": {"0": 3}}}
        snapshot = {"version": 1, "offsets": {"T@g": {"0": 5, "1": 7}, "U@h": {"0": 1}}}
        s.append(offsets_record("offsets", snapshot))
        s.append(offsets_record(OFFSET_COMMITS, {"T@g": {"1": 9}, "V@g": {"2": 4}}))
        assert s.wait_dispatched()
        assert applier.catch_up() == 1
        assert (read_offsets(tmp_path) or {})["offsets"] == {
            "T@g": {"0": 5, "1": 9},
            "U@h": {"0": 1},
            "V@g": {"2": 4},
        }
        # a newer snapshot is the state again
        s.append(offsets_record("offsets", {"version": 1, "offsets": {"T@g": {"0": 6}}}))
        assert s.wait_dispatched()
        assert applier.catch_up() == 1
        assert (read_offsets(tmp_path) or {})["offsets"] == {"T@g": {"0": 6}}


def test_a_follower_appends_commits_to_its_journal_and_a_leader_loads_them(
    tmp_path: Path,
) -> None:
    """Regression: each catch-up read the follower's whole offsets file and wrote it again,
    a cost that grew with every group there is (a megabyte at 10,000 groups), for a commit
    or two. Commits after a snapshot now go to the journal as one record per catch-up; the
    snapshot is written only when one arrives (or the journal outgrows it)."""
    groups = {f"T@g{i:05d}": {str(q): 100 + q for q in range(8)} for i in range(2_000)}
    with MessageStore.open(
        tmp_path / "store", StoreConfig(commitlog_file_size=4 << 20, max_message_size=1 << 20)
    ) as s:
        s.append(offsets_record("offsets", {"version": 1, "offsets": groups}))
        assert s.wait_dispatched()
        applier = StateApplier(s, tmp_path)
        assert applier.catch_up() == 1
        snapshot_file = tmp_path / "consumerOffset.json"
        before = snapshot_file.stat()
        assert before.st_size > 100_000
        for n in range(5):
            s.append(offsets_record(OFFSET_COMMITS, {"T@g00007": {"3": 200 + n}}))
            assert s.wait_dispatched()
            assert applier.catch_up() == 1
        after = snapshot_file.stat()
        assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
        assert (tmp_path / "consumerOffset.journal").stat().st_size < 5 * 200
        # what a new leader of the group loads from these files
        topics = TopicManager(tmp_path / "topics")
        topics.load()
        topics.put(TopicConfig("T", 8, 8))
        offsets = ConsumerOffsets(tmp_path, s, topics)
        assert offsets.load() == 2_000 * 8
        assert offsets.committed("g00007", "T", 3) == 204
        assert offsets.committed("g01999", "T", 7) == 107


def test_a_follower_appends_topic_changes_to_its_journal_and_a_leader_loads_them(
    tmp_path: Path,
) -> None:
    """Regression: the leader shipped the whole topic table at every change, and each
    follower wrote it whole again: with 50,000 topics, megabytes for one topic created. A
    change now travels alone, and a follower appends it to ``topics.journal``."""
    entry = {"read_queues": 8, "write_queues": 8, "perm": 6, "message_type": "NORMAL"}
    table = {"version": 1, "topics": {f"T{i:05d}": entry for i in range(3_000)}}
    with MessageStore.open(
        tmp_path / "store", StoreConfig(commitlog_file_size=4 << 20, max_message_size=1 << 20)
    ) as s:
        s.append(record("topics", table))
        assert s.wait_dispatched()
        applier = StateApplier(s, tmp_path)
        assert applier.catch_up() == 1
        before = (tmp_path / "topics.json").stat()
        assert before.st_size > 100_000
        s.append(record(TOPIC_CHANGES, {"New": {**entry, "read_queues": 4}, "T00007": None}))
        s.append(record(TOPIC_CHANGES, {"New": {**entry, "read_queues": 2}}))
        assert s.wait_dispatched()
        assert applier.catch_up() == 1
        after = (tmp_path / "topics.json").stat()
        assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
        assert (tmp_path / "topics.journal").stat().st_size < 300
        topics = TopicManager(tmp_path)
        assert topics.load() == 3_000
        new = topics.get("New")
        assert new is not None
        assert new.read_queues == 2
        assert topics.get("T00007") is None
        # a whole table replaces the files (and starts the journal anew)
        s.append(record("topics", {"version": 1, "topics": {"Only": entry}}))
        assert s.wait_dispatched()
        assert applier.catch_up() == 1
        assert not (tmp_path / "topics.journal").exists()
        again = TopicManager(tmp_path)
        assert again.load() == 1


def test_a_table_larger_than_a_record_travels_in_parts_and_is_whole_again(tmp_path: Path) -> None:
    """Regression: the offsets (or the topic table) went as one record, whole, and a broker
    refuses a message larger than max_message_size: past it the state was never replicated, and
    the leader tried again at every persistence. A larger table now goes as a snapshot of its
    first part and changes holding the rest."""
    offsets = {f"T@g{i:04d}": {str(q): 100 * i + q for q in range(8)} for i in range(300)}
    snapshot = {"version": 1, "offsets": offsets}
    parts = _whole_records(OFFSETS, OFFSET_COMMITS, snapshot, "offsets", 4_000)
    assert len(parts) > 5
    assert all(len(body) <= 4_000 for _, body in parts)
    assert [kind for kind, _ in parts] == [OFFSETS] + [OFFSET_COMMITS] * (len(parts) - 1)
    entry = {"read_queues": 8, "write_queues": 8, "perm": 6, "message_type": "NORMAL"}
    table = {"version": 1, "topics": {f"T{i:04d}": entry for i in range(300)}}
    topic_parts = _whole_records("topics", TOPIC_CHANGES, table, "topics", 4_000)
    assert len(topic_parts) > 5
    changes = _change_records(TOPIC_CHANGES, {f"N{i}": entry for i in range(100)}, 4_000)
    assert len(changes) > 1
    with MessageStore.open(
        tmp_path / "store", StoreConfig(commitlog_file_size=1 << 20, max_message_size=8_000)
    ) as s:
        s.append([record(kind, json.loads(body)) for kind, body in parts + topic_parts + changes])
        assert s.wait_dispatched()
        StateApplier(s, tmp_path).catch_up()
    assert read_offsets(tmp_path) == snapshot
    topics = TopicManager(tmp_path)
    assert topics.load() == 400
