"""What a transaction leaves in the CommitLog: half copies and op records, drawn once.

Both are ordinary CommitLog records (:mod:`apogee.codec.layout`); what makes them a transaction's
is their topic and their properties.

A **half copy** (``RMQ_SYS_TRANS_HALF_TOPIC`` queue 0) is the producer's message as sent, with
its body, flags, tags, keys, born time and host and its user properties, plus::

    +---------------------------------+-------------------------------------------------------+
    | UNIQ_KEY                        | the transaction id: the message's unique id (the      |
    |                                 | broker's when the producer gave none); every copy of  |
    |                                 | one transaction has it                                |
    | REAL_TOPIC / REAL_QID           | where a commit stores the message                     |
    | TRAN_MSG                        | "true"                                                |
    | PGROUP                          | the producer group, whose producers are asked about it|
    | TRANSACTION_CHECK_TIMES         | checks so far; absent: 0                              |
    | TRAN_FIRST_STORED               | store time (ms) of the transaction's first copy;      |
    |                                 | absent on the first copy (its own store time)         |
    | CHECK_IMMUNITY_TIME_IN_SECONDS  | the producer's, optional: 1 to 86400                  |
    +---------------------------------+-------------------------------------------------------+

Each check puts a new copy at the end of the half queue (``TRANSACTION_CHECK_TIMES`` one higher,
``TRAN_FIRST_STORED`` set) and closes the old one. A copy checked ``max_check_times`` times goes,
with every property kept, to ``TRANS_CHECK_MAX_TIME_TOPIC`` queue 0, where an operator can still
end it.

An **op record** (``RMQ_SYS_TRANS_OP_HALF_TOPIC`` queue 0) closes one copy: a copy is *closed*
once an op record names it, and the scan of the half queue passes over it (RocketMQ's remove
map). One per closed copy::

    +-------------+-----------------------------------------------------------------------------+
    | body        | the closed copy's queue offset, decimal ASCII: b"1234"                      |
    | tags        | "d" (RocketMQ's REMOVETAG)                                                  |
    | keys        | the transaction id, and "half@1234" for a copy of the half queue: the       |
    |             | IndexFile finds a transaction's op records, and a copy's, without a scan    |
    | UNIQ_KEY    | a fresh id of the broker's (not the transaction's)                          |
    | TXN_ID      | the transaction id; absent for GONE (the copy could not be read)            |
    | TXN_OP      | COMMIT, ROLLBACK  the transaction was decided (the decision, kept forever)  |
    |             | CHECKED           a check put the copy again, at the end of the half queue  |
    |             | GAVE_UP           checked max_check_times times: moved to                   |
    |             |                   TRANS_CHECK_MAX_TIME_TOPIC                                |
    |             | GONE              the copy was removed by retention or cannot be read       |
    | PGROUP      | the copy's producer group (absent for GONE)                                 |
    | REAL_TOPIC, | of COMMIT: the topic and queue the real message went to                     |
    | REAL_QID    |                                                                             |
    | TXN_COPY_   | absent: the copy is in the half queue; else the topic of the copy the       |
    | TOPIC       | record stands for (TRANS_CHECK_MAX_TIME_TOPIC: a decision on a transaction  |
    |             | that ran out of checks, whose body is then that topic's queue offset)       |
    +-------------+-----------------------------------------------------------------------------+

A commit stores the real message and its op records in one append, the real message first: a
crash can lose the op records but never keep a decision whose message is missing (the producer
then ends the transaction again, and the commit may be stored twice: at least once).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple

from apogee.codec import (
    HEAD,
    OWN_FIELDS,
    PROP_CHECK_IMMUNITY,
    PROP_KEYS,
    PROP_PRODUCER_GROUP,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_TAGS,
    PROP_TRAN_FIRST_STORED,
    PROP_TRAN_MSG,
    PROP_TRANSACTION_CHECK_TIMES,
    PROP_UNIQ_KEY,
    Message,
    StoredMessage,
    check_immunity_rule,
    decode,
    encode_properties,
)
from apogee.common.errors import CorruptRecordError
from apogee.common.topics import TRANS_CHECK_MAX_TIME_TOPIC, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC
from apogee.store import AppendResult

log = logging.getLogger(__name__)

#: Tags of every op record (RocketMQ's TransactionalMessageUtil.REMOVETAG).
OP_TAGS: Final = "d"
OP_TXN_ID: Final = "TXN_ID"
OP_KIND: Final = "TXN_OP"
OP_COPY_TOPIC: Final = "TXN_COPY_TOPIC"
#: The key of an op record that names the copy it closes.
COPY_KEY_PREFIX: Final = "half@"

#: What a half copy carries that its real message does not: removed on commit.
TRANSACTION_PROPERTIES: Final = frozenset(
    {
        PROP_REAL_TOPIC,
        PROP_REAL_QID,
        PROP_TRAN_MSG,
        PROP_PRODUCER_GROUP,
        PROP_TRANSACTION_CHECK_TIMES,
        PROP_TRAN_FIRST_STORED,
        PROP_CHECK_IMMUNITY,
    }
)


class Decision(enum.Enum):
    """What a producer (or operator) says of a transaction."""

    COMMIT = "COMMIT"
    ROLLBACK = "ROLLBACK"
    #: not known yet: nothing changes
    UNKNOWN = "UNKNOWN"


class OpKind(enum.Enum):
    """Why an op record closed its copy (its ``TXN_OP``)."""

    COMMIT = "COMMIT"
    ROLLBACK = "ROLLBACK"
    CHECKED = "CHECKED"
    GAVE_UP = "GAVE_UP"
    GONE = "GONE"

    @property
    def decision(self) -> Decision | None:
        """The decision this op records, if it records one."""
        return _DECISIONS.get(self)


_DECISIONS: Final = {OpKind.COMMIT: Decision.COMMIT, OpKind.ROLLBACK: Decision.ROLLBACK}
_OP_KINDS: Final = {k.value: k for k in OpKind}


def op_kind_of(decision: Decision) -> OpKind:
    """The op of a decision (COMMIT or ROLLBACK)."""
    return OpKind.COMMIT if decision is Decision.COMMIT else OpKind.ROLLBACK


# -- half copies --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HalfInfo:
    """What the broker reads of a stored copy (in the half queue or in
    TRANS_CHECK_MAX_TIME_TOPIC)."""

    topic: str
    queue_offset: int
    phys_offset: int
    store_timestamp: int
    unique_id: str
    producer_group: str
    real_topic: str
    real_queue_id: int
    check_times: int
    #: CHECK_IMMUNITY_TIME_IN_SECONDS in ms; 0: none given
    immunity_ms: int
    first_stored_ms: int
    keys: str

    @property
    def in_half_queue(self) -> bool:
        return self.topic == TRANS_HALF_TOPIC


def half_info(copy: StoredMessage, props: Mapping[str, str] | None = None) -> HalfInfo:
    """The transaction fields of ``copy`` (``props``: its properties, when already decoded);
    what is missing or malformed reads as absent (0, "")."""
    if props is None:
        props = copy.properties
    immunity = props.get(PROP_CHECK_IMMUNITY, "")
    return HalfInfo(
        copy.topic,
        copy.queue_offset,
        copy.phys_offset,
        copy.store_timestamp,
        props.get(PROP_UNIQ_KEY, ""),
        props.get(PROP_PRODUCER_GROUP, ""),
        props.get(PROP_REAL_TOPIC, ""),
        _count(props.get(PROP_REAL_QID, "")),
        _count(props.get(PROP_TRANSACTION_CHECK_TIMES, "")),
        _immunity_ms(immunity),
        _count(props.get(PROP_TRAN_FIRST_STORED, "")) or copy.store_timestamp,
        props.get(PROP_KEYS, ""),
    )


class HalfCopy(NamedTuple):
    """A copy of a transaction as an end needs it: its properties decoded once, its transaction
    fields, and what its real message keeps of it."""

    info: HalfInfo
    props: dict[str, str]
    body: bytes
    flag: int
    sys_flag: int
    born_timestamp: int
    born_host: str
    reconsume_times: int


def read_copy(copy: StoredMessage) -> HalfCopy:
    """``copy`` as read back, its properties decoded (once)."""
    props = copy.properties
    return HalfCopy(
        half_info(copy, props),
        props,
        copy.body,
        copy.flag,
        copy.sys_flag,
        copy.born_timestamp,
        copy.born_host,
        copy.reconsume_times,
    )


def stored_copy(half: Message, where: AppendResult) -> HalfCopy:
    """The first copy of a transaction as it reads once stored at ``where``: ``half`` as
    :func:`to_half` made it (its unique id, born time and host filled), without reading it
    back."""
    props = dict(half.properties or {})
    if half.tags:
        props[PROP_TAGS] = half.tags
    if half.keys:
        props[PROP_KEYS] = " ".join(half.keys)
    props[PROP_UNIQ_KEY] = where.unique_id
    info = HalfInfo(
        where.topic,
        where.queue_offset,
        where.phys_offset,
        where.store_timestamp,
        where.unique_id,
        props.get(PROP_PRODUCER_GROUP, ""),
        props.get(PROP_REAL_TOPIC, ""),
        _count(props.get(PROP_REAL_QID, "")),
        0,
        _immunity_ms(props.get(PROP_CHECK_IMMUNITY, "")),
        where.store_timestamp,
        props.get(PROP_KEYS, ""),
    )
    body = half.body if type(half.body) is bytes else bytes(half.body)
    return HalfCopy(
        info,
        props,
        body,
        half.flag,
        half.sys_flag,
        half.born_timestamp,
        half.born_host,
        half.reconsume_times,
    )


def _immunity_ms(text: str) -> int:
    return int(text) * 1000 if text and check_immunity_rule(text) is None else 0


def _count(text: str) -> int:
    """A non-negative decimal number (at most 18 digits), or 0."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else 0


def to_half(msg: Message, producer_group: str, real_queue_id: int) -> None:
    """Turn ``msg`` (checked against its real topic) into the first copy of its transaction."""
    props = dict(msg.properties or {})
    props[PROP_REAL_TOPIC] = msg.topic
    props[PROP_REAL_QID] = str(real_queue_id)
    props[PROP_TRAN_MSG] = "true"
    props[PROP_PRODUCER_GROUP] = producer_group
    msg.properties = props
    msg.topic = TRANS_HALF_TOPIC
    msg.queue_id = 0


def user_properties(copy: StoredMessage) -> dict[str, str]:
    """``copy``'s properties without its own fields (tags, keys, unique id)."""
    return {k: v for k, v in copy.properties.items() if k not in OWN_FIELDS}


def next_copy(copy: StoredMessage, info: HalfInfo) -> tuple[Message, dict[str, str]]:
    """The copy a check puts at the end of the half queue: one more check, the first store time
    kept. Also its properties."""
    props = user_properties(copy)
    props[PROP_TRANSACTION_CHECK_TIMES] = str(info.check_times + 1)
    props[PROP_TRAN_FIRST_STORED] = str(info.first_stored_ms)
    return copy.copy_to(TRANS_HALF_TOPIC, 0, props), props


def given_up_copy(copy: StoredMessage, info: HalfInfo) -> Message:
    """The copy kept in TRANS_CHECK_MAX_TIME_TOPIC, every property kept (an operator may still
    commit it)."""
    props = user_properties(copy)
    props[PROP_TRAN_FIRST_STORED] = str(info.first_stored_ms)
    return copy.copy_to(TRANS_CHECK_MAX_TIME_TOPIC, 0, props)


def real_message(copy: HalfCopy, topic: str, queue_id: int) -> Message:
    """The message a commit stores: ``copy`` under its real topic and queue, every transaction
    property removed; unique id, body, flags, tags, keys, user properties, born time and host
    kept."""
    all_props = copy.props
    props = {
        k: v
        for k, v in all_props.items()
        if k not in OWN_FIELDS and k not in TRANSACTION_PROPERTIES
    }
    keys = all_props.get(PROP_KEYS)
    return Message(
        topic,
        copy.body,
        queue_id,
        all_props.get(PROP_TAGS),
        keys.split(" ") if keys else [],
        props,
        all_props.get(PROP_UNIQ_KEY) or None,
        copy.flag,
        copy.sys_flag,
        copy.born_timestamp,
        copy.born_host,
        copy.reconsume_times,
    )


def stored_as(copy: StoredMessage, props: Mapping[str, str], where: AppendResult) -> StoredMessage:
    """``copy`` as it reads once stored again with ``props`` at ``where`` (for a check's event,
    without reading it back)."""
    raw = encode_properties(copy.tags, copy.keys, copy.unique_id or None, props)
    return copy._replace(
        topic=where.topic,
        queue_id=where.queue_id,
        queue_offset=where.queue_offset,
        phys_offset=where.phys_offset,
        store_timestamp=where.store_timestamp,
        properties_raw=raw,
    )


# -- op records ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One op record as read back."""

    queue_offset: int
    phys_offset: int
    store_timestamp: int
    #: the queue offset of the copy it closes (in ``copy_topic``); -1 when unreadable
    copy_offset: int
    copy_topic: str
    kind: OpKind | None
    unique_id: str
    producer_group: str
    real_topic: str
    real_queue_id: int

    @property
    def half_offset(self) -> int:
        """The half-queue offset it closes; -1 for a copy elsewhere."""
        return self.copy_offset if self.copy_topic == TRANS_HALF_TOPIC else -1


def op_message(
    copy_offset: int,
    kind: OpKind,
    unique_id: str = "",
    producer_group: str = "",
    *,
    copy_topic: str = TRANS_HALF_TOPIC,
    real: tuple[str, int] | None = None,
) -> Message:
    """The op record closing the copy at ``copy_offset`` of ``copy_topic``."""
    props = {OP_KIND: kind.value}
    if unique_id:
        props[OP_TXN_ID] = unique_id
    if producer_group:
        props[PROP_PRODUCER_GROUP] = producer_group
    if real is not None:
        props[PROP_REAL_TOPIC] = real[0]
        props[PROP_REAL_QID] = str(real[1])
    if copy_topic != TRANS_HALF_TOPIC:
        props[OP_COPY_TOPIC] = copy_topic
    keys = [copy_key(copy_offset)] if copy_topic == TRANS_HALF_TOPIC else []
    if unique_id:
        keys.insert(0, unique_id)
    return Message(TRANS_OP_HALF_TOPIC, str(copy_offset).encode(), 0, OP_TAGS, keys, props)


def parse_op(stored: StoredMessage) -> OpRecord:
    """The op record ``stored``; fields it lacks read as absent (-1, "", None)."""
    props = stored.properties
    body = bytes(stored.body)
    copy_offset = int(body) if body.isdigit() and len(body) <= 18 else -1
    return OpRecord(
        stored.queue_offset,
        stored.phys_offset,
        stored.store_timestamp,
        copy_offset,
        props.get(OP_COPY_TOPIC, TRANS_HALF_TOPIC),
        _OP_KINDS.get(props.get(OP_KIND, "")),
        props.get(OP_TXN_ID, ""),
        props.get(PROP_PRODUCER_GROUP, ""),
        props.get(PROP_REAL_TOPIC, ""),
        _count(props.get(PROP_REAL_QID, "")),
    )


def decode_block(records: bytes, what: str) -> tuple[list[StoredMessage], int]:
    """The records of a queue read (whole CommitLog records back to back), each checked, and
    how many were left out because they failed their checks (logged). A size that breaks the
    block ends it."""
    out: list[StoredMessage] = []
    bad = 0
    pos = 0
    end = len(records)
    while pos < end:
        size = HEAD.unpack_from(records, pos)[0] if end - pos >= HEAD.size else 0
        if size <= 0 or pos + size > end:
            log.warning(
                "%s: the record at byte %d has size %d; the rest is left out", what, pos, size
            )
            return out, bad + 1
        try:
            out.append(decode(records, f"{what} at byte {pos}", True, pos, size))
        except CorruptRecordError as exc:
            log.warning("%s", exc)
            bad += 1
        pos += size
    return out, bad


def copy_key(half_offset: int) -> str:
    """The index key of the op records of the copy at ``half_offset`` of the half queue."""
    return f"{COPY_KEY_PREFIX}{half_offset}"
