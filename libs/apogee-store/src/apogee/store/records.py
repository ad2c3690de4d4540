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
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from apogee.common.errors import (
    CorruptRecordError,
    InvalidArgumentError,
    InvalidPropertyError,
    InvalidQueueIdError,
    MessageTooLargeError,
    PropertiesTooLargeError,
)
from apogee.common.ids import IdGenerator
from apogee.common.topics import MAX_TOPIC_LENGTH
from apogee.common.topics import validate_topic as _validate_topic
from apogee.store.config import StoreConfig
from apogee.store.crc import crc32

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
#: System properties that brokers write and clients read (one spelling for both sides).
#: The original topic of a message in ``%RETRY%<group>`` (kept through every retry).
PROP_RETRY_TOPIC: Final = "RETRY_TOPIC"
#: The unique id of the message a retried, dead or redriven message stands for.
PROP_ORIGIN_MSG_ID: Final = "ORIGIN_MSG_ID"
#: Of a dead letter: its original topic, the consumer's last failure and how often it was tried.
PROP_DLQ_ORIGIN_TOPIC: Final = "DLQ_ORIGIN_TOPIC"
PROP_DLQ_REASON: Final = "DLQ_REASON"
PROP_ATTEMPTS: Final = "ATTEMPTS"
#: Most characters of a failure reason (``DLQ_REASON``) a broker keeps.
MAX_REASON: Final = 1024
#: Of a message on its way through the schedule topic: where it goes, its delay level or
#: delivery time.
PROP_REAL_TOPIC: Final = "REAL_TOPIC"
PROP_REAL_QID: Final = "REAL_QID"
PROP_DELAY: Final = "DELAY"
PROP_DELIVER_AT: Final = "DELIVER_AT_MS"
NAME_SEP: Final = "\x01"
PROP_SEP: Final = "\x02"

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
    except (ValueError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
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


class StoredMessage(NamedTuple):
    """A message as read back from the CommitLog: the record's header fields in their on-disk
    order, then topic, body and the raw properties (parsed on each use of ``properties``)."""

    size: int
    magic: int
    crc: int
    queue_id: int
    flag: int
    queue_offset: int
    phys_offset: int
    sys_flag: int
    born_timestamp: int
    store_timestamp: int
    born_host_raw: bytes
    store_host_raw: bytes
    reconsume_times: int
    prepared_txn_offset: int
    body_length: int
    topic_length: int
    properties_length: int
    topic: str
    body: bytes
    properties_raw: str

    @property
    def properties(self) -> dict[str, str]:
        return decode_properties(self.properties_raw)

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

    def copy_to(
        self,
        topic: str,
        queue_id: int,
        properties: Mapping[str, str],
        reconsume_times: int | None = None,
    ) -> Message:
        """This message to be stored again under ``topic`` / ``queue_id``: its body, tags,
        keys, unique id, flags, born time and host kept, with ``properties`` (its own
        ``TAGS`` / ``KEYS`` / ``UNIQ_KEY`` entries are ignored when it is encoded) and its
        reconsume times unless ``reconsume_times`` is given."""
        return Message(
            topic,
            self.body,
            queue_id,
            self.tags,
            self.keys,
            properties,
            self.unique_id or None,
            self.flag,
            self.sys_flag,
            self.born_timestamp,
            self.born_host,
            self.reconsume_times if reconsume_times is None else reconsume_times,
        )


class Encoder:
    """Validates messages and encodes them into records; one per CommitLog (not thread-safe)."""

    def __init__(
        self, config: StoreConfig, store_host: str = "", tag_code: TagCode | None = None
    ) -> None:
        self._cfg = config
        self._store_host = encode_host(store_host)
        self._tag_code = tag_code
        self._topics: dict[str, bytes] = {}
        self._tag_cache: dict[str, tuple[str, int]] = {}
        self._ids = IdGenerator()

    def topic_bytes(self, topic: str) -> bytes:
        raw = self._topics.get(topic)
        if raw is None:
            raw = validate_topic(topic, self._cfg.max_topic_length).encode()
            if len(self._topics) < 100_000:
                self._topics[topic] = raw
        return raw

    def prepare(self, msgs: Sequence[Message]) -> list[tuple[bytes, bytes, str, int]]:
        """Check a batch and encode what does not depend on placement. Returns, per message,
        its topic bytes, encoded properties, unique id and tag code (-1: compute at append).
        Raises on the first bad message, before anything is written."""
        cfg = self._cfg
        max_q = cfg.max_queues_per_topic
        max_body = cfg.max_message_size
        max_props = cfg.max_properties_size
        topics = self._topics
        tag_cache = self._tag_cache
        custom = self._tag_code is not None
        ids: list[str] | None = None
        out: list[tuple[bytes, bytes, str, int]] = []
        for i, msg in enumerate(msgs):
            topic_b = topics.get(msg.topic)
            if topic_b is None:
                topic_b = self.topic_bytes(msg.topic)
            qid = msg.queue_id
            if not 0 <= qid < max_q:
                raise InvalidQueueIdError(
                    value=qid,
                    rule=f"must be between 0 and {max_q - 1} (max_queues_per_topic)",
                )
            blen = len(msg.body)
            if blen > max_body:
                raise MessageTooLargeError(
                    field="body",
                    size=blen,
                    rule=f"the maximum is {max_body} bytes (max_message_size)",
                )
            if msg.born_host:
                encode_host(msg.born_host)  # checked here, not half-way through the append
            born = msg.born_timestamp
            if (
                msg.flag
                or msg.sys_flag
                or msg.reconsume_times
                or msg.prepared_txn_offset
                or (born and not (type(born) is int and 0 < born < _INT64[1]))
            ):
                _check_numbers(msg)
            uid = msg.unique_id
            if uid:
                _check_value("unique_id", uid)
            else:
                if ids is None:
                    ids = self._ids.next_ids(len(msgs))
                uid = ids[i]
            tags = msg.tags
            if tags:
                cached = tag_cache.get(tags)
                if cached is None:
                    _check_value("tags", tags)
                    cached = (f"TAGS\x01{tags}\x02", zlib.crc32(tags.encode()))
                    if len(tag_cache) < 10_000:
                        tag_cache[tags] = cached
                tag_part, code = cached
            else:
                tag_part, code = "", 0
            keys = msg.keys
            if keys:
                for key in keys:
                    if not key or " " in key or NAME_SEP in key or PROP_SEP in key:
                        raise InvalidPropertyError(
                            field="keys",
                            rule=f"key {key!r} must be non-empty, without spaces, \\x01 or \\x02",
                        )
                key_part = f"KEYS\x01{' '.join(keys)}\x02"
            else:
                key_part = ""
            user = msg.properties
            user_part = _encode_user_properties(user) if user else ""
            props = f"{tag_part}{key_part}UNIQ_KEY\x01{uid}\x02{user_part}".encode()
            if len(props) > max_props:
                raise PropertiesTooLargeError(
                    size=len(props),
                    rule=f"the maximum is {max_props} bytes (max_properties_size), "
                    "tags, keys and unique id included",
                )
            out.append((topic_b, props, uid, -1 if custom else code))
        return out

    def tag_code_of(self, msg: Message, store_ts: int) -> int:
        if self._tag_code is None:
            return zlib.crc32(msg.tags.encode()) if msg.tags else 0
        return self._tag_code(msg.topic, msg.tags, msg.properties or {}, store_ts)

    @property
    def store_host(self) -> bytes:
        return self._store_host


def _encode_user_properties(props: Mapping[str, str]) -> str:
    parts: list[str] = []
    for name, value in props.items():
        if name in (PROP_TAGS, PROP_KEYS, PROP_UNIQ_KEY):
            continue  # the message's own fields win
        if not name or NAME_SEP in name or PROP_SEP in name:
            raise InvalidPropertyError(
                field=name, rule="a property name must be non-empty, without \\x01 or \\x02"
            )
        _check_value(name, value)
        parts.append(f"{name}\x01{value}\x02")
    return "".join(parts)


def validate_topic(topic: str, max_len: int = MAX_TOPIC_LENGTH) -> str:
    """The topic name rule of :mod:`apogee.common.topics`, the one implementation."""
    return _validate_topic(topic, max_len)


_INT32 = (-(1 << 31), 1 << 31)
_INT64 = (0, 1 << 63)


def _check_numbers(msg: Message) -> None:
    for name, value, (lo, hi) in (
        ("flag", msg.flag, _INT32),
        ("sys_flag", msg.sys_flag, _INT32),
        ("reconsume_times", msg.reconsume_times, (0, 1 << 31)),
        ("born_timestamp", msg.born_timestamp, _INT64),
        ("prepared_txn_offset", msg.prepared_txn_offset, _INT64),
    ):
        if not isinstance(value, int) or not lo <= value < hi:
            raise InvalidArgumentError(
                field=name, rule=f"must be an integer from {lo} to {hi - 1}, got {value!r}"
            )


def _check_value(name: str, value: str) -> None:
    if NAME_SEP in value or PROP_SEP in value:
        raise InvalidPropertyError(field=name, rule="a value must not contain \\x01 or \\x02")


def decode(
    buf: bytes,
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
    f = HEADER.unpack_from(buf, pos)
    rsize = f[0]
    if f[1] != MESSAGE_MAGIC:
        raise CorruptRecordError(where=where, detail=f"magic {f[1]:#x} is not a message's")
    blen = f[14]
    end_body = pos + HEADER_SIZE + blen
    end_topic = end_body + f[15]
    if rsize != avail or end_topic + f[16] != pos + rsize or blen < 0:
        raise CorruptRecordError(
            where=where, detail=f"size {rsize} does not match its parts or the {avail} read"
        )
    if verify_crc and crc32(memoryview(buf)[pos + 12 : pos + rsize]) != f[2]:
        raise CorruptRecordError(where=where, detail="CRC mismatch")
    try:
        topic = str(buf[end_body:end_topic], "utf-8")
        props = str(buf[end_topic : pos + rsize], "utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptRecordError(where=where, detail=f"undecodable text: {exc}") from exc
    return _new_stored(StoredMessage, (*f, topic, buf[pos + HEADER_SIZE : end_body], props))


_new_stored = tuple.__new__


def decode_run(
    chunk: bytes,
    sizes: Sequence[int],
    verify_crc: bool,
    topic: str,
    queue_id: int,
    first: int,
    first_phys: int,
) -> list[StoredMessage]:
    """Decode records that lie back to back in ``chunk`` (a queue read's contiguous run, read
    from physical offset ``first_phys``), with the checks of :func:`decode` plus: each record is
    of ``topic``/``queue_id`` at queue offsets ``first``, ``first + 1``, ... and sits where its
    entry says. Faster than calling :func:`decode` per record."""
    out: list[StoredMessage] = []
    append = out.append
    unpack = HEADER.unpack_from
    mv = memoryview(chunk)
    topic_b = topic.encode()
    pos = 0
    qoff = first
    try:
        for size in sizes:
            f = unpack(chunk, pos)
            body_at = pos + HEADER_SIZE
            end_body = body_at + f[14]
            end_topic = end_body + f[15]
            end = pos + size
            if (
                f[1] != MESSAGE_MAGIC
                or f[0] != size
                or f[6] != first_phys + pos
                or end_topic + f[16] != end
                or f[14] < 0
                or f[3] != queue_id
                or f[5] != qoff
                or chunk[end_body:end_topic] != topic_b
            ):
                raise CorruptRecordError(
                    where=f"{topic}/{queue_id} offset {qoff} (physical {first_phys + pos})",
                    detail="the record there does not match its queue entry "
                    "(magic, size, offset, topic or queue)",
                )
            if verify_crc and crc32(mv[pos + 12 : end]) != f[2]:
                raise CorruptRecordError(
                    where=f"{topic}/{queue_id} offset {qoff} (physical {first_phys + pos})",
                    detail="CRC mismatch",
                )
            try:
                props = str(chunk[end_topic:end], "utf-8")
            except UnicodeDecodeError as exc:
                raise CorruptRecordError(
                    where=f"{topic}/{queue_id} offset {qoff} (physical {first_phys + pos})",
                    detail=f"undecodable properties: {exc}",
                ) from exc
            append(_new_stored(StoredMessage, (*f, topic, chunk[body_at:end_body], props)))
            pos = end
            qoff += 1
    finally:
        mv.release()
    return out
