"""Records encoded and decoded: :func:`encode_record`, and :func:`decode` / :func:`decode_run`
into :class:`StoredMessage` (every field read at once, as the broker and the store want them).
Consumers decode pulled records lazily instead: :mod:`apogee.codec.view`.

The layout is drawn in :mod:`apogee.codec.layout`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from apogee.codec.crc import crc32
from apogee.codec.layout import (
    BODY_LENGTH,
    CRC,
    CRC_FROM,
    EMPTY_HOST,
    FIELD_NAMES,
    HEAD,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MESSAGE_MAGIC,
    PHYS_OFFSET,
    PROPERTIES_LENGTH,
    QUEUE_ID,
    QUEUE_OFFSET,
    SIZE,
    TAIL,
    TOPIC_LENGTH,
    decode_host,
    encode_host,
)
from apogee.codec.properties import (
    PROP_KEYS,
    PROP_TAGS,
    PROP_UNIQ_KEY,
    decode_properties,
    encode_properties,
)
from apogee.common.errors import CorruptRecordError


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


assert StoredMessage._fields[: len(FIELD_NAMES)] == FIELD_NAMES


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
    rsize = f[SIZE]
    if f[MAGIC] != MESSAGE_MAGIC:
        raise CorruptRecordError(where=where, detail=f"magic {f[MAGIC]:#x} is not a message's")
    blen = f[BODY_LENGTH]
    end_body = pos + HEADER_SIZE + blen
    end_topic = end_body + f[TOPIC_LENGTH]
    if rsize != avail or end_topic + f[PROPERTIES_LENGTH] != pos + rsize or blen < 0:
        raise CorruptRecordError(
            where=where, detail=f"size {rsize} does not match its parts or the {avail} read"
        )
    if verify_crc and crc32(memoryview(buf)[pos + CRC_FROM : pos + rsize]) != f[CRC]:
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
            end_body = body_at + f[BODY_LENGTH]
            end_topic = end_body + f[TOPIC_LENGTH]
            end = pos + size
            if (
                f[MAGIC] != MESSAGE_MAGIC
                or f[SIZE] != size
                or f[PHYS_OFFSET] != first_phys + pos
                or end_topic + f[PROPERTIES_LENGTH] != end
                or f[BODY_LENGTH] < 0
                or f[QUEUE_ID] != queue_id
                or f[QUEUE_OFFSET] != qoff
                or chunk[end_body:end_topic] != topic_b
            ):
                raise CorruptRecordError(
                    where=f"{topic}/{queue_id} offset {qoff} (physical {first_phys + pos})",
                    detail="the record there does not match its queue entry "
                    "(magic, size, offset, topic or queue)",
                )
            if verify_crc and crc32(mv[pos + CRC_FROM : end]) != f[CRC]:
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
    props = encode_properties(tags, keys, unique_id, properties).encode()
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
