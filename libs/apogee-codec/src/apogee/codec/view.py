"""Records decoded where they lie: what a consumer makes of a pull's answer.

A pull answers with whole CommitLog records back to back, in queue order (the layout is drawn in
:mod:`apogee.codec.layout`). :func:`decode_records` checks every record and wraps each in a
:class:`RecordView` (or a subclass: the SDK's ``ReceivedMessage``).

Consumers aim at hundreds of thousands of messages per second, so decoding does the least it
can: the header is unpacked once into slots, and the rest waits for first use. The body is
sliced out (and decompressed when the system flag :data:`SYSFLAG_COMPRESSED` says so) when
``body`` is first read; properties, tags, keys and the unique id are parsed together when one
of them is first read; hosts are decoded when read. Each view keeps a reference to the buffer
until then, so a pull's bytes live as long as any of its messages.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Final, NoReturn, TypeVar

from apogee.codec.crc import crc32
from apogee.codec.layout import (
    CRC_FROM,
    HEADER_SIZE,
    HOST_SIZE,
    MESSAGE_MAGIC,
    OFFSET,
    SYSFLAG_COMPRESSED,
    decode_host,
    header_struct,
)
from apogee.codec.properties import NAME_SEP, PROP_KEYS, PROP_SEP, PROP_TAGS, PROP_UNIQ_KEY
from apogee.common.errors import CorruptRecordError

__all__ = ["RecordView", "decode_records"]

_BORN_HOST_AT: Final = OFFSET["born_host_raw"]
_STORE_HOST_AT: Final = OFFSET["store_host_raw"]
#: The header as decoding reads it: the hosts are stepped over (decoded when read).
_FIELDS: Final = header_struct(skip=("born_host_raw", "store_host_raw"))
assert _FIELDS.size == HEADER_SIZE

#: tags, keys, unique id and user properties, parsed together on first use
_Meta = tuple[str, tuple[str, ...], str, dict[str, str]]


class RecordView:
    """One record of a pull's answer, read in place (see the module's docstring).

    ``properties`` holds the user's properties only (tags, keys and the unique id are
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
        raise TypeError(f"{type(self).__name__} objects come from decode_records()")

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
    def all_properties(self) -> dict[str, str]:
        """Every property as the record keeps them, ``TAGS``, ``KEYS`` and ``UNIQ_KEY``
        included (what an SQL92 filter sees)."""
        tags, keys, unique_id, props = self._meta or self._parse_properties()
        out = dict(props)
        if tags:
            out[PROP_TAGS] = tags
        if keys:
            out[PROP_KEYS] = " ".join(keys)
        if unique_id:
            out[PROP_UNIQ_KEY] = unique_id
        return out

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
    def properties_bytes(self) -> bytes:
        """The properties section as stored (UTF-8 ``name\\x01value\\x02`` pairs, tags, keys
        and the unique id among them), not decoded: for readers that parse many records'
        properties at once (the Spark source splits them column by column)."""
        start = self._pos + HEADER_SIZE + self._blen + self._tlen
        return self._buf[start : self._pos + self.size]

    @property
    def born_host(self) -> str:
        """``ip:port`` of the producer, ``""`` when unknown."""
        at = self._pos + _BORN_HOST_AT
        return decode_host(self._buf[at : at + HOST_SIZE])

    @property
    def store_host(self) -> str:
        """``ip:port`` of the broker that stored the message, ``""`` when unknown."""
        at = self._pos + _STORE_HOST_AT
        return decode_host(self._buf[at : at + HOST_SIZE])

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


V = TypeVar("V", bound=RecordView)
_new_view = object.__new__


def decode_records(
    buf: bytes,
    broker_name: str,
    topic: str,
    queue_id: int,
    first_offset: int,
    verify_crc: bool = True,
    *,
    cls: type[V],
    start: int = 0,
    end: int | None = None,
) -> list[V]:
    """The records in ``buf[start:end]`` (all of ``buf`` by default) as ``cls`` views: the
    records of one pull of ``topic``/``queue_id`` from ``broker_name`` that started at
    ``first_offset``. The views refer to ``buf`` itself (no copy is made): a pull's records are
    decoded where they arrived.

    Every record is checked: its magic, that its size matches its parts and fits in ``buf``,
    its CRC-32 (unless ``verify_crc`` is false), that it belongs to that topic and queue, and
    that queue offsets ascend from at least ``first_offset`` (a tag filter may skip some).
    Raises :class:`~apogee.common.errors.CorruptRecordError` naming the broker, topic, queue and
    offset of the first record that fails."""
    out: list[V] = []
    append = out.append
    unpack = _FIELDS.unpack_from
    new = _new_view
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
            (
                size,
                magic,
                crc,
                qid,
                flag,
                qoff,
                phys,
                sys_flag,
                born_ts,
                store_ts,
                reconsume,
                _prepared,
                blen,
                rec_tlen,
                plen,
            ) = unpack(buf, pos)
            stop = pos + size
            if (
                magic != MESSAGE_MAGIC
                or blen < 0
                or stop > total
                or HEADER_SIZE + blen + rec_tlen + plen != size
                or (verify_crc and crc32(mv[pos + CRC_FROM : stop]) != crc)
                or qid != queue_id
                or rec_tlen != tlen
                or not buf.startswith(topic_b, pos + HEADER_SIZE + blen)
                or qoff <= last
            ):
                _refuse(
                    buf,
                    pos,
                    start,
                    total,
                    broker_name,
                    topic,
                    queue_id,
                    first_offset,
                    last,
                    verify_crc,
                )
            m = new(cls)
            m.topic = topic
            m.broker_name = broker_name
            m.queue_id = queue_id
            m.flag = flag
            m.queue_offset = qoff
            m.phys_offset = phys
            m.sys_flag = sys_flag
            m.born_timestamp_ms = born_ts
            m.store_timestamp_ms = store_ts
            m.reconsume_times = reconsume
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


def _refuse(
    buf: bytes,
    pos: int,
    start: int,
    total: int,
    broker_name: str,
    topic: str,
    queue_id: int,
    first_offset: int,
    last: int,
    verify_crc: bool,
) -> NoReturn:
    """Raise for the record at ``pos``, which failed a check of :func:`decode_records`: the
    checks again, in the same order, to name the first that fails."""
    size, magic, crc, qid, _flag, qoff, *_, blen, tlen, plen = _FIELDS.unpack_from(buf, pos)
    where = f"at offset {qoff}"
    stop = pos + size
    at = pos + HEADER_SIZE + blen
    if magic != MESSAGE_MAGIC:
        where, detail = _after(last, first_offset), f"magic {magic:#x} is not a message's"
    elif blen < 0 or stop > total or HEADER_SIZE + blen + tlen + plen != size:
        detail = f"size {size} does not match its parts or the {total - pos} bytes left"
    elif verify_crc and crc32(memoryview(buf)[pos + CRC_FROM : stop]) != crc:
        detail = "CRC mismatch"
    elif qid != queue_id or tlen != len(topic.encode()) or not buf.startswith(topic.encode(), at):
        detail = f"the record is of {str(buf[at : at + tlen], 'utf-8', 'replace')}/{qid}"
    else:
        detail = f"queue offsets must ascend from {first_offset}" + (
            f"; the record before was at {last}" if last >= first_offset else ""
        )
    _corrupt(broker_name, topic, queue_id, where, pos - start, detail)


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
