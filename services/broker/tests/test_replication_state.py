"""State records (:mod:`apogee_broker.replication.state`) turned back into files: the newest
snapshot of each kind wins, a log cut below what was applied is read again, and POP journal
records and recalls are applied in order (twice, after a crash, to the same state)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apogee.common.topics import STATE_TOPIC
from apogee.store import Message, MessageStore, StoreConfig
from apogee_broker.core.pop.journal import FRAME, KIND_CURSOR, KIND_DONE, KIND_POP, Entry, encode
from apogee_broker.core.pop.table import PopTable
from apogee_broker.core.schedule.recalls import Recalls
from apogee_broker.replication.state import (
    FILES,
    OFFSET_COMMITS,
    POP,
    POP_WHOLE,
    PROP_STATE_KIND,
    RECALL,
    StateApplier,
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
            assert json.loads((tmp_path / name).read_text()) == {"n": 2}
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
        assert json.loads((tmp_path / "topics.json").read_text()) == {"topics": "cut"}
        s.truncate(kept.phys_offset + kept.size)  # a follower cuts what its leader never had
        assert applier.catch_up() == 1
        assert json.loads((tmp_path / "topics.json").read_text()) == {"topics": "kept"}


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
        offsets_file = tmp_path / "consumerOffset.json"
        assert json.loads(offsets_file.read_text()) == {"version": 1, "offsets": {"T@g": {"0": 3}}}
        snapshot = {"version": 1, "offsets": {"T@g": {"0": 5, "1": 7}, "U@h": {"0": 1}}}
        s.append(offsets_record("offsets", snapshot))
        s.append(offsets_record(OFFSET_COMMITS, {"T@g": {"1": 9}, "V@g": {"2": 4}}))
        assert s.wait_dispatched()
        assert applier.catch_up() == 1
        assert json.loads(offsets_file.read_text())["offsets"] == {
            "T@g": {"0": 5, "1": 9},
            "U@h": {"0": 1},
            "V@g": {"2": 4},
        }
        # a newer snapshot is the state again
        s.append(offsets_record("offsets", {"version": 1, "offsets": {"T@g": {"0": 6}}}))
        assert s.wait_dispatched()
        assert applier.catch_up() == 1
        assert json.loads(offsets_file.read_text())["offsets"] == {"T@g": {"0": 6}}
