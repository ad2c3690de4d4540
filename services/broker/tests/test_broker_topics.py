"""TopicManager: topics.json survives a reopen, system topics are the broker's own, and bad input
is refused with a sentence naming the field and the rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from apogee.common.errors import (
    CorruptRecordError,
    InvalidArgumentError,
    InvalidTopicError,
    PermissionDeniedError,
    UnknownTopicError,
)
from apogee.common.topics import ALL_PERMS, READ_WRITE, Perm, TopicConfig
from apogee_broker.core.topics import TopicManager

pytestmark = pytest.mark.unit

SYSTEM = {
    "TBW102",
    "SCHEDULE_TOPIC_XXXX",
    "RMQ_SYS_TRANS_HALF_TOPIC",
    "RMQ_SYS_TRANS_OP_HALF_TOPIC",
    "TRANS_CHECK_MAX_TIME_TOPIC",
}


def manager(data_dir: Path, **kwargs: Any) -> TopicManager:
    tm = TopicManager(data_dir, broker_name="broker-t", **kwargs)
    tm.load()
    return tm


def test_a_new_broker_holds_only_the_system_topics(tmp_path: Path) -> None:
    tm = manager(tmp_path, default_topic_queues=4)
    assert {t.name for t in tm.list_topics()} == SYSTEM
    assert tm.list_topics(include_system=False) == []
    assert tm.get("TBW102") == TopicConfig("TBW102", 4, 4, ALL_PERMS, True)
    assert tm.get("SCHEDULE_TOPIC_XXXX") == TopicConfig(
        "SCHEDULE_TOPIC_XXXX", 32 + 1440, 32 + 1440, READ_WRITE, True
    )
    for name in ("RMQ_SYS_TRANS_HALF_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC"):
        topic = tm.get(name)
        assert topic is not None
        assert (topic.read_queues, topic.write_queues, topic.system) == (1, 1, True)


def test_topics_survive_a_reopen(tmp_path: Path) -> None:
    tm = manager(tmp_path)
    assert tm.put(TopicConfig("Orders", 4, 4)) == (TopicConfig("Orders", 4, 4), True)
    tm.put(TopicConfig("Audit", 2, 1, Perm.READ))
    tm.put(TopicConfig("%RETRY%billing", 1, 1))
    tm.put(TopicConfig("Gone", 1, 1))
    tm.delete("Gone")
    assert (tmp_path / "topics.json").exists()

    again = manager(tmp_path)
    assert again.list_topics(include_system=False) == [
        TopicConfig("%RETRY%billing", 1, 1),
        TopicConfig("Audit", 2, 1, Perm.READ),
        TopicConfig("Orders", 4, 4),
    ]
    assert again.get("Gone") is None
    assert {t.name for t in again.list_topics() if t.system} == SYSTEM


def test_put_updates_and_says_whether_it_created(tmp_path: Path) -> None:
    tm = manager(tmp_path)
    assert tm.put(TopicConfig("Orders", 4, 4))[1] is True
    assert tm.put(TopicConfig("Orders", 4, 4))[1] is False
    updated, created = tm.put(TopicConfig("Orders", 8, 6, Perm.READ))
    assert not created
    assert updated == TopicConfig("Orders", 8, 6, Perm.READ)
    assert manager(tmp_path).get("Orders") == updated


def test_listeners_hear_every_change_but_not_a_put_of_the_same_config(tmp_path: Path) -> None:
    tm = manager(tmp_path)
    changes: list[tuple[str, int]] = []
    tm.add_listener(lambda name: changes.append((name, len(tm))))
    tm.put(TopicConfig("Orders", 4, 4))
    tm.put(TopicConfig("Orders", 4, 4))
    tm.put(TopicConfig("Orders", 2, 2))
    tm.delete("Orders")
    assert changes == [("Orders", 6), ("Orders", 6), ("Orders", 5)]


@pytest.mark.parametrize("name", sorted(SYSTEM))
def test_system_topics_cannot_be_changed_or_deleted(tmp_path: Path, name: str) -> None:
    tm = manager(tmp_path)
    before = tm.get(name)
    with pytest.raises(PermissionDeniedError) as put:
        tm.put(TopicConfig(name, 2, 2))
    assert str(put.value) == f"topic {name!r}: is a system topic; it cannot be changed"
    with pytest.raises(PermissionDeniedError) as delete:
        tm.delete(name)
    assert str(delete.value) == f"topic {name!r}: is a system topic; it cannot be deleted"
    assert tm.get(name) == before


def test_system_topics_in_the_file_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "topics.json").write_text(
        json.dumps(
            {
                "version": 1,
                "topics": {
                    "TBW102": {"read_queues": 1, "write_queues": 1, "perm": 0},
                    "Orders": {"read_queues": 3, "write_queues": 3, "perm": 6},
                },
            }
        )
    )
    tm = manager(tmp_path, default_topic_queues=8)
    assert tm.get("TBW102") == TopicConfig("TBW102", 8, 8, ALL_PERMS, True)
    assert tm.get("Orders") == TopicConfig("Orders", 3, 3)


def test_retry_and_dead_letter_topics_are_ordinary(tmp_path: Path) -> None:
    tm = manager(tmp_path)
    tm.put(TopicConfig("%RETRY%g1", 1, 1))
    tm.put(TopicConfig("%DLQ%g1", 1, 1, Perm.READ))
    assert tm.get("%DLQ%g1") == TopicConfig("%DLQ%g1", 1, 1, Perm.READ, False)
    tm.delete("%RETRY%g1")
    assert tm.get("%RETRY%g1") is None


@pytest.mark.parametrize(
    ("topic", "error", "message"),
    [
        (
            TopicConfig("a b", 1, 1),
            InvalidTopicError,
            "topic 'a b': has a character outside [%|a-zA-Z0-9_-]",
        ),
        (TopicConfig("", 1, 1), InvalidTopicError, "topic '': must not be empty"),
        (
            TopicConfig("x" * 128, 1, 1),
            InvalidTopicError,
            f"topic {'x' * 128!r}: is 128 characters; at most 127 are allowed",
        ),
        (
            TopicConfig("Orders", 0, 1),
            InvalidArgumentError,
            "topic.read_queues: must be between 1 and 1024, got 0",
        ),
        (
            TopicConfig("Orders", 1, 1025),
            InvalidArgumentError,
            "topic.write_queues: must be between 1 and 1024, got 1025",
        ),
        (
            TopicConfig("Orders", 1, 1, 8),
            InvalidArgumentError,
            "topic.perm: must combine PERM_READ (4), PERM_WRITE (2) and PERM_INHERIT (1), got 8",
        ),
        (
            TopicConfig("Orders", 1, 1, READ_WRITE, True),
            InvalidArgumentError,
            "topic.system: only the broker's own topics are system topics; leave it false",
        ),
    ],
)
def test_bad_topics_are_refused_with_the_field_and_the_rule(
    tmp_path: Path, topic: TopicConfig, error: type[Exception], message: str
) -> None:
    tm = manager(tmp_path)
    with pytest.raises(error) as caught:
        tm.put(topic)
    assert str(caught.value) == message
    assert tm.list_topics(include_system=False) == []
    assert not (tmp_path / "topics.json").exists()


def test_the_queue_limit_follows_the_store(tmp_path: Path) -> None:
    tm = manager(tmp_path, max_queues=16)
    tm.put(TopicConfig("Orders", 16, 16))
    with pytest.raises(InvalidArgumentError, match="must be between 1 and 16, got 17"):
        tm.put(TopicConfig("Orders", 17, 1))


def test_deleting_an_unknown_topic_names_it_and_the_broker(tmp_path: Path) -> None:
    tm = manager(tmp_path)
    with pytest.raises(UnknownTopicError) as caught:
        tm.delete("Nope")
    assert str(caught.value) == "topic 'Nope' does not exist on broker broker-t"


def test_auto_create_copies_tbw102_without_the_inherit_bit(tmp_path: Path) -> None:
    tm = manager(tmp_path, default_topic_queues=3, auto_create=True)
    created = tm.get_or_create("Fresh")
    assert created == TopicConfig("Fresh", 3, 3, ALL_PERMS & ~Perm.INHERIT)
    assert tm.get_or_create("Fresh") is created
    assert manager(tmp_path).get("Fresh") == created


def test_without_auto_create_an_unknown_topic_is_refused(tmp_path: Path) -> None:
    tm = manager(tmp_path)
    with pytest.raises(UnknownTopicError) as caught:
        tm.get_or_create("Fresh")
    assert str(caught.value) == (
        "topic 'Fresh' does not exist on broker broker-t and auto_create_topics is off: "
        "create it first (PutTopic)"
    )
    assert tm.get("Fresh") is None


def test_a_damaged_file_falls_back_to_its_backup(tmp_path: Path) -> None:
    """An earlier version's file (no journal) holds Orders; the first change writes a snapshot
    of the new shape, which keeps the old file as topics.json.bak, and the next goes to the
    journal. A damaged snapshot falls back to the backup, without the journal (whose records
    follow the damaged snapshot, not the backup)."""
    (tmp_path / "topics.json").write_text(
        json.dumps(
            {"version": 1, "topics": {"Orders": {"read_queues": 4, "write_queues": 4, "perm": 6}}}
        )
    )
    tm = manager(tmp_path)
    tm.put(TopicConfig("Audit", 1, 1))  # the snapshot; topics.json.bak holds Orders alone
    tm.put(TopicConfig("Billing", 1, 1))  # the journal
    assert (tmp_path / "topics.journal").stat().st_size > 0
    (tmp_path / "topics.json").write_text("{torn")
    again = manager(tmp_path)
    assert [t.name for t in again.list_topics(include_system=False)] == ["Orders"]


def test_a_change_appends_only_its_topic_and_a_reload_applies_the_journal(
    tmp_path: Path,
) -> None:
    """Regression: every change rewrote topics.json whole (at 10,000 topics, 28 creations a
    second, nearly all of it JSON encoding). After the first change a change appends one record
    naming only its topic, and the snapshot is left as it is."""
    tm = manager(tmp_path)
    for i in range(2_000):
        tm.put(TopicConfig(f"T{i:04d}", 8, 8))
    snapshot = (tmp_path / "topics.json").stat()
    journal = tmp_path / "topics.journal"
    before = journal.stat().st_size if journal.exists() else 0
    tm.put(TopicConfig("Late", 2, 2))
    tm.delete("T0007")
    grew = journal.stat().st_size - before
    assert 0 < grew < 400, grew  # two small records, not the table
    after = (tmp_path / "topics.json").stat()
    assert (after.st_ino, after.st_mtime_ns) == (snapshot.st_ino, snapshot.st_mtime_ns)

    again = manager(tmp_path)
    names = {t.name for t in again.list_topics(include_system=False)}
    assert len(names) == 2_000
    assert "Late" in names
    assert "T0007" not in names
    late = again.get("Late")
    assert late is not None
    assert (late.read_queues, late.write_queues) == (2, 2)


def test_the_journal_is_folded_into_a_new_snapshot_once_it_outgrows_it(tmp_path: Path) -> None:
    tm = manager(tmp_path)
    tm.put(TopicConfig("First", 1, 1))  # a small snapshot: the journal's bound is 64 KiB
    for i in range(1_500):  # about 100 bytes a record: past the bound
        tm.put(TopicConfig(f"T{i:04d}", 8, 8))
    journal = tmp_path / "topics.journal"
    assert not journal.exists() or journal.stat().st_size <= 64 * 1024
    content = json.loads((tmp_path / "topics.json").read_text())
    assert content["seq"] > 1
    assert len(content["topics"]) > 1
    again = manager(tmp_path)
    assert len(again.list_topics(include_system=False)) == 1_501


def test_a_torn_journal_record_keeps_what_came_before_it(tmp_path: Path) -> None:
    tm = manager(tmp_path)
    tm.put(TopicConfig("Orders", 4, 4))  # the snapshot
    tm.put(TopicConfig("Audit", 1, 1))  # a record
    tm.put(TopicConfig("Billing", 1, 1))  # a record, then cut short by a crash
    journal = tmp_path / "topics.journal"
    journal.write_bytes(journal.read_bytes()[:-5])
    again = manager(tmp_path)
    assert [t.name for t in again.list_topics(include_system=False)] == ["Audit", "Orders"]
    again.put(TopicConfig("Cargo", 1, 1))  # writes a snapshot, not after the damage
    assert not journal.exists()
    assert [t.name for t in manager(tmp_path).list_topics(include_system=False)] == [
        "Audit",
        "Cargo",
        "Orders",
    ]


def test_a_file_with_bad_entries_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "topics.json").write_text(
        json.dumps({"version": 1, "topics": {"Orders": {"read_queues": 0, "write_queues": 1}}})
    )
    with pytest.raises(CorruptRecordError) as caught:
        manager(tmp_path)
    assert "topics.json" in str(caught.value)
    assert "topic 'Orders'" in str(caught.value)


def test_the_digest_names_the_table_in_any_process_and_follows_each_change(
    tmp_path: Path,
) -> None:
    a = manager(tmp_path / "a")
    b = manager(tmp_path / "b")
    assert a.digest == b.digest != 0  # the same table (the system topics alone)
    empty = a.digest
    a.put(TopicConfig("Orders", 4, 4))
    with_orders = a.digest
    assert with_orders != empty
    a.put(TopicConfig("Orders", 8, 8))
    assert a.digest not in (empty, with_orders)  # a queue count is part of it
    a.put(TopicConfig("Orders", 4, 4))
    assert a.digest == with_orders  # the same table again

    b.put(TopicConfig("Payments", 2, 2))
    b.put(TopicConfig("Orders", 4, 4))
    b.delete("Payments")
    assert b.digest == with_orders  # whatever the order of the changes
    assert manager(tmp_path / "b").digest == with_orders  # and after a restart
    a.delete("Orders")
    assert a.digest == empty
