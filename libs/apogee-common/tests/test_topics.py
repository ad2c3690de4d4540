"""Topic names: one validator for every component, and RocketMQ's reserved names."""

from __future__ import annotations

import pytest

from apogee.common.errors import InvalidTopicError
from apogee.common.topics import (
    MAX_TOPIC_LENGTH,
    SYSTEM_TOPICS,
    dlq_topic,
    is_dlq_topic,
    is_retry_topic,
    is_system_topic,
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


def test_system_topics_are_rocketmqs() -> None:
    assert sorted(SYSTEM_TOPICS) == [
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
