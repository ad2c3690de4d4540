"""The checks every consumer request shares: group names, client ids, readable topics and queues.

Each raises the registry's error naming the field and the rule:

==================  =================  =========================================================
check               error kind         example sentence
==================  =================  =========================================================
group name          INVALID_ARGUMENT   group: 'a b' has a character outside [%|a-zA-Z0-9_-]
client id           INVALID_ARGUMENT   client_id: must not be empty
topic name          INVALID_TOPIC      topic 'a b': has a character outside [%|a-zA-Z0-9_-]
topic known         UNKNOWN_TOPIC      topic 'Orders' does not exist on broker broker-a
topic readable      PERMISSION_DENIED  topic 'Orders': is not readable on broker broker-a (...)
queue id            INVALID_QUEUE_ID   queue_id 9: must be between 0 and 7: topic 'Orders' ...
==================  =================  =========================================================

Group names follow the rule of topic names (:mod:`apogee.common.topics`): RocketMQ's, so that
``%RETRY%<group>`` and ``%DLQ%<group>`` are topic names too. Retry and dead-letter topics are
ordinary readable topics here: nothing below refuses them.
"""

from __future__ import annotations

from typing import Final

from apogee.common.errors import (
    InvalidArgumentError,
    InvalidQueueIdError,
    InvalidTopicError,
    PermissionDeniedError,
)
from apogee.common.topics import MAX_TOPIC_LENGTH, RETRY_PREFIX, validate_topic
from apogee_broker.core.topics import TopicConfig, TopicManager, perm_text

#: Longest client id accepted.
MAX_CLIENT_ID: Final = 255


#: Longest group name: its retry and dead-letter topics (``%RETRY%<group>``) must be valid topics.
MAX_GROUP_LENGTH: Final = MAX_TOPIC_LENGTH - len(RETRY_PREFIX)


def validate_group(name: str, field: str = "group") -> str:
    """``name`` if it is a valid consumer group name: the topic name rule, at most
    :data:`MAX_GROUP_LENGTH` characters."""
    if not name:
        raise InvalidArgumentError(field=field, rule="must not be empty")
    try:
        validate_topic(name, MAX_GROUP_LENGTH)
    except InvalidTopicError as err:
        raise InvalidArgumentError(field=field, rule=f"{name!r} {err.details['rule']}") from None
    return name


def validate_client_id(client_id: str, field: str = "client_id") -> str:
    """``client_id`` if it is non-empty, printable and at most :data:`MAX_CLIENT_ID` long."""
    if not client_id:
        raise InvalidArgumentError(field=field, rule="must not be empty")
    if len(client_id) > MAX_CLIENT_ID:
        raise InvalidArgumentError(
            field=field, rule=f"is {len(client_id)} characters; at most {MAX_CLIENT_ID}"
        )
    if not client_id.isprintable():
        raise InvalidArgumentError(
            field=field, rule=f"{client_id!r} has a control character; use printable text"
        )
    return client_id


def readable_topic(topics: TopicManager, name: str) -> TopicConfig:
    """The topic, known on this broker and readable."""
    topic = topics.require(name)
    if not topic.readable:
        raise PermissionDeniedError(
            what=f"topic {name!r}",
            rule=f"is not readable on broker {topics.broker_name} (perm {perm_text(topic.perm)}"
            ", read permission R is missing)",
        )
    return topic


def check_read_queue(topics: TopicManager, topic: TopicConfig, queue_id: int) -> None:
    """``queue_id`` is one of the topic's read queues."""
    if not 0 <= queue_id < topic.read_queues:
        raise InvalidQueueIdError(
            value=queue_id,
            rule=f"must be between 0 and {topic.read_queues - 1}: topic {topic.name!r} has "
            f"{topic.read_queues} read queues on broker {topics.broker_name}",
        )
