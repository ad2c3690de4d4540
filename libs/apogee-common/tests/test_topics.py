"""Topic names: one validator for every component, and RocketMQ's reserved names; the one topic
config and its permission bits."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from apogee.common.errors import InvalidArgumentError, InvalidTopicError
from apogee.common.topics import (
    ALL_PERMS,
    MAX_TOPIC_LENGTH,
    READ_WRITE,
    SYSTEM_TOPICS,
    MessageType,
    Perm,
    TopicConfig,
    dlq_topic,
    is_dlq_topic,
    is_retry_topic,
    is_system_topic,
    perm_text,
    retry_topic,
    validate_topic,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "name",
    ["Orders", "a", "TBW102", "%RETRY%group-1", "%DLQ%g_2", "a|b", "x" * MAX_TOPIC_LENGTH],
)
def test_valid_names_are_returned_unchanged(name: str) -> None:
    assert validate_topic(name) == name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "topic '': must not be empty"),
        ("a b", "topic 'a b': has a character outside [%|a-zA-Z0-9_-]"),
        ("orders.eu", "topic 'orders.eu': has a character outside [%|a-zA-Z0-9_-]"),
        ("topic\n", "topic 'topic\\n': has a character outside [%|a-zA-Z0-9_-]"),
        ("tópico", "topic 'tópico': has a character outside [%|a-zA-Z0-9_-]"),
        ("x" * 128, f"topic {'x' * 128!r}: is 128 characters; at most 127 are allowed"),
    ],
)
def test_invalid_names_name_the_topic_and_the_rule(name: str, message: str) -> None:
    with pytest.raises(InvalidTopicError) as caught:
        validate_topic(name)
    assert str(caught.value) == message
    assert caught.value.kind.name == "INVALID_TOPIC"
    assert caught.value.code == "INVALID_ARGUMENT"
    assert not caught.value.retriable


def test_a_shorter_limit_can_be_given() -> None:
    assert validate_topic("abcd", max_len=4) == "abcd"
    with pytest.raises(InvalidTopicError, match="is 5 characters; at most 4 are allowed"):
        validate_topic("abcde", max_len=4)


def test_system_topics_are_rocketmqs_and_the_replica_groups_state() -> None:
    assert sorted(SYSTEM_TOPICS) == [
        "APOGEE_SYS_STATE",
        "RMQ_SYS_TRANS_HALF_TOPIC",
        "RMQ_SYS_TRANS_OP_HALF_TOPIC",
        "SCHEDULE_TOPIC_XXXX",
        "TBW102",
        "TRANS_CHECK_MAX_TIME_TOPIC",
    ]
    for name in SYSTEM_TOPICS:
        assert is_system_topic(name)
        assert validate_topic(name) == name
    assert not is_system_topic("Orders")
    assert not is_system_topic("tbw102")


def test_retry_and_dead_letter_topics_are_per_group_and_not_system() -> None:
    assert retry_topic("billing") == "%RETRY%billing"
    assert dlq_topic("billing") == "%DLQ%billing"
    assert is_retry_topic(retry_topic("billing"))
    assert not is_retry_topic(dlq_topic("billing"))
    assert is_dlq_topic(dlq_topic("billing"))
    assert not is_dlq_topic("billing")
    assert not is_system_topic(retry_topic("billing"))
    assert validate_topic(retry_topic("billing")) == "%RETRY%billing"


def test_permission_bits_are_rocketmqs() -> None:
    assert (Perm.INHERIT, Perm.WRITE, Perm.READ) == (1, 2, 4)
    assert READ_WRITE == 6
    assert ALL_PERMS == 7
    assert [perm_text(p) for p in (READ_WRITE, Perm.READ, ALL_PERMS, Perm.NONE)] == [
        "RW-",
        "R--",
        "RWX",
        "---",
    ]


def test_a_topic_config_reads_and_writes_by_its_bits() -> None:
    orders = TopicConfig("Orders", 8, 4)
    assert orders.perm == READ_WRITE  # the default
    assert orders.readable
    assert orders.writable
    assert orders.queue_count == 8
    read_only = TopicConfig("Audit", 2, 2, Perm.READ)
    assert read_only.readable
    assert not read_only.writable
    assert TopicConfig("Audit", 2, 2, 4) == read_only  # plain ints compare equal to the bits


@dataclass
class Wire:
    """The fields of ``apogee.v1.TopicConfig`` (a uint32 perm)."""

    name: str
    read_queues: int
    write_queues: int = 0
    perm: int = 0
    system: bool = False
    message_type: str = ""


def test_from_the_wire_perm_is_a_perm_and_a_bad_value_is_kept_for_the_check() -> None:
    t = TopicConfig.from_pb(Wire("T", read_queues=2, write_queues=3, perm=6, system=True))
    assert t == TopicConfig("T", 2, 3, READ_WRITE, True)
    assert type(t.perm) is Perm
    bad = TopicConfig.from_pb(Wire("T", read_queues=1, perm=8))
    assert bad.perm == 8
    assert f"got {bad.perm}" == "got 8"  # as the broker's and the nameserver's checks say it


def test_message_type_from_the_wire_empty_is_mixed_and_an_unknown_one_is_named() -> None:
    assert TopicConfig.from_pb(Wire("T", 1, 1, 6)).message_type is MessageType.MIXED
    fifo = TopicConfig.from_pb(Wire("T", 1, 1, 6, message_type="fifo"))
    assert fifo.message_type is MessageType.FIFO
    with pytest.raises(InvalidArgumentError) as err:
        TopicConfig.from_pb(Wire("T", 1, 1, 6, message_type="ORDERED"))
    assert err.value.details["field"] == "topic.message_type"
    assert "NORMAL, FIFO, DELAY, TRANSACTION, MIXED" in str(err.value)
    assert "'ORDERED'" in str(err.value)


def test_a_mixed_topic_accepts_every_type_and_the_others_only_their_own() -> None:
    for kind in (MessageType.NORMAL, MessageType.FIFO, MessageType.DELAY, MessageType.TRANSACTION):
        assert MessageType.MIXED.accepts(kind)
        assert kind.accepts(kind)
    assert not MessageType.FIFO.accepts(MessageType.NORMAL)
    assert not MessageType.NORMAL.accepts(MessageType.TRANSACTION)
