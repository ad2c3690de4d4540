"""Messages as consumers receive them, decoded from the records a pull returns.

A pull (``apogee.v1.Consumer.Pull``) answers with whole CommitLog records back to back, in
queue order; the byte layout is drawn in :mod:`apogee.store.records` (112-byte header, body,
topic, properties). :func:`decode_records` checks every record and wraps each in a
:class:`ReceivedMessage`.

Consumers aim at hundreds of thousands of messages per second, so decoding does the least it
can: the header is unpacked once into slots, and the rest waits for first use. The body is
sliced out (and decompressed when the system flag :data:`SYSFLAG_COMPRESSED` says so) when
``body`` is first read; properties, tags, keys and the unique id are parsed together when one
of them is first read; hosts are decoded when read. Each message keeps a reference to the
pull's buffer until then, so a pull's bytes live as long as any of its messages.

:func:`encode_record` is the inverse of the decoding, for tests and tools: it writes a record
exactly as a broker's CommitLog does.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Final, NoReturn

from apogee.common.errors import CorruptRecordError
from apogee.store.crc import crc32
from apogee.store.records import (
    EMPTY_HOST,
    HEAD,
    HEADER_SIZE,
    MESSAGE_MAGIC,
    NAME_SEP,
    PROP_KEYS,
    PROP_SEP,
    PROP_TAGS,
    PROP_UNIQ_KEY,
    SYSFLAG_COMPRESSED,
    TAIL,
    decode_host,
    encode_host,
)

__all__ = ["SYSFLAG_COMPRESSED", "ReceivedMessage", "decode_records", "encode_record"]

#: Where the hosts sit in a record (see the drawing in :mod:`apogee.store.records`).
_BORN_HOST_AT: Final = 56
_STORE_HOST_AT: Final = 74
_HOST_SIZE: Final = 18
_CRC_FROM: Final = 12
#: The header as decoding reads it: the hosts are skipped (decoded when read), so the fields
#: are size, magic, crc, queue id, flag, queue offset, phys offset, sys flag, born and store
#: timestamps, reconsume times, prepared offset, body, topic and properties lengths.
_FIELDS: Final = struct.Struct("<iIIiiqqiqq36xiqiHH")
assert _FIELDS.size == HEADER_SIZE

#: tags, keys, unique id and user properties, parsed together on first use
_Meta = tuple[str, tuple[str, ...], str, dict[str, str]]


class ReceivedMessage:
    """One message handed to a consumer.

    The attributes that a :class:`~apogee.client.StoredMessage` has carry the same names and
    meaning; ``properties`` holds the user's properties only (tags, keys and the unique id are
    attributes of their own). ``size`` is the record's size in bytes (what flow control counts).
    Instances come from :func:`decode_records`.
    """

    __slots__ = (
        "_blen",
        "_body",
        "_buf",
        "_meta",
        "_pos",
        "_tlen",
        "born_timestamp_ms",
        "broker_name",
        "flag",
        "phys_offset",
        "queue_id",
        "queue_offset",
        "reconsume_times",
        "size",
        "store_timestamp_ms",
        "sys_flag",
        "topic",
    )

    topic: str
    broker_name: str
    queue_id: int
    queue_offset: int
    phys_offset: int
    flag: int
    sys_flag: int
    born_timestamp_ms: int
    store_timestamp_ms: int
    reconsume_times: int
    size: int
    _buf: bytes
    _pos: int
    _blen: int
    _tlen: int
    # None until first use
    _body: bytes | None
    _meta: _Meta | None

    def __init__(self) -> None:
        raise TypeError("ReceivedMessage objects come from decode_records()")

    # -- lazily decoded parts -----------------------------------------------------------------

    @property
    def body(self) -> bytes:
        """The body, decompressed when it was stored compressed."""
        body = self._body
        if body is None:
            at = self._pos + HEADER_SIZE
            body = self._buf[at : at + self._blen]
            if self.sys_flag & SYSFLAG_COMPRESSED:
                try:
                    body = zlib.decompress(body)
                except zlib.error as exc:
                    raise CorruptRecordError(
                        where=self._where(), detail=f"the compressed body does not inflate: {exc}"
                    ) from None
            self._body = body
        return body

    @property
    def properties(self) -> Mapping[str, str]:
        """The user's properties (without ``TAGS``, ``KEYS`` and ``UNIQ_KEY``)."""
        return (self._meta or self._parse_properties())[3]

    @property
    def tags(self) -> str:
        """The message's tag, ``""`` when it has none."""
        return (self._meta or self._parse_properties())[0]

    @property
    def keys(self) -> tuple[str, ...]:
        return (self._meta or self._parse_properties())[1]

    @property
    def unique_id(self) -> str:
        """The id the producer gave the message (what lookups by id take)."""
        return (self._meta or self._parse_properties())[2]

    @property
    def message_id(self) -> str:
        """The same as :attr:`unique_id`."""
        return (self._meta or self._parse_properties())[2]

    @property
    def born_host(self) -> str:
        """``ip:port`` of the producer, ``""`` when unknown."""
        at = self._pos + _BORN_HOST_AT
        return decode_host(self._buf[at : at + _HOST_SIZE])

    @property
    def store_host(self) -> str:
        """``ip:port`` of the broker that stored the message, ``""`` when unknown."""
        at = self._pos + _STORE_HOST_AT
        return decode_host(self._buf[at : at + _HOST_SIZE])

    @property
    def compressed(self) -> bool:
        """Whether the body travelled and is stored compressed."""
        return bool(self.sys_flag & SYSFLAG_COMPRESSED)

    def _parse_properties(self) -> _Meta:
        start = self._pos + HEADER_SIZE + self._blen + self._tlen
        try:
            text = str(self._buf[start : self._pos + self.size], "utf-8")
        except UnicodeDecodeError as exc:
            raise CorruptRecordError(
                where=self._where(), detail=f"undecodable properties: {exc}"
            ) from None
        props: dict[str, str] = {}
        for item in text.split(PROP_SEP):
            if item:
                name, _, value = item.partition(NAME_SEP)
                props[name] = value
        keys = props.pop(PROP_KEYS, "")
        meta = (
            props.pop(PROP_TAGS, ""),
            tuple(keys.split(" ")) if keys else (),
            props.pop(PROP_UNIQ_KEY, ""),
            props,
        )
        self._meta = meta
        return meta

    def _where(self) -> str:
        return (
            f"message of {self.topic}/{self.queue_id} at offset {self.queue_offset} "
            f"from broker {self.broker_name}"
        )

    def __repr__(self) -> str:
        return (
            f"ReceivedMessage(topic={self.topic!r}, broker_name={self.broker_name!r}, "
            f"queue_id={self.queue_id}, queue_offset={self.queue_offset}, "
            f"unique_id={self.unique_id!r}, size={self.size})"
        )


_new_message = object.__new__


def decode_records(
    buf: bytes,
    broker_name: str,
    topic: str,
    queue_id: int,
    first_offset: int,
    verify_crc: bool = True,
    *,
    start: int = 0,
    end: int | None = None,
) -> list[ReceivedMessage]:
    """The messages in ``buf[start:end]`` (all of ``buf`` by default), the records of one pull
    of ``topic``/``queue_id`` from ``broker_name`` that started at ``first_offset``. The
    messages refer to ``buf`` itself (no copy is made): a pull's records are decoded where
    they arrived.

    Every record is checked: its magic, that its size matches its parts and fits in ``buf``,
    its CRC-32 (unless ``verify_crc`` is false), that it belongs to that topic and queue, and
    that queue offsets ascend from at least ``first_offset`` (a tag filter may skip some).
    Raises :class:`~apogee.common.errors.CorruptRecordError` naming the broker, topic, queue and
    offset of the first record that fails."""
    out: list[ReceivedMessage] = []
    append = out.append
    unpack = _FIELDS.unpack_from
    new = _new_message
    cls = ReceivedMessage
    topic_b = topic.encode()
    tlen = len(topic_b)
    total = len(buf) if end is None else end
    if not 0 <= start <= total <= len(buf):
        raise ValueError(f"records from byte {start} to {total} do not lie in {len(buf)} bytes")
    pos = start
    last = first_offset - 1
    mv = memoryview(buf)
    try:
        while pos < total:
            if total - pos < HEADER_SIZE:
                _corrupt(
                    broker_name,
                    topic,
                    queue_id,
                    _after(last, first_offset),
                    pos - start,
                    f"{total - pos} bytes left, shorter than a record header",
                )
            f = unpack(buf, pos)
            size = f[0]
            blen = f[12]
            stop = pos + size
            qoff = f[5]
            if f[1] != MESSAGE_MAGIC:
                _corrupt(
                    broker_name,
                    topic,
                    queue_id,
                    _after(last, first_offset),
                    pos - start,
                    f"magic {f[1]:#x} is not a message's",
                )
            if blen < 0 or stop > total or HEADER_SIZE + blen + f[13] + f[14] != size:
                _corrupt(
                    broker_name,
                    topic,
                    queue_id,
                    f"at offset {qoff}",
                    pos - start,
                    f"size {size} does not match its parts or the {total - pos} bytes left",
                )
            if verify_crc and crc32(mv[pos + _CRC_FROM : stop]) != f[2]:
                _corrupt(
                    broker_name, topic, queue_id, f"at offset {qoff}", pos - start, "CRC mismatch"
                )
            if (
                f[3] != queue_id
                or f[13] != tlen
                or not buf.startswith(topic_b, pos + HEADER_SIZE + blen)
            ):
                _corrupt(
                    broker_name,
                    topic,
                    queue_id,
                    f"at offset {qoff}",
                    pos - start,
                    f"the record is of {_topic_of(buf, pos, f)}/{f[3]}",
                )
            if qoff <= last:
                _corrupt(
                    broker_name,
                    topic,
                    queue_id,
                    f"at offset {qoff}",
                    pos - start,
                    f"queue offsets must ascend from {first_offset}"
                    + (f"; the record before was at {last}" if last >= first_offset else ""),
                )
            m = new(cls)
            m.topic = topic
            m.broker_name = broker_name
            m.queue_id = queue_id
            m.flag = f[4]
            m.queue_offset = qoff
            m.phys_offset = f[6]
            m.sys_flag = f[7]
            m.born_timestamp_ms = f[8]
            m.store_timestamp_ms = f[9]
            m.reconsume_times = f[10]
            m.size = size
            m._buf = buf
            m._pos = pos
            m._blen = blen
            m._tlen = tlen
            m._body = None
            m._meta = None
            append(m)
            last = qoff
            pos = stop
    finally:
        mv.release()
    return out


def _topic_of(buf: bytes, pos: int, f: tuple[Any, ...]) -> str:
    at = pos + HEADER_SIZE + f[12]
    return str(buf[at : at + f[13]], "utf-8", "replace")


def _after(last: int, first_offset: int) -> str:
    if last >= first_offset:
        return f"after offset {last}"
    return f"at the first record (the pull started at offset {first_offset})"


def _corrupt(
    broker_name: str, topic: str, queue_id: int, where: str, pos: int, detail: str
) -> NoReturn:
    raise CorruptRecordError(
        where=f"a pull from broker {broker_name}: {topic}/{queue_id} {where} "
        f"(byte {pos} of the response)",
        detail=detail,
    )


def encode_record(
    topic: str,
    queue_id: int,
    queue_offset: int,
    body: bytes = b"",
    *,
    tags: str = "",
    keys: Sequence[str] = (),
    unique_id: str = "",
    properties: Mapping[str, str] | None = None,
    phys_offset: int = 0,
    flag: int = 0,
    sys_flag: int = 0,
    born_timestamp_ms: int = 0,
    store_timestamp_ms: int = 0,
    born_host: str = "",
    store_host: str = "",
    reconsume_times: int = 0,
) -> bytes:
    """One CommitLog record as a broker writes it (``body`` as stored: already compressed when
    ``sys_flag`` says so). For tests and tools; brokers write records with their store."""
    parts = []
    if tags:
        parts.append(f"{PROP_TAGS}{NAME_SEP}{tags}{PROP_SEP}")
    if keys:
        parts.append(f"{PROP_KEYS}{NAME_SEP}{' '.join(keys)}{PROP_SEP}")
    if unique_id:
        parts.append(f"{PROP_UNIQ_KEY}{NAME_SEP}{unique_id}{PROP_SEP}")
    for name, value in (properties or {}).items():
        parts.append(f"{name}{NAME_SEP}{value}{PROP_SEP}")
    props = "".join(parts).encode()
    topic_b = topic.encode()
    tail = TAIL.pack(
        queue_id,
        flag,
        queue_offset,
        phys_offset,
        sys_flag,
        born_timestamp_ms,
        store_timestamp_ms,
        encode_host(born_host) if born_host else EMPTY_HOST,
        encode_host(store_host) if store_host else EMPTY_HOST,
        reconsume_times,
        0,
        len(body),
        len(topic_b),
        len(props),
    )
    size = HEADER_SIZE + len(body) + len(topic_b) + len(props)
    crc = crc32(props, crc32(topic_b, crc32(body, crc32(tail))))
    return HEAD.pack(size, MESSAGE_MAGIC, crc) + tail + body + topic_b + props
