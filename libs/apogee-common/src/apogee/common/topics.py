"""Topic names: the one validator, and the names RocketMQ reserves.

A topic name is 1 to :data:`MAX_TOPIC_LENGTH` characters from ``[%|a-zA-Z0-9_-]``. The broker's
store, the nameserver and the SDK all check names with :func:`validate_topic`, so a name is
refused with the same sentence wherever it first arrives.

Reserved names (RocketMQ's):

- :data:`SYSTEM_TOPICS` - topics the brokers create and own: ``TBW102`` (the template that
  auto-created topics copy), ``SCHEDULE_TOPIC_XXXX`` (one queue per delay level), the two
  transaction topics and ``TRANS_CHECK_MAX_TIME_TOPIC``. :func:`is_system_topic` says whether a
  name is one of them.
- ``%RETRY%<group>`` and ``%DLQ%<group>`` - one retry topic and one dead-letter topic per
  consumer group (:func:`retry_topic`, :func:`dlq_topic`). They are ordinary readable topics,
  so users can inspect and redrive them; they are not system topics.
"""

from __future__ import annotations

import re
from typing import Final

from apogee.common.errors import InvalidTopicError

TOPIC_RE: Final = re.compile(r"^[%|a-zA-Z0-9_-]+$")
MAX_TOPIC_LENGTH: Final = 127

AUTO_CREATE_TEMPLATE_TOPIC: Final = "TBW102"
SCHEDULE_TOPIC: Final = "SCHEDULE_TOPIC_XXXX"
TRANS_HALF_TOPIC: Final = "RMQ_SYS_TRANS_HALF_TOPIC"
TRANS_OP_HALF_TOPIC: Final = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
TRANS_CHECK_MAX_TIME_TOPIC: Final = "TRANS_CHECK_MAX_TIME_TOPIC"

SYSTEM_TOPICS: Final = frozenset(
    {
        AUTO_CREATE_TEMPLATE_TOPIC,
        SCHEDULE_TOPIC,
        TRANS_HALF_TOPIC,
        TRANS_OP_HALF_TOPIC,
        TRANS_CHECK_MAX_TIME_TOPIC,
    }
)

RETRY_PREFIX: Final = "%RETRY%"
DLQ_PREFIX: Final = "%DLQ%"


def validate_topic(name: str, max_len: int = MAX_TOPIC_LENGTH) -> str:
    """Return ``name`` if it is a valid topic name, else raise :class:`InvalidTopicError`
    whose message names the topic and the rule it broke."""
    if not isinstance(name, str) or not name:
        raise InvalidTopicError(value=name, rule="must not be empty")
    if len(name) > max_len:
        raise InvalidTopicError(
            value=name, rule=f"is {len(name)} characters; at most {max_len} are allowed"
        )
    # fullmatch: with match, ``$`` would also accept a name ending in a newline
    if not TOPIC_RE.fullmatch(name):
        raise InvalidTopicError(value=name, rule="has a character outside [%|a-zA-Z0-9_-]")
    return name


def is_system_topic(name: str) -> bool:
    """Whether ``name`` is one of the topics the brokers own (:data:`SYSTEM_TOPICS`)."""
    return name in SYSTEM_TOPICS


def retry_topic(group: str) -> str:
    """The topic a consumer group's failed messages are sent back to."""
    return RETRY_PREFIX + group


def dlq_topic(group: str) -> str:
    """The dead-letter topic of a consumer group."""
    return DLQ_PREFIX + group


def is_retry_topic(name: str) -> bool:
    return name.startswith(RETRY_PREFIX)


def is_dlq_topic(name: str) -> bool:
    return name.startswith(DLQ_PREFIX)
