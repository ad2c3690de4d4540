"""What users send and get back: :class:`Message`, :class:`SendResult`, :class:`StoredMessage`.

A :class:`Message` is plain data; the producer validates it, gives it a unique id, compresses a
large body (zlib, system flag bit :data:`SYSFLAG_COMPRESSED`) and never changes the object the
user passed. :class:`StoredMessage` is a message as a broker keeps it (lookups by id or key, and
later the consumers); its ``body`` is already decompressed.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from apogee.v1 import common_pb2

#: System flag bit: the body travels and is stored zlib-compressed.
SYSFLAG_COMPRESSED = 0x1

#: The highest delay level (``1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h``).
MAX_DELAY_LEVEL = 18


@dataclass(slots=True)
class Message:
    """One message to send.

    ``keys`` index the message for lookups by key (a single string is one key);
    ``delay_level`` 1-18 delays delivery by one of the fixed levels, 0 sends it at once.
    """

    topic: str
    body: bytes
    tags: str = ""
    keys: Sequence[str] = ()
    properties: Mapping[str, str] = field(default_factory=dict)
    delay_level: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.keys, str):
            self.keys = (self.keys,)


class SendStatus(enum.Enum):
    """How a message that reached a broker was stored."""

    #: Stored (and flushed, when the broker flushes synchronously).
    OK = "OK"
    #: Stored, but the broker's synchronous flush did not confirm it in time; the message is
    #: normally durable a moment later. Not retried, as in RocketMQ (a retry would duplicate it).
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"


@dataclass(frozen=True, slots=True)
class SendResult:
    """Where a message was stored."""

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
    """A message as a broker stores it, with its body decompressed."""

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

    @property
    def compressed(self) -> bool:
        """Whether the body travelled and is stored compressed."""
        return bool(self.sys_flag & SYSFLAG_COMPRESSED)

    @classmethod
    def from_pb(cls, m: common_pb2.StoredMessage, broker_name: str = "") -> StoredMessage:
        return cls(
            topic=m.topic,
            body=decode_body(m.body, m.sys_flag),
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
        )


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
