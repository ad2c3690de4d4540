"""State records (:mod:`apogee_broker.replication.state`) turned back into files: the newest
snapshot of each kind wins, and a log cut below what was applied is read again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apogee.common.topics import STATE_TOPIC
from apogee.store import Message, MessageStore, StoreConfig
from apogee_broker.replication.state import FILES, PROP_STATE_KIND, StateApplier

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
