"""What users send and get back: :class:`Message`, :class:`SendResult`, :class:`StoredMessage`.

A :class:`Message` is plain data; the producer validates it, gives it a unique id, compresses a
large body (zlib, system flag bit :data:`SYSFLAG_COMPRESSED`) and never changes the object the
user passed. :class:`StoredMessage` is a message as a broker keeps it (lookups by id or key, and
later the consumers); its ``body`` is already decompressed.

A message is delivered to consumers at once, or later in one of two ways (never both):

- ``delay_level`` 1-18: after one of the broker's fixed delays (by default
  :data:`DEFAULT_DELAY_LEVELS`, ``1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h``;
  the table is the broker's ``delay_levels``);
- ``deliver_at``: at a point in time (a timer message), a timezone-aware ``datetime`` or seconds
  since the epoch (``time.time() + 90``), carried to the millisecond. A time in the past is
  delivered at once; the broker refuses one further ahead than its ``timer_max_delay_s`` (7 days
  by default).

Both travel through the broker's schedule topic and the schedule service; batches
(``send_batch``) cannot be delayed.
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Final

from apogee.codec import SYSFLAG_COMPRESSED
from apogee.common.clock import MAX_EPOCH_MS
from apogee.common.errors import InvalidArgumentError
from apogee.v1 import common_pb2

#: The brokers' delay table unless configured otherwise (``delay_levels``): level L waits
#: ``DEFAULT_DELAY_LEVELS[L - 1]``.
DEFAULT_DELAY_LEVELS: Final = (
    "1s", "5s", "10s", "30s", "1m", "2m", "3m", "4m", "5m",
    "6m", "7m", "8m", "9m", "10m", "20m", "30m", "1h", "2h",
)  # fmt: skip
#: The highest delay level.
MAX_DELAY_LEVEL: Final = 18

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND: Final = timedelta(microseconds=1)
#: The latest delivery time a message can carry: the end of year 9999 UTC, ``datetime``'s limit.
MAX_DELIVER_AT_MS: Final = MAX_EPOCH_MS


@dataclass(slots=True)
class Message:
    """One message to send.

    ``keys`` index the message for lookups by key (a single string is one key);
    ``delay_level`` 1-18 delays delivery by one of the broker's fixed delays, 0 sends it at
    once; ``deliver_at`` (a timezone-aware ``datetime``, or seconds since the epoch) delivers it
    at that time instead. Not both.
    """

    topic: str
    body: bytes
    tags: str = ""
    keys: Sequence[str] = ()
    properties: Mapping[str, str] = field(default_factory=dict)
    delay_level: int = 0
    deliver_at: datetime | float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.keys, str):
            self.keys = (self.keys,)

    @property
    def deliver_at_ms(self) -> int:
        """:attr:`deliver_at` in milliseconds since the epoch (rounded to the nearest), 0 when
        unset; :class:`~apogee.common.errors.InvalidArgumentError` for a value that is not a
        time."""
        return deliver_at_ms(self.deliver_at)


class SendStatus(enum.Enum):
    """How a message that reached a broker was stored."""

    #: Stored (and flushed, when the broker flushes synchronously).
    OK = "OK"
    #: Stored, but the broker's synchronous flush did not confirm it in time; the message is
    #: normally durable a moment later. Not retried, as in RocketMQ (a retry would duplicate it).
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"


@dataclass(frozen=True, slots=True)
class SendResult:
    """Where a message was stored. A delayed or timer message names its real topic and queue
    but has no offset there before it is delivered: its ``queue_offset`` is -1 (a delivery
    time already past is stored at once, with its offset)."""

    message_id: str
    topic: str
    queue_id: int
    queue_offset: int
    broker_name: str
    status: SendStatus = SendStatus.OK
    store_timestamp_ms: int = 0

    @property
    def unique_id(self) -> str:
        """The same as :attr:`message_id` (the name the broker and the store use)."""
        return self.message_id


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """A message as a broker stores it, with its body decompressed. A body flagged compressed
    that does not inflate (stored before brokers checked) is kept as stored, and
    ``body_error`` says why it could not be decompressed."""

    topic: str
    body: bytes
    queue_id: int
    queue_offset: int
    unique_id: str
    broker_name: str
    tags: str = ""
    keys: tuple[str, ...] = ()
    properties: Mapping[str, str] = field(default_factory=dict)
    born_timestamp_ms: int = 0
    store_timestamp_ms: int = 0
    born_host: str = ""
    store_host: str = ""
    phys_offset: int = 0
    flag: int = 0
    sys_flag: int = 0
    reconsume_times: int = 0
    #: why ``body`` is the stored bytes and not the decompressed body ("" when it is)
    body_error: str = ""

    @property
    def compressed(self) -> bool:
        """Whether the body travelled and is stored compressed."""
        return bool(self.sys_flag & SYSFLAG_COMPRESSED)

    @classmethod
    def from_pb(cls, m: common_pb2.StoredMessage, broker_name: str = "") -> StoredMessage:
        body_error = ""
        try:
            body = decode_body(m.body, m.sys_flag)
        except zlib.error as exc:
            body, body_error = m.body, f"the compressed body does not inflate: {exc}"
        return cls(
            topic=m.topic,
            body=body,
            queue_id=m.queue_id,
            queue_offset=m.queue_offset,
            unique_id=m.unique_id,
            broker_name=m.broker_name or broker_name,
            tags=m.tags,
            keys=tuple(m.keys),
            properties=dict(m.properties),
            born_timestamp_ms=m.born_timestamp_ms,
            store_timestamp_ms=m.store_timestamp_ms,
            born_host=m.born_host,
            store_host=m.store_host,
            phys_offset=m.phys_offset,
            flag=m.flag,
            sys_flag=m.sys_flag,
            reconsume_times=m.reconsume_times,
            body_error=body_error,
        )


def deliver_at_ms(value: datetime | float | None) -> int:
    """Milliseconds since the epoch of a delivery time (0 for ``None``): a timezone-aware
    ``datetime``, or seconds since the epoch (an ``int`` or a finite ``float``); rounded to the
    nearest millisecond (half up). Naive datetimes are refused (their zone would be a guess)."""
    if value is None:
        return 0
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise InvalidArgumentError(
                field="deliver_at",
                rule=f"a datetime must be timezone-aware, got the naive {value.isoformat()} "
                "(use datetime.now(UTC) + timedelta(...), or .astimezone())",
            )
        ms = ((value - _EPOCH) // _MICROSECOND + 500) // 1000
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise InvalidArgumentError(
                field="deliver_at", rule=f"must be a finite number of seconds, got {value!r}"
            )
        ms = math.floor(value * 1000 + 0.5)
    else:
        raise InvalidArgumentError(
            field="deliver_at",
            rule="must be a timezone-aware datetime or seconds since the epoch, got "
            f"{type(value).__name__}",
        )
    if not 0 <= ms <= MAX_DELIVER_AT_MS:
        got = value.isoformat() if isinstance(value, datetime) else repr(value)
        raise InvalidArgumentError(
            field="deliver_at", rule=f"must be a time from 1970-01-01 to 9999-12-31 UTC, got {got}"
        )
    return ms


def not_text_rule(exc: UnicodeEncodeError) -> str:
    """The rule broken by the string UTF-8 could not encode in ``exc``: one holding a lone
    surrogate (as text decoded with ``errors="surrogateescape"`` does for each byte that was
    not UTF-8). Callers catch the error where they encode anyway and name the field."""
    surrogate = ord(exc.object[exc.start])
    return (
        f"must be valid Unicode text: lone surrogate U+{surrogate:04X} at position {exc.start} "
        "cannot be encoded as UTF-8"
    )


def check_text(field: str, text: object) -> None:
    """:class:`~apogee.common.errors.InvalidArgumentError` naming ``field`` when ``text`` is a
    string UTF-8 cannot encode (for strings not encoded on a hot path; other types are left to
    the caller's checks)."""
    if isinstance(text, str) and not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise InvalidArgumentError(field=field, rule=not_text_rule(exc)) from None


def encode_body(body: bytes, compress_over: int, level: int = 5) -> tuple[bytes, int]:
    """The body as it travels and its system flag: zlib-compressed when longer than
    ``compress_over`` bytes and only if that makes it smaller (``compress_over`` < 0: never)."""
    if 0 <= compress_over < len(body):
        packed = zlib.compress(body, level)
        if len(packed) < len(body):
            return packed, SYSFLAG_COMPRESSED
    return body, 0


def decode_body(body: bytes, sys_flag: int) -> bytes:
    """The original body of a message stored with ``sys_flag``."""
    if sys_flag & SYSFLAG_COMPRESSED:
        return zlib.decompress(body)
    return body
