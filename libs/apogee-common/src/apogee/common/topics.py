"""Topics: the one name validator, the names RocketMQ reserves, and a topic's config.

A topic name is 1 to :data:`MAX_TOPIC_LENGTH` characters from ``[%|a-zA-Z0-9_-]``. The broker's
store, the nameserver and the SDK all check names with :func:`validate_topic`, so a name is
refused with the same sentence wherever it first arrives.

Reserved names (RocketMQ's):

- :data:`SYSTEM_TOPICS` - topics the brokers create and own: ``TBW102`` (the template that
  auto-created topics copy), ``SCHEDULE_TOPIC_XXXX`` (one queue per delay level), the two
  transaction topics and ``TRANS_CHECK_MAX_TIME_TOPIC``; and Apogee's ``APOGEE_SYS_STATE``, where
  a replica group keeps its state. :func:`is_system_topic` says whether a name is one of them.
- ``%RETRY%<group>`` and ``%DLQ%<group>`` - one retry topic and one dead-letter topic per
  consumer group (:func:`retry_topic`, :func:`dlq_topic`). They are ordinary readable topics,
  so users can inspect and redrive them; they are not system topics.

A topic on one broker is a :class:`TopicConfig`: its read and write queue counts, its
permission bits (:class:`Perm`, RocketMQ's PermName) and the type of messages it accepts
(:class:`MessageType`, RocketMQ 5's ``message.type`` attribute). The broker, the nameserver and
the SDK share this one definition.

Message types: a NORMAL topic takes plain messages only; FIFO, messages with a message group
(its sends with one group go to one queue, and its consumers get them in order); DELAY, messages
with a delay level or a delivery time; TRANSACTION, transactional (half) messages. MIXED takes
every type, as RocketMQ 5 treats a topic whose type was never set: it is what a topic is when
created without a type, and what every topic made before types existed became.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final, Protocol

from apogee.common.errors import InvalidArgumentError, InvalidTopicError

TOPIC_RE: Final = re.compile(r"^[%|a-zA-Z0-9_-]+$")
MAX_TOPIC_LENGTH: Final = 127

AUTO_CREATE_TEMPLATE_TOPIC: Final = "TBW102"
SCHEDULE_TOPIC: Final = "SCHEDULE_TOPIC_XXXX"
TRANS_HALF_TOPIC: Final = "RMQ_SYS_TRANS_HALF_TOPIC"
TRANS_OP_HALF_TOPIC: Final = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
TRANS_CHECK_MAX_TIME_TOPIC: Final = "TRANS_CHECK_MAX_TIME_TOPIC"
#: A replica group's state (topic configs, consumer offsets) as records in its CommitLog, so it
#: travels to the followers with the messages (docs/replication.md). Never routed or readable.
STATE_TOPIC: Final = "APOGEE_SYS_STATE"

SYSTEM_TOPICS: Final = frozenset(
    {
        AUTO_CREATE_TEMPLATE_TOPIC,
        SCHEDULE_TOPIC,
        TRANS_HALF_TOPIC,
        TRANS_OP_HALF_TOPIC,
        TRANS_CHECK_MAX_TIME_TOPIC,
        STATE_TOPIC,
    }
)

RETRY_PREFIX: Final = "%RETRY%"
DLQ_PREFIX: Final = "%DLQ%"
#: The group whose dead-letter topic (``%DLQ%SYS_SCHEDULE``) keeps delayed and timer messages
#: that cannot be delivered when due (their topic was deleted meanwhile): listed and redriven as
#: any group's dead letters.
SCHEDULE_DEAD_GROUP: Final = "SYS_SCHEDULE"
SCHEDULE_DEAD_TOPIC: Final = DLQ_PREFIX + SCHEDULE_DEAD_GROUP
#: The reason a broker gives for a delayed or timer message it drops when due because its
#: producer recalled it (RecallMessage): the schedule service counts these apart.
SCHEDULE_RECALLED_REASON: Final = "its producer recalled it"


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


class Perm(enum.IntFlag):
    """Permission bits of a topic on a broker (RocketMQ's PermName)."""

    NONE = 0
    INHERIT = 1
    WRITE = 2
    READ = 4


#: What a topic gets unless told otherwise.
READ_WRITE: Final = Perm.READ | Perm.WRITE
#: Every bit: read, write, and inherit (the template ``TBW102``: topics created from it copy it).
ALL_PERMS: Final = Perm.READ | Perm.WRITE | Perm.INHERIT


def perm_text(perm: int) -> str:
    """``perm`` as RocketMQ prints it: ``RW-``, ``R--``, ``RWX`` (X: inherit)."""
    return (
        ("R" if perm & Perm.READ else "-")
        + ("W" if perm & Perm.WRITE else "-")
        + ("X" if perm & Perm.INHERIT else "-")
    )


class MessageType(enum.StrEnum):
    """The type of messages a topic accepts (RocketMQ 5's ``TopicMessageType``)."""

    NORMAL = "NORMAL"
    FIFO = "FIFO"
    DELAY = "DELAY"
    TRANSACTION = "TRANSACTION"
    MIXED = "MIXED"

    def accepts(self, kind: MessageType) -> bool:
        """Whether a topic of this type takes a message of type ``kind`` (never MIXED)."""
        return self is MessageType.MIXED or self is kind


#: The message types a topic may be given, as users write them.
MESSAGE_TYPE_NAMES: Final = tuple(t.value for t in MessageType)
_MESSAGE_TYPES: Final = {t.value: t for t in MessageType}


def parse_message_type(text: str, field: str = "message_type") -> MessageType:
    """``text`` (any case; empty: MIXED) as a :class:`MessageType`; anything else raises
    :class:`InvalidArgumentError` naming ``field`` and the types there are."""
    if not text:
        return MessageType.MIXED
    known = _MESSAGE_TYPES.get(text)  # (a table lookup: a broker loads 50,000 topics at start)
    if known is not None:
        return known
    try:
        return MessageType(text.upper())
    except ValueError:
        raise InvalidArgumentError(
            field=field, rule=f"must be one of {', '.join(MESSAGE_TYPE_NAMES)}, got {text!r}"
        ) from None


class TopicFields(Protocol):
    """The fields of a topic config on the wire (``apogee.v1.TopicConfig``)."""

    @property
    def name(self) -> str: ...
    @property
    def read_queues(self) -> int: ...
    @property
    def write_queues(self) -> int: ...
    @property
    def perm(self) -> int: ...
    @property
    def system(self) -> bool: ...
    @property
    def message_type(self) -> str: ...


@dataclass(frozen=True, slots=True)
class TopicConfig:
    """A topic on one broker. ``perm`` is a bit set of :class:`Perm`, kept as given: whoever
    takes a config in (a broker, a nameserver) checks it and names a value out of range."""

    name: str
    read_queues: int
    write_queues: int
    perm: int = READ_WRITE
    system: bool = False
    message_type: MessageType = MessageType.MIXED

    @classmethod
    def from_pb(cls, t: TopicFields) -> TopicConfig:
        """From the protocol's topic config, ``perm`` as a :class:`Perm` (an empty message
        type is MIXED; an unknown one raises :class:`InvalidArgumentError`)."""
        return cls(
            t.name,
            t.read_queues,
            t.write_queues,
            Perm(t.perm),
            t.system,
            parse_message_type(t.message_type, "topic.message_type"),
        )

    @property
    def readable(self) -> bool:
        return bool(self.perm & Perm.READ)

    @property
    def writable(self) -> bool:
        return bool(self.perm & Perm.WRITE)

    @property
    def queue_count(self) -> int:
        """Queues that may hold messages: the larger of the read and write counts."""
        return max(self.read_queues, self.write_queues)
