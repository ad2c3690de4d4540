"""Send records: CommitLog records as their sender writes them, before the log places them.

A producer encodes each message once, in the record layout of :mod:`apogee.codec.layout`, and
a broker appends those bytes as they are (the store's ``MessageStore.append_records``), writing
into them only what the log assigns. In a send record the fields the log assigns are placeholders
(zero), and two of them carry what only the broker reads::

     0       4       8       12      16      20              28              36      40
     +-------+-------+-------+-------+-------+---------------+---------------+-------+
     | size  | magic | 0     | queue | flag  | delay level   | deliver at ms | sysflg|
     +-------+-------+-------+-------+-------+---------------+---------------+-------+
     40              48              56                  74                  92
     +---------------+---------------+-------------------+-------------------+
     | born ts (ms)  | 0             | born host or 0    | 0                 |
     +---------------+---------------+-------------------+-------------------+
     92 ... the rest as in a stored record: reconsume times, prepared txn offset, lengths,
        body, topic, properties (with ``UNIQ_KEY``, ``TAGS`` and ``KEYS``)

On append the log writes: the queue offset over the delay level, the physical offset over the
delivery time (a broker stores a delayed or timer message through the ordinary path instead,
since its topic and properties change), the store timestamp and host, the born timestamp and
host where the sender left them zero, and the CRC over the finished record.

:func:`own_fields` reads the properties a record's own fields are kept under (tags, keys,
unique id) without building a dict, for the queue and index entries.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Final

from apogee.codec.layout import EMPTY_HOST, HEADER, HEADER_SIZE, MESSAGE_MAGIC, OFFSET
from apogee.codec.properties import NAME_SEP, OWN_FIELDS, PROP_SEP, decode_properties
from apogee.common.errors import InvalidArgumentError

#: Where the log writes a record's queue and physical offsets (over delay level and time).
PLACED_AT: Final = OFFSET["queue_offset"]
PLACED: Final = struct.Struct("<qq")
#: Born timestamp, store timestamp, born host, store host (back to back from BORN_AT).
BORN_AT: Final = OFFSET["born_timestamp"]
STAMPED: Final = struct.Struct("<qq18s18s")
#: The born timestamp and born host as the sender left them.
BORN: Final = struct.Struct("<q8x18s")
CRC_AT: Final = OFFSET["crc"]
CRC: Final = struct.Struct("<I")
#: A record's queue id, which a sender sets for each attempt.
QUEUE_AT: Final = OFFSET["queue_id"]
QUEUE_ID: Final = struct.Struct("<i")
#: Size, magic, CRC placeholder, queue id.
FRAME: Final = struct.Struct("<iIIi")
#: Body, topic and properties lengths.
LENGTHS_AT: Final = OFFSET["body_length"]
LENGTHS: Final = struct.Struct("<iHH")
assert PLACED_AT + PLACED.size == OFFSET["sys_flag"]
assert BORN_AT + STAMPED.size == OFFSET["reconsume_times"]
assert OFFSET["store_host_raw"] - OFFSET["born_timestamp"] == 34

#: What the store needs of each send record besides its bytes: (topic, queue id, size, tag
#: code, keys, unique id), as the caller read them from the record.
RecordRef = tuple[str, int, int, int, Sequence[str], str]

_TAGS: Final = "TAGS" + NAME_SEP
_KEYS: Final = "KEYS" + NAME_SEP
_UNIQ: Final = "UNIQ_KEY" + NAME_SEP
_OWN: Final = (_TAGS, _KEYS, _UNIQ)


def encode_send_record(
    topic: bytes,
    body: bytes,
    properties: bytes,
    queue_id: int = 0,
    flag: int = 0,
    sys_flag: int = 0,
    born_timestamp: int = 0,
    delay_level: int = 0,
    deliver_at_ms: int = 0,
) -> bytearray:
    """One send record (mutable, so that each attempt can set its queue id with
    ``QUEUE_ID.pack_into(record, QUEUE_AT, queue_id)``). ``properties`` as
    :func:`encode_properties` writes them; the caller has checked every field."""
    blen = len(body)
    tlen = len(topic)
    plen = len(properties)
    head = HEADER.pack(
        HEADER_SIZE + blen + tlen + plen,
        MESSAGE_MAGIC,
        0,
        queue_id,
        flag,
        delay_level,
        deliver_at_ms,
        sys_flag,
        born_timestamp,
        0,
        EMPTY_HOST,
        EMPTY_HOST,
        0,
        0,
        blen,
        tlen,
        plen,
    )
    return _EMPTY.join((head, body, topic, properties))


_EMPTY: Final = bytearray()


def encode_properties(
    tags: str | None, keys: Sequence[str], unique_id: str, user: Mapping[str, str] | None
) -> bytes:
    """A record's properties in the order a producer writes them: the message's own entries
    (``TAGS``, ``KEYS``, ``UNIQ_KEY``) first, then the user's (their own names skipped)."""
    parts = [f"TAGS\x01{tags}\x02" if tags else "", f"KEYS\x01{' '.join(keys)}\x02" if keys else ""]
    parts.append(f"UNIQ_KEY\x01{unique_id}\x02")
    if user:
        for name, value in user.items():
            if name not in OWN_FIELDS:
                parts.append(f"{name}\x01{value}\x02")
    return "".join(parts).encode()


def check_send_records(buf: bytes | bytearray, refs: Sequence[RecordRef], max_queues: int) -> None:
    """Raise :class:`InvalidArgumentError` unless ``buf`` is exactly the records of ``refs``,
    back to back: each with the message magic, its ref's size (equal to its parts), queue id
    (below ``max_queues``) and topic."""
    at = 0
    topics: dict[str, bytes] = {}
    unpack_frame = FRAME.unpack_from
    unpack_lengths = LENGTHS.unpack_from
    for i, (topic, qid, size, _, _, _) in enumerate(refs):
        if at + HEADER_SIZE > len(buf):
            raise _bad(i, at, "the block ends inside its header")
        rsize, magic, _, rqid = unpack_frame(buf, at)
        blen, tlen, plen = unpack_lengths(buf, at + LENGTHS_AT)
        topic_b = topics.get(topic)
        if topic_b is None:
            topic_b = topics[topic] = topic.encode()
        topic_at = at + HEADER_SIZE + blen
        if (
            magic != MESSAGE_MAGIC
            or rsize != size
            or blen < 0
            or HEADER_SIZE + blen + tlen + plen != size
            or at + size > len(buf)
            or rqid != qid
            or not 0 <= qid < max_queues
            or buf[topic_at : topic_at + tlen] != topic_b
        ):
            raise _bad(i, at, "its magic, size, queue id or topic does not match what was given")
        at += size
    if at != len(buf):
        raise _bad(len(refs), at, f"{len(buf) - at} bytes follow the last record")


def _bad(i: int, at: int, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(field=f"records[{i}] (at byte {at})", rule=what)


def own_fields(props: str) -> tuple[str | None, tuple[str, ...], str, bool]:
    """``(tags, keys, unique id, canonical)`` of a record's properties. ``canonical``: they
    start with the message's own entries in the order a producer writes them (``TAGS``,
    ``KEYS``, ``UNIQ_KEY``, each optional but the last) and the rest repeats none of them;
    otherwise the values come from the parsed properties (the last entry of a name wins, as
    for a reader)."""
    tags: str | None = None
    keys: tuple[str, ...] = ()
    at = 0
    if props.startswith(_TAGS):
        end = props.find(PROP_SEP, 5)
        if end > 5:
            tags = props[5:end]
            at = end + 1
    if props.startswith(_KEYS, at):
        end = props.find(PROP_SEP, at + 5)
        if end > at + 5:
            keys = tuple(props[at + 5 : end].split(" "))
            at = end + 1
    if props.startswith(_UNIQ, at):
        end = props.find(PROP_SEP, at + 9)
        if end > at + 9:
            rest = props[end + 1 :]
            if not rest or not any(name in rest for name in _OWN):
                return tags, keys, props[at + 9 : end], True
    parsed = decode_properties(props)
    raw_keys = parsed.get("KEYS")
    return (
        parsed.get("TAGS") or None,
        tuple(raw_keys.split(" ")) if raw_keys else (),
        parsed.get("UNIQ_KEY", ""),
        False,
    )
