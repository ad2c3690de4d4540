"""The checks of a message a client sends, in one order, each with its own error.

Sends (:mod:`.service`), send records (:mod:`.record_intake`) and half messages
(:mod:`apogee_broker.core.txn.halves`) all check their messages here (and so does every other
protocol's send). A request's problems (no messages, too many:
:meth:`SendChecks.check_request_size`) fail the whole call. Each message is then checked on its
own, in this order, and a bad one gets its own error while the others are stored:

==============================  =====================  ==========================================
check                           error kind             example sentence
==============================  =====================  ==========================================
topic name                      INVALID_TOPIC          topic 'a b': has a character outside ...
body present                    INVALID_ARGUMENT       messages[2].body: must not be empty
body size                       MESSAGE_TOO_LARGE      messages[2].body is 5242880 bytes: ...
sys_flag: compressed bit only   INVALID_ARGUMENT       messages[2].sys_flag: only bit 0x1 ...
delay level in the table        INVALID_ARGUMENT       messages[0].delay_level 19: must be ...
one of delay and time           INVALID_ARGUMENT       messages[0]: delay_level and deliver_at_ms
time within timer_max_delay_s   INVALID_ARGUMENT       messages[0].deliver_at_ms: is 8.00 days ...
topic known (or auto-created)   UNKNOWN_TOPIC          topic 'Orders' does not exist on broker ...
not a system topic              PERMISSION_DENIED      topic 'TBW102': is a system topic; ...
topic writable                  PERMISSION_DENIED      topic 'Orders': is not writable on ...
queue id < write queues         INVALID_QUEUE_ID       queue_id 9: must be between 0 and 7 ...
topic accepts the message type  MESSAGE_TYPE_MISMATCH  topic 'Orders' accepts FIFO messages ...
a compressed body inflates      INVALID_ARGUMENT       messages[2].body: is flagged compressed ...
no broker-only property         INVALID_PROPERTY       property 'REAL_TOPIC': is set by brokers ...
property names printable        INVALID_PROPERTY       property 'a\\nb': a property name ...
unique id short and printable   INVALID_ARGUMENT       unique_id: is 129 characters; at most 128 ...
what the store checks           INVALID_PROPERTY,      properties are 40000 bytes: the maximum ...
                                PROPERTIES_TOO_LARGE
==============================  =====================  ==========================================

The first ten are :meth:`SendChecks.check`; the message type is :meth:`SendChecks.check_type`
(a message's type, :func:`message_kind`: TRANSACTION for a half message, DELAY for a delay level
or a delivery time, FIFO for a message group - the property ``__SHARDINGKEY`` - else NORMAL; a
MIXED topic accepts every type, the others their own only); the compressed body is
:meth:`SendChecks.check_compressed`; properties and unique id are :func:`check_client_properties`
and :func:`check_unique_id`; the store's own rules are checked as it writes
(:mod:`apogee_broker.core.storage.writer`).
"""

from __future__ import annotations

from collections.abc import Iterable

from apogee.codec import (
    PROP_SHARDING_KEY,
    SYSFLAG_COMPRESSED,
    control_character_rule,
    inflate_problem,
    reserved_property_rule,
    unique_id_rule,
)
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import (
    InvalidArgumentError,
    InvalidPropertyError,
    InvalidQueueIdError,
    MessageTooLargeError,
    MessageTypeMismatchError,
    PermissionDeniedError,
)
from apogee.common.topics import MessageType, validate_topic
from apogee.service.rights import require_topic
from apogee_broker.core.schedule.layout import ScheduleLayout
from apogee_broker.core.topics import TopicConfig, TopicManager, perm_text


class SendChecks:
    """The checks of one broker's limits and topics (see the module docstring)."""

    def __init__(
        self,
        topics: TopicManager,
        *,
        broker_name: str,
        max_message_size: int,
        max_messages_per_request: int,
        max_topic_length: int,
        layout: ScheduleLayout,
        timer_max_delay_ms: int,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.topics = topics
        self.broker_name = broker_name
        self.max_message_size = max_message_size
        self.max_messages_per_request = max_messages_per_request
        self.max_topic_length = max_topic_length
        self.layout = layout
        self.timer_max_delay_ms = timer_max_delay_ms
        self.clock = clock

    def check_request_size(self, count: int, field: str, what: str) -> None:
        """A request of ``count`` items (``what``) in ``field``: at least one, at most
        ``max_messages_per_request``."""
        if count == 0:
            raise InvalidArgumentError(field=field, rule="must not be empty")
        limit = self.max_messages_per_request
        if count > limit:
            raise InvalidArgumentError(
                field=field,
                rule=f"{count} {what} in one request; at most {limit} are allowed "
                "(max_messages_per_request)",
            )

    def check(
        self,
        i: int | str,
        topic_name: str,
        size: int,
        sys_flag: int,
        queue_id: int,
        delay: int = 0,
        at: int = 0,
    ) -> TopicConfig:
        """Every check of message ``i`` (its topic, body size, flags, queue, delay level and
        delivery time), in order; returns the topic the message may be written to. ``i`` is
        the message's index in ``messages``, or the field that holds it (``"message"``)."""
        msg = where(i)
        validate_topic(topic_name, self.max_topic_length)
        require_topic(topic_name, "PUB")  # the caller's right, when authentication is on
        if size == 0:
            raise InvalidArgumentError(field=f"{msg}.body", rule="must not be empty")
        if size > self.max_message_size:
            raise MessageTooLargeError(
                field=f"{msg}.body",
                size=size,
                rule=f"the maximum is {self.max_message_size} bytes (max_message_size)",
            )
        if sys_flag & ~SYSFLAG_COMPRESSED:
            raise InvalidArgumentError(
                field=f"{msg}.sys_flag",
                rule=f"only bit 0x1 (body compressed with zlib) may be set, got {sys_flag:#x}",
            )
        levels = self.layout.levels
        if not 0 <= delay <= levels:
            raise InvalidArgumentError(
                field=f"{msg}.delay_level {delay}",
                rule=f"must be between 1 and {levels}, the levels of this broker's delay table "
                "(0: no delay)",
            )
        if delay and at:
            raise InvalidArgumentError(
                field=msg,
                rule="delay_level and deliver_at_ms are both set; give one or the other",
            )
        if at < 0:
            raise InvalidArgumentError(
                field=f"{msg}.deliver_at_ms",
                rule=f"must be a time in ms since the epoch (0: none), got {at}",
            )
        ahead_ms = at - self.clock.time_ms() if at else 0
        if ahead_ms > self.timer_max_delay_ms:
            ahead = ahead_ms / 86_400_000
            cap = self.timer_max_delay_ms / 86_400_000
            raise InvalidArgumentError(
                field=f"{msg}.deliver_at_ms",
                rule=f"is {ahead:.2f} days ahead; the maximum is {cap:g} days "
                f"({self.timer_max_delay_ms // 1000} s, the broker's timer_max_delay_s)",
            )
        topic = self.topics.get_or_create(topic_name)
        if topic.system:
            raise PermissionDeniedError(
                what=f"topic {topic.name!r}", rule="is a system topic; clients cannot send to it"
            )
        if not topic.writable:
            raise PermissionDeniedError(
                what=f"topic {topic.name!r}",
                rule=f"is not writable on broker {self.broker_name} (perm {perm_text(topic.perm)})",
            )
        if not 0 <= queue_id < topic.write_queues:
            raise InvalidQueueIdError(
                value=queue_id,
                rule=f"must be between 0 and {topic.write_queues - 1}: topic {topic.name!r} has "
                f"{topic.write_queues} write queues on broker {self.broker_name}",
            )
        return topic

    def check_type(self, i: int | str, topic: TopicConfig, kind: MessageType, why: str) -> None:
        """Message ``i`` is a ``kind`` message (``why``: what made it one, as
        :func:`message_kind` says it): ``topic`` must accept that type (a MIXED topic accepts
        every type; the others their own only)."""
        accepts = topic.message_type
        if not accepts.accepts(kind):
            raise MessageTypeMismatchError(
                topic=topic.name,
                accepts=accepts.value,
                # ``i`` a field (``"message"``): the request's one message
                index=i if isinstance(i, int) else 0,
                kind=kind.value,
                why=why,
            )

    def check_compressed(self, i: int | str, body: bytes | memoryview) -> None:
        """Message ``i``'s body is flagged compressed: it must be one zlib stream that inflates
        to at most ``max_message_size`` bytes (else no reader could ever read it)."""
        problem = inflate_problem(body, self.max_message_size)
        if problem is not None:
            raise InvalidArgumentError(
                field=f"{where(i)}.body",
                rule=f"is flagged compressed (sys_flag 0x1) but {problem}",
            )


def message_kind(delay: int, at: int, grouped: bool) -> tuple[MessageType, str]:
    """The type of a message that is not a transaction's half (a half is TRANSACTION): DELAY
    with a delay level or a delivery time (``at``, ms), FIFO with a message group (``grouped``:
    it carries the property ``__SHARDINGKEY``), else NORMAL; and what made it that type, as
    :meth:`SendChecks.check_type` says it."""
    if delay:
        return MessageType.DELAY, f"it has delay level {delay}"
    if at:
        return MessageType.DELAY, f"it has a delivery time (deliver_at_ms {at})"
    if grouped:
        return MessageType.FIFO, f"it has a message group ({PROP_SHARDING_KEY})"
    return MessageType.NORMAL, "it has no delay, message group or transaction"


#: Why a half message is a TRANSACTION message, as :meth:`SendChecks.check_type` says it.
HALF_WHY = "it is a transactional half message"


def check_client_properties(names: Iterable[str]) -> None:
    """Refuse a property a client may not set: a message's own fields (tags, keys and unique id
    have fields of their own), what only brokers write (:data:`apogee.codec.
    BROKER_PROPERTIES`: where a delayed message goes, where a retry came from, ...), and a name
    holding a control character (the separators ``\\x01`` and ``\\x02`` among them)."""
    for name in names:
        rule = reserved_property_rule(name) or control_character_rule(name)
        if rule is not None:
            raise InvalidPropertyError(field=name, rule=rule)


def check_unique_id(uid: str) -> None:
    """Refuse a unique id a client gave that lookups, lists and logs could not show (too long,
    spaces, control characters), with the sentence the record path and the store give."""
    rule = unique_id_rule(uid)
    if rule is not None:
        raise InvalidArgumentError(field="unique_id", rule=rule)


def where(i: int | str) -> str:
    """How sentences name message ``i`` of a request (or the field ``i``)."""
    return i if isinstance(i, str) else f"messages[{i}]"
