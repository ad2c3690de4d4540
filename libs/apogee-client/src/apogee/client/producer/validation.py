"""Client-side checks, run before a message is queued: the broker would refuse the same things,
but one round trip later and after the message took a place in a batch.

The rules (and sentences) are the broker's: topic names as :func:`apogee.common.topics.
validate_topic`; a body of 1 byte to ``max_message_size`` bytes; tags, property names and values
without ``\\x01``/``\\x02`` (the separators of the stored properties); tags, keys, property names
and values valid Unicode text (UTF-8 cannot encode a lone surrogate); no property named as a
message's own field (``TAGS``, ``KEYS``, ``UNIQ_KEY``) or as one only brokers set
(:data:`apogee.codec.BROKER_PROPERTIES`: ``REAL_TOPIC``, ``DELAY``, ...); keys non-empty and
without spaces; encoded properties within ``max_properties_size``; delay levels 0-18; a
``deliver_at`` that is a time (timezone-aware when a ``datetime``) and not together with a delay
level; system topics are the brokers' own. A batch adds: one topic, no delay and no delivery
time (as in RocketMQ, delay is not supported for batch sends), all bodies within
``max_message_size`` together.

A delivery time in the past is fine (the broker delivers the message at once); how far ahead
one may be is the broker's rule (``timer_max_delay_s``), so its error reaches the caller as the
broker words it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from apogee.client.message import MAX_DELAY_LEVEL, Message, deliver_at_ms, not_text_rule
from apogee.codec import OWN_FIELDS, control_character_rule, is_broker_property
from apogee.common.errors import (
    InvalidArgumentError,
    InvalidPropertyError,
    MessageTooLargeError,
    PermissionDeniedError,
    PropertiesTooLargeError,
)
from apogee.common.topics import is_system_topic, validate_topic

MiB: Final = 1024 * 1024
MAX_MESSAGE_SIZE: Final = 4 * MiB
MAX_PROPERTIES_SIZE: Final = 32_767
#: Property names the message's own fields are stored under.
RESERVED_PROPERTIES: Final = OWN_FIELDS
_UNIQUE_ID_LEN: Final = 32
#: what a message's text fields may hold instead of binary data
_USE_BODY: Final = "; binary data belongs in the body"


def _has_separator(text: str) -> bool:
    return "\x01" in text or "\x02" in text


def check_topic(topic: str) -> None:
    validate_topic(topic)
    if is_system_topic(topic):
        raise PermissionDeniedError(
            what=f"topic {topic!r}", rule="is a system topic; clients cannot send to it"
        )


def validate_message(
    msg: Message,
    max_message_size: int = MAX_MESSAGE_SIZE,
    max_properties_size: int = MAX_PROPERTIES_SIZE,
) -> None:
    """Raise the registry's error for the first rule ``msg`` breaks."""
    if not isinstance(msg, Message):
        raise InvalidArgumentError(
            field="message", rule=f"must be an apogee.client.Message, got {type(msg).__name__}"
        )
    check_topic(msg.topic)
    body = msg.body
    if not isinstance(body, bytes | bytearray | memoryview):
        raise InvalidArgumentError(field="body", rule=f"must be bytes, got {type(body).__name__}")
    if len(body) == 0:
        raise InvalidArgumentError(field="body", rule="must not be empty")
    if len(body) > max_message_size:
        raise MessageTooLargeError(
            field="body",
            size=len(body),
            rule=f"the maximum is {max_message_size} bytes (max_message_size)",
        )
    level = msg.delay_level
    if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= MAX_DELAY_LEVEL:
        raise InvalidArgumentError(
            field="delay_level",
            rule=f"must be an integer from 0 to {MAX_DELAY_LEVEL}, got {level!r}",
        )
    if msg.deliver_at is not None:
        deliver_at_ms(msg.deliver_at)
        if level:
            raise InvalidArgumentError(
                field="deliver_at",
                rule=f"cannot be combined with delay_level ({level}); set one of them",
            )
    size = len("UNIQ_KEY") + _UNIQUE_ID_LEN + 2
    tags = msg.tags
    if tags:
        if not isinstance(tags, str):
            raise InvalidArgumentError(
                field="tags", rule=f"must be a str, got {type(tags).__name__}"
            )
        if _has_separator(tags):
            raise InvalidPropertyError(field="tags", rule="a value must not contain \\x01 or \\x02")
        try:
            size += len(tags.encode()) + 6
        except UnicodeEncodeError as exc:
            raise InvalidPropertyError(field="tags", rule=not_text_rule(exc) + _USE_BODY) from None
    if msg.keys:
        for key in msg.keys:
            if not isinstance(key, str) or not key or " " in key or _has_separator(key):
                raise InvalidPropertyError(
                    field="keys",
                    rule=f"key {key!r} must be non-empty, without spaces, \\x01 or \\x02",
                )
            try:
                size += len(key.encode()) + 1
            except UnicodeEncodeError as exc:
                raise InvalidPropertyError(
                    field="keys", rule=f"key {key!r} {not_text_rule(exc)}{_USE_BODY}"
                ) from None
        size += 5  # "KEYS" \x01 ... \x02, keys joined by spaces
    for name, value in msg.properties.items():
        if not isinstance(name, str) or not name or _has_separator(name):
            raise InvalidPropertyError(
                field=name, rule="a property name must be non-empty, without \\x01 or \\x02"
            )
        rule = control_character_rule(name)
        if rule is not None:
            raise InvalidPropertyError(field=name, rule=rule)
        if name in RESERVED_PROPERTIES:
            raise InvalidPropertyError(
                field=name, rule="is reserved; use Message.tags, Message.keys or the message id"
            )
        if is_broker_property(name):
            raise InvalidPropertyError(
                field=name,
                rule="is set by brokers only; use Message.delay_level or Message.deliver_at "
                "for a delayed message",
            )
        if not isinstance(value, str):
            raise InvalidPropertyError(
                field=name, rule=f"a value must be a str, got {type(value).__name__}"
            )
        if _has_separator(value):
            raise InvalidPropertyError(field=name, rule="a value must not contain \\x01 or \\x02")
        try:
            size += len(name.encode()) + len(value.encode()) + 2
        except UnicodeEncodeError as exc:
            what = "a property name" if exc.object is name else "a value"
            raise InvalidPropertyError(
                field=name, rule=f"{what} {not_text_rule(exc)}{_USE_BODY}"
            ) from None
    if size > max_properties_size:
        raise PropertiesTooLargeError(
            size=size,
            rule=f"the maximum is {max_properties_size} bytes (max_properties_size), "
            "tags, keys and unique id included",
        )


class MessageValidator:
    """:func:`validate_message` with a memory: a message with a topic and tags that passed
    before, a ``bytes`` body, no keys, no properties and no delivery time needs only its body
    and delay level checked (the rules for topic and tags do not depend on the rest of such a
    message, and its properties are never larger than those of the message that passed).
    Anything else gets the full check."""

    _REMEMBER = 10_000  # distinct topics and tags remembered, at most

    def __init__(
        self,
        max_message_size: int = MAX_MESSAGE_SIZE,
        max_properties_size: int = MAX_PROPERTIES_SIZE,
    ) -> None:
        self.max_message_size = max_message_size
        self.max_properties_size = max_properties_size
        self._topics: set[str] = set()
        self._tags: set[str] = {""}

    def __call__(self, msg: Message) -> None:
        """Raise the registry's error for the first rule ``msg`` breaks."""
        if type(msg) is Message:
            topic, body, tags, level = msg.topic, msg.body, msg.tags, msg.delay_level
            props = msg.properties
            if (
                type(topic) is str
                and topic in self._topics
                and type(body) is bytes
                and 0 < len(body) <= self.max_message_size
                and type(tags) is str
                and tags in self._tags
                and not msg.keys
                and type(props) is dict
                and not props
                and type(level) is int
                and 0 <= level <= MAX_DELAY_LEVEL
                and msg.deliver_at is None
            ):
                return
        validate_message(msg, self.max_message_size, self.max_properties_size)
        if len(self._topics) < self._REMEMBER:
            self._topics.add(msg.topic)
        if isinstance(msg.tags, str) and len(self._tags) < self._REMEMBER:
            self._tags.add(msg.tags)


def validate_batch(
    msgs: Sequence[Message],
    max_message_size: int = MAX_MESSAGE_SIZE,
    max_properties_size: int = MAX_PROPERTIES_SIZE,
    check: MessageValidator | None = None,
) -> None:
    """A batch: at least one message, each valid, one topic, no delay level or delivery time,
    bodies together within ``max_message_size``. ``check`` validates each message (default:
    :func:`validate_message` with the same limits)."""
    if isinstance(msgs, Message) or not isinstance(msgs, Sequence) or len(msgs) == 0:
        raise InvalidArgumentError(
            field="messages", rule="a batch must be a non-empty sequence of messages"
        )
    first = msgs[0]
    total = 0
    for i, msg in enumerate(msgs):
        if check is None:
            validate_message(msg, max_message_size, max_properties_size)
        else:
            check(msg)
        if msg.topic != first.topic:
            raise InvalidArgumentError(
                field="messages",
                rule=f"a batch has one topic; message {i} is for {msg.topic!r}, "
                f"the first for {first.topic!r}",
            )
        if msg.delay_level:
            raise InvalidArgumentError(
                field="delay_level",
                rule=f"delay is not supported for batch sends; message {i} has level "
                f"{msg.delay_level}",
            )
        if msg.deliver_at is not None:
            raise InvalidArgumentError(
                field="deliver_at",
                rule=f"delay is not supported for batch sends; message {i} has deliver_at set",
            )
        total += len(msg.body)
    if total > max_message_size:
        raise MessageTooLargeError(
            field="batch",
            size=total,
            rule=f"the maximum is {max_message_size} bytes (max_message_size) for a whole batch",
        )
