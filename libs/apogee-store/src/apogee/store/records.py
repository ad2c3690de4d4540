"""The CommitLog record: what a message looks like on disk, and how batches are encoded.

All integers are little-endian. One record::

     0       4       8       12      16      20              28              36      40
     +-------+-------+-------+-------+-------+---------------+---------------+-------+
     | size  | magic |  crc  | queue | flag  | queue offset  | phys offset   | sysflg|
     +-------+-------+-------+-------+-------+---------------+---------------+-------+
     40              48              56                  74                  92
     +---------------+---------------+-------------------+-------------------+
     | born ts (ms)  | store ts (ms) | born host (18)    | store host (18)   |
     +---------------+---------------+-------------------+-------------------+
     92      96              104     108     110     112
     +-------+---------------+-------+-------+-------+--------+--------+------------+
     | recon | prepared txn  | body  | topic | props | body   | topic  | properties |
     | times | offset        | len   | len   | len   | ...    | ...    | ...        |
     +-------+---------------+-------+-------+-------+--------+--------+------------+

``size`` counts the whole record. ``crc`` is the CRC-32 of every byte after it (bytes 12 to
``size``): header, body, topic and properties, so a garbled or torn record anywhere fails the check
(RocketMQ checks the body only; a torn tail can lose properties that way). Hosts are 16 bytes of
IPv6 address (IPv4 mapped) and a 2-byte port. Properties are ``name 0x01 value 0x02`` repeated,
UTF-8; ``TAGS``, ``KEYS`` (space separated) and ``UNIQ_KEY`` are kept among them.

The end of a file that has no room for the next record is marked by a blank record: ``size`` (the
bytes left in the file) and the magic ``BLANK_MAGIC``; readers skip to the next file.
"""

from __future__ import annotations

import ipaddress
import re
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from apogee.common.errors import (
    CorruptRecordError,
    InvalidPropertyError,
    InvalidQueueIdError,
    InvalidTopicError,
    MessageTooLargeError,
    PropertiesTooLargeError,
)
from apogee.common.ids import IdGenerator

from apogee.store.config import StoreConfig

MESSAGE_MAGIC: Final = 0xAABBCCDD
BLANK_MAGIC: Final = 0xCBD43194

#: The whole fixed header, derived from the drawing above.
HEADER = struct.Struct("<iIIiiqqiqq18s18siqiHH")
#: The part of the header before the CRC'd bytes, and the part after the CRC.
HEAD = struct.Struct("<iII")
TAIL = struct.Struct("<iiqqiqq18s18siqiHH")
BLANK = struct.Struct("<iI")
HEADER_SIZE: Final = HEADER.size  # 112
MIN_BLANK: Final = BLANK.size  # room always kept at the end of a file for the blank record
assert HEADER_SIZE == HEAD.size + TAIL.size == 112

PROP_TAGS: Final = "TAGS"
PROP_KEYS: Final = "KEYS"
PROP_UNIQ_KEY: Final = "UNIQ_KEY"
NAME_SEP: Final = "\x01"
PROP_SEP: Final = "\x02"

TOPIC_RE: Final = re.compile(r"^[%|a-zA-Z0-9_-]+$")

SYSFLAG_COMPRESSED: Final = 0x1
SYSFLAG_MULTI_TAGS: Final = 0x2
SYSFLAG_TXN_PREPARED: Final = 0x4
SYSFLAG_TXN_COMMIT: Final = 0x8
SYSFLAG_TXN_ROLLBACK: Final = 0xC

EMPTY_HOST: Final = bytes(18)


def tag_hash(tags: str | None) -> int:
    """The ConsumeQueue tag code of a tag: CRC-32 of its UTF-8 bytes, 0 for no tag."""
    return zlib.crc32(tags.encode()) if tags else 0


#: Computes a message's ConsumeQueue tag code from (topic, tags, properties, store timestamp).
#: The default is :func:`tag_hash`; the schedule topic puts the delivery time there instead.
TagCode = Callable[[str, "str | None", Mapping[str, str], int], int]


def default_tag_code(topic: str, tags: str | None, props: Mapping[str, str], store_ts: int) -> int:
    return tag_hash(tags)


_host_cache: dict[str, bytes] = {"": EMPTY_HOST}


def encode_host(host: str) -> bytes:
    """``"10.0.0.1:8080"`` or ``"[::1]:8080"`` as 18 bytes; ``""`` as zeros."""
    cached = _host_cache.get(host)
    if cached is not None:
        return cached
    addr, _, port = host.rpartition(":")
    try:
        ip = ipaddress.ip_address(addr.strip("[]"))
        packed = (
            ip.packed if ip.version == 6 else ipaddress.IPv6Address(f"::ffff:{ip}").packed
        ) + int(port).to_bytes(2, "little")
    except ValueError as exc:
        raise InvalidPropertyError(field="born_host", rule=f"{host!r} is not ip:port") from exc
    if len(_host_cache) < 4096:
        _host_cache[host] = packed
    return packed


def decode_host(raw: bytes) -> str:
    if raw == EMPTY_HOST:
        return ""
    ip = ipaddress.IPv6Address(raw[:16])
    port = int.from_bytes(raw[16:], "little")
    mapped = ip.ipv4_mapped
    return f"{mapped}:{port}" if mapped else f"[{ip}]:{port}"


@dataclass(slots=True)
class Message:
    """A message to append. ``unique_id`` is generated when absent."""

    topic: str
    body: bytes
    queue_id: int = 0
    tags: str | None = None
    keys: Sequence[str] = ()
    properties: Mapping[str, str] | None = None
    unique_id: str | None = None
    flag: int = 0
    sys_flag: int = 0
    born_timestamp: int = 0
    born_host: str = ""
    reconsume_times: int = 0
    prepared_txn_offset: int = 0


def decode_properties(raw: str) -> dict[str, str]:
    props: dict[str, str] = {}
    for item in raw.split(PROP_SEP):
        if item:
            name, _, value = item.partition(NAME_SEP)
            props[name] = value
    return props


@dataclass(slots=True)
class StoredMessage:
    """A message as read back from the CommitLog."""

    topic: str
    queue_id: int
    queue_offset: int
    phys_offset: int
    size: int
    body: bytes
    flag: int
    sys_flag: int
    born_timestamp: int
    store_timestamp: int
    born_host_raw: bytes
    store_host_raw: bytes
    reconsume_times: int
    prepared_txn_offset: int
    properties_raw: str
    _props: dict[str, str] | None = field(default=None, repr=False, compare=False)

    @property
    def properties(self) -> dict[str, str]:
        props = self._props
        if props is None:
            props = self._props = decode_properties(self.properties_raw)
        return props

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROP_TAGS)

    @property
    def keys(self) -> list[str]:
        raw = self.properties.get(PROP_KEYS)
        return raw.split(" ") if raw else []

    @property
    def unique_id(self) -> str:
        return self.properties.get(PROP_UNIQ_KEY, "")

    @property
    def born_host(self) -> str:
        return decode_host(self.born_host_raw)

    @property
    def store_host(self) -> str:
        return decode_host(self.store_host_raw)


# One entry per appended message, handed to the dispatcher (and rebuilt from the log on recovery):
# (topic, queue_id, queue_offset, phys_offset, size, tag_code, keys, unique_id, store_timestamp)
DispatchEntry = tuple[str, int, int, int, int, int, Sequence[str], str, int]


class Encoder:
    """Validates messages and encodes them into records; one per CommitLog (not thread-safe)."""

    def __init__(
        self, config: StoreConfig, store_host: str = "", tag_code: TagCode | None = None
    ) -> None:
        self._cfg = config
        self._store_host = encode_host(store_host)
        self._tag_code = tag_code
        self._topics: dict[str, bytes] = {}
        self._ids = IdGenerator()

    def topic_bytes(self, topic: str) -> bytes:
        raw = self._topics.get(topic)
        if raw is None:
            raw = validate_topic(topic, self._cfg.max_topic_length).encode()
            if len(self._topics) < 100_000:
                self._topics[topic] = raw
        return raw

    def prepare(self, msg: Message) -> tuple[bytes, bytes, str]:
        """Check one message; returns its topic bytes, encoded properties and unique id."""
        topic_b = self.topic_bytes(msg.topic)
        qid = msg.queue_id
        if not 0 <= qid < self._cfg.max_queues_per_topic:
            raise InvalidQueueIdError(
                value=qid,
                rule=f"must be between 0 and {self._cfg.max_queues_per_topic - 1} "
                "(max_queues_per_topic)",
            )
        blen = len(msg.body)
        if blen > self._cfg.max_message_size:
            raise MessageTooLargeError(
                field="body",
                size=blen,
                rule=f"the maximum is {self._cfg.max_message_size} bytes (max_message_size)",
            )
        uid = msg.unique_id or self._ids.next_id()
        parts: list[str] = []
        if msg.tags:
            _check_value("tags", msg.tags)
            parts.append(f"TAGS\x01{msg.tags}\x02")
        if msg.keys:
            for key in msg.keys:
                if not key or " " in key:
                    raise InvalidPropertyError(
                        field="keys", rule=f"key {key!r} must be non-empty and have no space"
                    )
                _check_value("keys", key)
            parts.append(f"KEYS\x01{' '.join(msg.keys)}\x02")
        _check_value("unique_id", uid)
        parts.append(f"UNIQ_KEY\x01{uid}\x02")
        if msg.properties:
            for name, value in msg.properties.items():
                if name in (PROP_TAGS, PROP_KEYS, PROP_UNIQ_KEY):
                    continue  # the message's own fields win
                if not name or NAME_SEP in name or PROP_SEP in name:
                    raise InvalidPropertyError(
                        field=name, rule="a property name must be non-empty, without \\x01 or \\x02"
                    )
                _check_value(name, value)
                parts.append(f"{name}\x01{value}\x02")
        props = "".join(parts).encode()
        if len(props) > self._cfg.max_properties_size:
            raise PropertiesTooLargeError(
                size=len(props),
                rule=f"the maximum is {self._cfg.max_properties_size} bytes "
                "(max_properties_size), tags, keys and unique id included",
            )
        return topic_b, props, uid

    def tag_code_of(self, msg: Message, store_ts: int) -> int:
        if self._tag_code is None:
            return zlib.crc32(msg.tags.encode()) if msg.tags else 0
        return self._tag_code(msg.topic, msg.tags, msg.properties or {}, store_ts)

    def encode(
        self,
        msg: Message,
        topic_b: bytes,
        props: bytes,
        queue_offset: int,
        phys_offset: int,
        store_ts: int,
        out: list[bytes],
    ) -> int:
        """Append one record's parts to ``out``; returns its size."""
        body = msg.body
        size = HEADER_SIZE + len(body) + len(topic_b) + len(props)
        tail = TAIL.pack(
            msg.queue_id,
            msg.flag,
            queue_offset,
            phys_offset,
            msg.sys_flag,
            msg.born_timestamp or store_ts,
            store_ts,
            encode_host(msg.born_host),
            self._store_host,
            msg.reconsume_times,
            msg.prepared_txn_offset,
            len(body),
            len(topic_b),
            len(props),
        )
        crc = zlib.crc32(props, zlib.crc32(topic_b, zlib.crc32(body, zlib.crc32(tail))))
        out += (HEAD.pack(size, MESSAGE_MAGIC, crc), tail, body, topic_b, props)
        return size


def record_size(msg: Message, topic_b: bytes, props: bytes) -> int:
    return HEADER_SIZE + len(msg.body) + len(topic_b) + len(props)


def validate_topic(topic: str, max_len: int = 127) -> str:
    if not isinstance(topic, str) or not topic:
        raise InvalidTopicError(value=topic, rule="must not be empty")
    if len(topic) > max_len:
        raise InvalidTopicError(
            value=topic, rule=f"is {len(topic)} characters; at most {max_len} are allowed"
        )
    if not TOPIC_RE.match(topic):
        raise InvalidTopicError(value=topic, rule="has a character outside [%|a-zA-Z0-9_-]")
    return topic


def _check_value(name: str, value: str) -> None:
    if NAME_SEP in value or PROP_SEP in value:
        raise InvalidPropertyError(field=name, rule="a value must not contain \\x01 or \\x02")


def decode(
    buf: bytes | memoryview,
    where: str,
    verify_crc: bool,
    pos: int = 0,
    size: int | None = None,
) -> StoredMessage:
    """Decode the record at ``buf[pos:]`` (``size`` bytes if known, else all of ``buf``);
    raises :class:`CorruptRecordError` when it fails any check."""
    avail = (len(buf) - pos) if size is None else size
    if avail < HEADER_SIZE or pos + avail > len(buf):
        raise CorruptRecordError(where=where, detail=f"{avail} bytes is shorter than a header")
    (
        rsize,
        magic,
        crc,
        qid,
        flag,
        qoff,
        phys,
        sysflag,
        born_ts,
        store_ts,
        born_host,
        store_host,
        recon,
        prep,
        blen,
        tlen,
        plen,
    ) = HEADER.unpack_from(buf, pos)
    if magic != MESSAGE_MAGIC:
        raise CorruptRecordError(where=where, detail=f"magic {magic:#x} is not a message's")
    end_body = pos + HEADER_SIZE + blen
    end_topic = end_body + tlen
    if rsize != HEADER_SIZE + blen + tlen + plen or rsize != avail or blen < 0:
        raise CorruptRecordError(
            where=where, detail=f"size {rsize} does not match its parts or the {avail} read"
        )
    mv = memoryview(buf)
    if verify_crc and zlib.crc32(mv[pos + 12 : pos + rsize]) != crc:
        raise CorruptRecordError(where=where, detail="CRC mismatch")
    try:
        topic = str(mv[end_body:end_topic], "utf-8")
        props = str(mv[end_topic : pos + rsize], "utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptRecordError(where=where, detail=f"undecodable text: {exc}") from exc
    return StoredMessage(
        topic,
        qid,
        qoff,
        phys,
        rsize,
        mv[pos + HEADER_SIZE : end_body].tobytes(),
        flag,
        sysflag,
        born_ts,
        store_ts,
        born_host,
        store_host,
        recon,
        prep,
        props,
    )
