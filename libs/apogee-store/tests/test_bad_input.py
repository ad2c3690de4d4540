"""Bad input is refused with the documented error, whose message names the field and the rule, and
leaves nothing behind; bad settings, a locked directory and a corrupt record are reported."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from apogee.codec import HEADER_SIZE
from apogee.common.errors import (
    ApogeeError,
    CorruptRecordError,
    InvalidArgumentError,
    InvalidPropertyError,
    InvalidQueueIdError,
    InvalidTopicError,
    MessageTooLargeError,
    PropertiesTooLargeError,
    StoreConfigError,
    StoreLockedError,
)
from apogee.store import GetStatus, Message, MessageStore, StoreConfig
from apogee.testkit.store import OpenStore, dispatched

pytestmark = pytest.mark.unit


UID = "ID-0001"
UID_PROP = len(f"UNIQ_KEY\x01{UID}\x02")


#: (a bad message, the error it raises, its exact message)
BAD_MESSAGES: list[tuple[str, Message, type[ApogeeError], str]] = [
    (
        "body-too-large",
        Message(topic="T", body=b"x" * (16 * 1024 + 1)),
        MessageTooLargeError,
        "body is 16385 bytes: the maximum is 16384 bytes (max_message_size)",
    ),
    (
        "empty-topic",
        Message(topic="", body=b"x"),
        InvalidTopicError,
        "topic '': must not be empty",
    ),
    (
        "topic-with-space",
        Message(topic="my topic", body=b"x"),
        InvalidTopicError,
        "topic 'my topic': has a character outside [%|a-zA-Z0-9_-]",
    ),
    (
        "topic-with-slash",
        Message(topic="a/b", body=b"x"),
        InvalidTopicError,
        "topic 'a/b': has a character outside [%|a-zA-Z0-9_-]",
    ),
    (
        "topic-with-dot",
        Message(topic="a.b", body=b"x"),
        InvalidTopicError,
        "topic 'a.b': has a character outside [%|a-zA-Z0-9_-]",
    ),
    (
        "topic-not-ascii",
        Message(topic="caf\u00e9", body=b"x"),
        InvalidTopicError,
        "topic 'caf\u00e9': has a character outside [%|a-zA-Z0-9_-]",
    ),
    (
        "topic-too-long",
        Message(topic="t" * 128, body=b"x"),
        InvalidTopicError,
        f"topic '{'t' * 128}': is 128 characters; at most 127 are allowed",
    ),
    (
        "queue-id-negative",
        Message(topic="T", body=b"x", queue_id=-1),
        InvalidQueueIdError,
        "queue_id -1: must be between 0 and 1023 (max_queues_per_topic)",
    ),
    (
        "queue-id-too-big",
        Message(topic="T", body=b"x", queue_id=1024),
        InvalidQueueIdError,
        "queue_id 1024: must be between 0 and 1023 (max_queues_per_topic)",
    ),
    (
        "properties-too-large",
        Message(topic="T", body=b"x", unique_id=UID, properties={"big": "v" * 32_760}),
        PropertiesTooLargeError,
        f"properties are {UID_PROP + len('big') + 2 + 32_760} bytes: the maximum is 32767 bytes "
        "(max_properties_size), tags, keys and unique id included",
    ),
    (
        "property-name-with-x01",
        Message(topic="T", body=b"x", properties={"na\x01me": "v"}),
        InvalidPropertyError,
        r"property 'na\x01me': a property name must be non-empty, without \x01 or \x02",
    ),
    (
        "property-name-with-x02",
        Message(topic="T", body=b"x", properties={"na\x02me": "v"}),
        InvalidPropertyError,
        r"property 'na\x02me': a property name must be non-empty, without \x01 or \x02",
    ),
    (
        "property-name-empty",
        Message(topic="T", body=b"x", properties={"": "v"}),
        InvalidPropertyError,
        r"property '': a property name must be non-empty, without \x01 or \x02",
    ),
    (
        "property-value-with-x01",
        Message(topic="T", body=b"x", properties={"name": "a\x01b"}),
        InvalidPropertyError,
        r"property 'name': a value must not contain \x01 or \x02",
    ),
    (
        "property-value-with-x02",
        Message(topic="T", body=b"x", properties={"name": "a\x02b"}),
        InvalidPropertyError,
        r"property 'name': a value must not contain \x01 or \x02",
    ),
    (
        "tags-with-x02",
        Message(topic="T", body=b"x", tags="a\x02b"),
        InvalidPropertyError,
        r"property 'tags': a value must not contain \x01 or \x02",
    ),
    (
        "unique-id-with-x01",
        Message(topic="T", body=b"x", unique_id="id\x01"),
        InvalidArgumentError,
        "unique_id: must not contain spaces or control characters",
    ),
    (
        "key-with-space",
        Message(topic="T", body=b"x", keys=["good", "two words"]),
        InvalidPropertyError,
        "property 'keys': key 'two words' must be non-empty",
    ),
    (
        "key-empty",
        Message(topic="T", body=b"x", keys=[""]),
        InvalidPropertyError,
        "property 'keys': key '' must be non-empty",
    ),
    (
        "key-with-x01",
        Message(topic="T", body=b"x", keys=["a\x01b"]),
        InvalidPropertyError,
        "property 'keys': ",
    ),
    (
        "born-host-not-ip-port",
        Message(topic="T", body=b"x", born_host="not-a-host"),
        InvalidPropertyError,
        "property 'born_host': 'not-a-host' is not ip:port",
    ),
    (
        "born-host-port-out-of-range",
        Message(topic="T", body=b"x", born_host="10.1.2.3:70000"),
        InvalidPropertyError,
        "property 'born_host': '10.1.2.3:70000' is not ip:port",
    ),
    (
        "flag-beyond-int32",
        Message(topic="T", body=b"x", flag=2**40),
        InvalidArgumentError,
        f"flag: must be an integer from {-(2**31)} to {2**31 - 1}, got {2**40}",
    ),
    (
        "reconsume-times-negative",
        Message(topic="T", body=b"x", reconsume_times=-1),
        InvalidArgumentError,
        f"reconsume_times: must be an integer from 0 to {2**31 - 1}, got -1",
    ),
    (
        "born-timestamp-negative",
        Message(topic="T", body=b"x", born_timestamp=-5),
        InvalidArgumentError,
        f"born_timestamp: must be an integer from 0 to {2**63 - 1}, got -5",
    ),
    (
        "prepared-offset-beyond-int64",
        Message(topic="T", body=b"x", prepared_txn_offset=2**63),
        InvalidArgumentError,
        f"prepared_txn_offset: must be an integer from 0 to {2**63 - 1}, got {2**63}",
    ),
]


@pytest.mark.parametrize(
    ("bad", "error", "text"),
    [pytest.param(m, e, t, id=name) for name, m, e, t in BAD_MESSAGES],
)
def test_bad_message_is_refused(
    store: MessageStore, bad: Message, error: type[ApogeeError], text: str
) -> None:
    with pytest.raises(error) as caught:
        store.append(bad)
    assert str(caught.value).startswith(text)
    assert isinstance(caught.value, InvalidArgumentError)
    assert caught.value.code == "INVALID_ARGUMENT"
    assert not caught.value.retriable
    assert store.commitlog.max_offset == 0
    # nothing of it was kept: the next message is the first of the log and of its queue
    [nxt] = store.append(Message(topic="T", body=b"ok"))
    assert (nxt.phys_offset, nxt.queue_offset) == (0, 0)


@pytest.mark.parametrize(
    ("bad", "error", "text"),
    [pytest.param(m, e, t, id=name) for name, m, e, t in BAD_MESSAGES],
)
def test_a_bad_message_spoils_its_whole_batch(
    store: MessageStore, bad: Message, error: type[ApogeeError], text: str
) -> None:
    [before] = store.append(Message(topic="T", body=b"before"))
    dispatched(store)
    log_end = store.commitlog.max_offset
    offsets = store.queue_max_offsets()

    good = [Message(topic="T", body=f"good{i}".encode()) for i in range(5)]
    good += [Message(topic="Fresh", body=b"fresh", queue_id=3)]
    with pytest.raises(error, match=re.escape(text)):
        store.append([*good, bad, Message(topic="T", body=b"after the bad one")])

    dispatched(store)
    assert store.commitlog.max_offset == log_end
    assert store.queue_max_offsets() == offsets
    assert store.get("Fresh", 3, 0).status is GetStatus.NO_SUCH_QUEUE
    # the next append goes exactly where the refused batch would have gone
    [nxt] = store.append(Message(topic="T", body=b"next"))
    [fresh] = store.append(Message(topic="Fresh", body=b"fresh", queue_id=3))
    assert nxt.phys_offset == before.phys_offset + before.size
    assert (nxt.queue_offset, fresh.queue_offset) == (1, 0)
    dispatched(store)
    assert [m.body for m in store.get("T", 0, 0).messages] == [b"before", b"next"]
    assert [m.body for m in store.get("Fresh", 3, 0).messages] == [b"fresh"]


def test_limits_themselves_are_allowed(store: MessageStore) -> None:
    props_room = 32_767 - UID_PROP - len("big") - 2
    ok = [
        Message(topic="T", body=b"x" * 16 * 1024),
        Message(topic="t" * 127, body=b"x"),
        Message(topic="%RETRY%group|a-b_C9", body=b"x"),
        Message(topic="T", body=b"x", queue_id=1023),
        Message(topic="T", body=b"", unique_id=UID, properties={"big": "v" * props_room}),
        Message(topic="T", body=b"x", properties={"k": "spaces and = are fine"}),
        Message(topic="T", body=b"x", born_host="[::1]:65535"),
    ]
    results = store.append(ok)
    assert len(results) == len(ok)
    assert results[4].size == HEADER_SIZE + 1 + 32_767
    dispatched(store)
    assert store.get("T", 0, 0, max_count=10).messages[1].properties["big"] == "v" * props_room
    assert store.get("t" * 127, 0, 0).messages[0].body == b"x"
    assert store.get("T", 1023, 0).messages[0].body == b"x"


def test_reads_check_their_arguments(store: MessageStore) -> None:
    with pytest.raises(InvalidTopicError, match=re.escape("topic 'a b': has a character outside")):
        store.get("a b", 0, 0)
    with pytest.raises(InvalidQueueIdError, match=re.escape("queue_id 1024: must be between")):
        store.get("T", 1024, 0)
    with pytest.raises(InvalidQueueIdError, match=re.escape("queue_id -1: must be between")):
        store.offset_for_timestamp("T", -1, 0)
    with pytest.raises(InvalidArgumentError, match=re.escape("max_count: must be positive, got 0")):
        store.get("T", 0, 0, max_count=0)
    with pytest.raises(InvalidTopicError, match=re.escape("topic '': must not be empty")):
        store.by_key("", "k")


# -- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "text"),
    [
        ({"commitlog_file_size": 1000}, "commitlog_file_size: must be at least 4096, got 1000"),
        (
            {"consume_queue_entries_per_file": 8},
            "consume_queue_entries_per_file: must be at least 16, got 8",
        ),
        ({"index_slots": 0}, "index_slots: must be at least 1, got 0"),
        ({"index_entries_per_file": 15}, "index_entries_per_file: must be at least 16, got 15"),
        ({"max_message_size": 0}, "max_message_size: must be at least 1, got 0"),
        ({"max_queues_per_topic": 0}, "max_queues_per_topic: must be at least 1, got 0"),
        ({"dispatch_backlog_max": 0}, "dispatch_backlog_max: must be at least 1, got 0"),
        ({"files_deleted_per_round": 0}, "files_deleted_per_round: must be at least 1, got 0"),
        (
            {"recovery_verify_files_after_clean_stop": 0},
            "recovery_verify_files_after_clean_stop: must be at least 1, got 0",
        ),
        ({"max_topic_length": 0}, "max_topic_length: must be between 1 and 255"),
        ({"max_topic_length": 256}, "max_topic_length: must be between 1 and 255"),
        ({"max_properties_size": 65_536}, "max_properties_size: must be between 1 and 65535"),
        ({"flush_interval_s": 0}, "flush_interval_s/sync_flush_timeout_s: must be positive"),
        ({"sync_flush_timeout_s": -1}, "flush_interval_s/sync_flush_timeout_s: must be positive"),
        ({"disk_high_water_ratio": 0}, "disk_high_water_ratio: must be in (0, 1]"),
        ({"disk_high_water_ratio": 1.5}, "disk_high_water_ratio: must be in (0, 1]"),
        ({"retention_hours": 0}, "retention_hours: must be positive"),
        (
            {"consume_queue_open_files": -1},
            "consume_queue_open_files: must be at least 0, got -1",
        ),
        ({"consume_queue_idle_close_s": 0}, "consume_queue_idle_close_s: must be positive"),
        ({"consume_queue_idle_close_s": -5}, "consume_queue_idle_close_s: must be positive"),
        ({"retention_delete_hours": (3, 24)}, "retention_delete_hours: hours are 0 to 23"),
        ({"retention_delete_hours": (-1,)}, "retention_delete_hours: hours are 0 to 23"),
        (
            {"commitlog_file_size": 64 * 1024},  # the default 4 MiB message does not fit
            "commitlog_file_size: must hold the largest record (4227454 bytes with "
            "max_message_size 4194304); raise it or lower max_message_size",
        ),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, dict) else None,
)
def test_invalid_settings(settings: dict[str, Any], text: str) -> None:
    with pytest.raises(StoreConfigError) as caught:
        StoreConfig(**settings)
    assert str(caught.value) == text
    assert caught.value.code == "FAILED_PRECONDITION"


@pytest.mark.parametrize("wrong_size", [128 * 1024, 512 * 1024])
def test_file_size_must_match_the_files(
    open_store: OpenStore, config: StoreConfig, store_dir: Path, wrong_size: int
) -> None:
    store = open_store()
    store.append([Message(topic="T", body=bytes([i]) * 16 * 1024) for i in range(20)])
    assert store.commitlog.max_offset > config.commitlog_file_size  # two files
    store.close()
    with pytest.raises(StoreConfigError) as caught:
        open_store(dataclasses.replace(config, commitlog_file_size=wrong_size))
    assert str(caught.value) == (
        f"file size: {store_dir / 'commitlog' / '00000000000000000000'} has 262144 bytes but "
        f"this log uses {wrong_size}-byte files; open it with the size it was created with"
    )
    # refusing changed nothing, and did not keep the directory locked
    assert sorted(p.stat().st_size for p in (store_dir / "commitlog").iterdir()) == [
        256 * 1024,
        256 * 1024,
    ]
    store = open_store()
    dispatched(store)
    assert [m.body for m in store.get("T", 0, 0, max_count=100).messages] == [
        bytes([i]) * 16 * 1024 for i in range(20)
    ]


def test_a_directory_is_opened_once(open_store: OpenStore, store_dir: Path) -> None:
    first = open_store()
    with pytest.raises(StoreLockedError) as caught:
        open_store()
    assert str(caught.value) == (
        f"the store directory {store_dir} is in use by another process "
        f"(lock file {store_dir / 'lock'})"
    )
    assert caught.value.code == "FAILED_PRECONDITION"
    # the first store is untouched and the directory is free once it is closed
    first.append(Message(topic="T", body=b"still mine"))
    first.close()
    second = open_store()
    dispatched(second)
    assert [m.body for m in second.get("T", 0, 0).messages] == [b"still mine"]


# -- a corrupt record ---------------------------------------------------------------------------


def test_corrupt_record_is_reported_and_the_store_goes_on(
    open_store: OpenStore, config: StoreConfig, store_dir: Path
) -> None:
    cfg = dataclasses.replace(config, recovery_verify_files_after_clean_stop=1)
    store = open_store(cfg)
    a = store.append([Message(topic="A", body=f"a{i}".encode() * 50) for i in range(10)])
    b = store.append([Message(topic="B", body=bytes([i]) * 16 * 1024) for i in range(20)])
    assert b[-1].phys_offset >= cfg.commitlog_file_size  # B went on into a second file
    dispatched(store)
    store.close()

    victim = a[3]
    assert victim.phys_offset + victim.size < cfg.commitlog_file_size  # in the first file
    path = store_dir / "commitlog" / "00000000000000000000"
    with path.open("r+b") as f:
        f.seek(victim.phys_offset + HEADER_SIZE + 7)  # inside the body
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))

    store = open_store(cfg)
    assert store.recovery.clean_shutdown
    assert store.recovery.verify_from == cfg.commitlog_file_size  # the first file is not checked
    where = f"A/0 offset 3 (physical {victim.phys_offset})"
    with pytest.raises(CorruptRecordError) as caught:
        store.get("A", 0, 0)
    assert str(caught.value) == f"corrupt record in {where}: CRC mismatch"
    assert caught.value.code == "DATA_LOSS"
    with pytest.raises(CorruptRecordError, match="CRC mismatch"):
        store.message_at(victim.phys_offset)
    assert store.by_unique_id(victim.unique_id) is None

    # the records around it, other queues and new appends are fine
    assert [m.body for m in store.get("A", 0, 0, max_count=3).messages] == [
        f"a{i}".encode() * 50 for i in range(3)
    ]
    assert [m.queue_offset for m in store.get("A", 0, 4, max_count=100).messages] == list(
        range(4, 10)
    )
    assert len(store.get("B", 0, 0, max_count=100).messages) == 20
    [new] = store.append(Message(topic="A", body=b"new"))
    assert new.queue_offset == 10
    dispatched(store)
    assert store.get("A", 0, 10).messages[0].body == b"new"
