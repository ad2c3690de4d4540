"""Sending records: a request's send records checked in place and appended as one block.

The SDK's requests carry each message once, as a send record (the CommitLog record layout with
what the broker assigns left zero, :mod:`apogee.codec.send`). The broker reads each
record's header where it lies and puts it through the checks of :mod:`.checks`, in the same
order and with the same errors (``messages[i]`` names the record's place in the request):

- a record of a topic that already passed in this request needs only its own fields checked
  (body size, flags, queue id, delay level and time); the first of each topic, and any doubt,
  goes through the full sequence (:meth:`SendChecks.check`);
- then its type, against a topic that is not MIXED (:meth:`SendChecks.check_type`): DELAY with a
  delay level or time in its header, FIFO with the property ``__SHARDINGKEY`` (found in the
  properties' bytes), else NORMAL;
- then a compressed body: one zlib stream that inflates to 1 to ``max_message_size`` bytes;
- then a born timestamp of 0 (the broker's clock) or more, as the store checks it;
- then the properties: their size, none that only brokers set (``REAL_TOPIC``, ``DELAY``, ...),
  every entry ``name 0x01 value 0x02`` with a name that is not empty and holds no control
  character and a value without separators (what the store refuses on the message path, and on
  every later write of the message: a retry, a dead letter, a delayed delivery), and a valid
  unique id.

A good plain record stays bytes: its topic, queue, tag code, keys and unique id are read from
it (:func:`~apogee.codec.send.own_fields`) and the good records go to the store as one
block (:meth:`MessageStore.append_records`), which writes in the queue and physical offsets, the
timestamps, hosts and CRC. Only a record that needs more than that becomes a store message and
takes the ordinary path (:meth:`StoreWriter.store_batch`): a delayed or timer message (its topic
and properties change), or one whose properties do not start with its own fields as a producer
writes them (or lack a unique id, which the broker then assigns).

A record carrying the property ``APOGEE_DEDUP_ID`` whose id the broker stored in the same topic
within ``dedup_window_s`` is not stored again; its answer is the first copy's queue offset
(:mod:`.dedup`).

A record whose frame is broken (wrong magic, sizes that do not add up, a record running past the
end) fails the whole request: nothing after it could be found.

The answer is per request too (:class:`RecordsOutcome`): the queue offset of every stored plain
record as one packed array, one store timestamp, and a full outcome only for the others.
"""

from __future__ import annotations

import sys
import time
import zlib
from array import array
from typing import Final, NamedTuple

from apogee.codec import (
    EMPTY_HOST,
    HEADER,
    HEADER_SIZE,
    MESSAGE_MAGIC,
    NAME_SEP,
    OWN_FIELDS,
    PROP_SEP,
    PROP_SHARDING_KEY,
    SYSFLAG_COMPRESSED,
    decode_host,
    decode_properties,
    find_broker_property,
    properties_text_problem,
    unique_id_rule,
)
from apogee.codec.send import RecordRef, own_fields
from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    InvalidPropertyError,
    PropertiesTooLargeError,
)
from apogee.common.topics import MessageType
from apogee.store import Message
from apogee_broker.core.send.checks import check_client_properties, message_kind
from apogee_broker.core.send.dedup import DEDUP_PROPERTY, DedupWindow, dedup_id
from apogee_broker.core.send.service import SendService
from apogee_broker.core.storage.writer import SendOutcome
from apogee_broker.core.topics import TopicConfig

_CACHE_MAX: Final = 10_000
#: The latest born timestamp a record can hold (the store's bound on the message path).
_INT64_MAX: Final = (1 << 63) - 1
#: A record's properties' text naming its message group: first, or after another entry.
_GROUP_FIRST: Final = (PROP_SHARDING_KEY + NAME_SEP).encode()
_GROUP_LATER: Final = (PROP_SEP + PROP_SHARDING_KEY + NAME_SEP).encode()


class RecordsOutcome(NamedTuple):
    """What became of a request's records: ``queue_offsets[i]`` where record ``i`` was stored
    (at ``store_timestamp``, in the topic and queue it named), or -1 when ``others`` holds its
    outcome (refused, delayed, or stored with a status)."""

    records: int
    queue_offsets: array[int]
    store_timestamp: int
    others: list[tuple[int, SendOutcome]]

    def packed_offsets(self) -> bytes:
        """``queue_offsets`` as little-endian int64s (the protocol's ``queue_offsets``)."""
        if sys.byteorder != "little":
            swapped = array("q", self.queue_offsets)
            swapped.byteswap()
            return swapped.tobytes()
        return self.queue_offsets.tobytes()


class RecordIntake:
    """Checks and stores the records of send requests for one broker."""

    def __init__(self, service: SendService) -> None:
        self.service = service
        self._topics: dict[bytes, str] = {}
        self._tag_codes: dict[str, int] = {}

    async def send(self, block: bytes, born_host: str) -> RecordsOutcome:
        """Store the good records of ``block``; raises only for request-level problems."""
        svc = self.service
        checks = svc.checks
        writer = svc.writer
        began = time.time_ns() if writer.spans is not None else 0
        max_size = checks.max_message_size
        max_props = svc.store.cfg.max_properties_size
        max_messages = checks.max_messages_per_request
        total = len(block)
        unpack = HEADER.unpack_from
        topics = self._topics
        offsets: array[int] = array("q")
        others: list[tuple[int, SendOutcome]] = []
        refs: list[RecordRef] = []
        fast: list[int] = []
        spans: list[tuple[int, int]] = []
        slow: list[int] = []
        slow_msgs: list[Message] = []
        scheduled: dict[int, tuple[str, int, int]] = {}
        #: topics a record passed every check with in this request
        passed: dict[str, TopicConfig] = {}
        dedup = svc.dedup
        #: records that asked for deduplication: (index, topic, id), claimed and duplicates
        claims: list[tuple[int, str, str]] = []
        dups: list[tuple[int, str, str]] = []
        pos = i = 0
        while pos < total:
            if i >= max_messages:
                raise _too_many(block, pos, i, max_messages)
            if total - pos < HEADER_SIZE:
                raise _broken(i, pos, f"{total - pos} bytes is shorter than a record's header")
            f = unpack(block, pos)
            size = f[0]
            blen = f[14]
            body_end = pos + HEADER_SIZE + blen
            topic_end = body_end + f[15]
            end = pos + size
            if f[1] != MESSAGE_MAGIC or blen < 0 or topic_end + f[16] != end or end > total:
                raise _broken(i, pos, "its magic or sizes do not make a record")
            topic_b = block[body_end:topic_end]
            topic = topics.get(topic_b)
            if topic is None:
                topic = topic_b.decode(errors="replace")
                if len(topics) < _CACHE_MAX:
                    topics[topic_b] = topic
            qid = f[3]
            sys_flag = f[7]
            delay = f[5]
            at = f[6]
            config = passed.get(topic)
            if (
                config is None
                or delay
                or at
                or not 0 < blen <= max_size
                or sys_flag & ~SYSFLAG_COMPRESSED
                or not 0 <= qid < config.write_queues
            ):
                try:
                    config = passed[topic] = checks.check(i, topic, blen, sys_flag, qid, delay, at)
                except ApogeeError as err:
                    others.append((i, SendOutcome(topic, qid, "", None, err)))
                    offsets.append(-1)
                    pos = end
                    i += 1
                    continue
            try:
                if config.message_type is not MessageType.MIXED:
                    grouped = _has_group(block, topic_end, end)
                    checks.check_type(i, config, *message_kind(delay, at, grouped))
                if sys_flag & SYSFLAG_COMPRESSED:
                    checks.check_compressed(i, memoryview(block)[pos + HEADER_SIZE : body_end])
                if f[8] < 0:
                    raise InvalidArgumentError(
                        field="born_timestamp",
                        rule=f"must be an integer from 0 to {_INT64_MAX}, got {f[8]}",
                    )
                if f[16] > max_props:
                    raise PropertiesTooLargeError(
                        size=f[16],
                        rule=f"the maximum is {max_props} bytes (max_properties_size), "
                        "tags, keys and unique id included",
                    )
                try:
                    props = block[topic_end:end].decode()
                except UnicodeDecodeError:
                    raise InvalidPropertyError(field="properties", rule="must be UTF-8") from None
                reserved = find_broker_property(props)
                if reserved is not None:
                    check_client_properties((reserved,))
                malformed = properties_text_problem(props)
                if malformed is not None:
                    raise InvalidPropertyError(field=malformed[0], rule=malformed[1])
                tags, keys, uid, canonical = own_fields(props)
                if uid:
                    uid_rule = unique_id_rule(uid)
                    if uid_rule is not None:
                        raise InvalidArgumentError(field="unique_id", rule=uid_rule)
                if not canonical:
                    _check_own_fields_once(props)
            except ApogeeError as err:
                others.append((i, SendOutcome(topic, qid, "", None, err)))
                offsets.append(-1)
                pos = end
                i += 1
                continue
            if dedup is not None and DEDUP_PROPERTY in props:
                key = dedup_id(props)
                if key:
                    if dedup.claim(topic, key) is not None:  # stored before: not again
                        dups.append((i, topic, key))
                        offsets.append(0)
                        pos = end
                        i += 1
                        continue
                    claims.append((i, topic, key))
            if delay or at or not canonical or not uid or f[12] or f[13]:
                msg = _message(block, f, topic, tags, keys, uid, props, pos, born_host)
                if delay or at:
                    real = (topic, qid)
                    due = svc.schedule(msg, delay, at)
                    if due:
                        scheduled[i] = (*real, due)
                slow.append(i)
                slow_msgs.append(msg)
                offsets.append(-1)
            else:
                code = self._tag_codes.get(tags) if tags else 0
                if code is None:
                    assert tags is not None
                    code = zlib.crc32(tags.encode())
                    if len(self._tag_codes) < _CACHE_MAX:
                        self._tag_codes[tags] = code
                refs.append((topic, qid, size, code, keys, uid))
                fast.append(i)
                spans.append((pos, end))
                offsets.append(0)
            pos = end
            i += 1
        if i == 0:
            raise InvalidArgumentError(field="messages", rule="must not be empty")
        store_ts = 0
        if refs:
            store_ts = await self._store_block(block, refs, fast, spans, offsets, others, born_host)
            if writer.spans is not None:
                errors = {j: o.error for j, o in others if o.error is not None}
                writer.spans.records(
                    block,
                    spans,
                    refs,
                    [offsets[j] for j in fast],
                    began,
                    {k: errors[j] for k, j in enumerate(fast) if j in errors},
                )
        if slow_msgs:
            outcomes: list[SendOutcome | None] = [None] * i
            writer.fill_defaults(slow_msgs, born_host)
            await writer.store_batch(slow, slow_msgs, outcomes)
            for j in slow:
                o = outcomes[j]
                assert o is not None
                where = scheduled.get(j)
                if where is not None:
                    o = o._replace(topic=where[0], queue_id=where[1], scheduled_for=where[2])
                others.append((j, o))
        if dedup is not None and (claims or dups):
            _settle_claims(dedup, claims, dups, offsets, others)
        return RecordsOutcome(i, offsets, store_ts, others)

    async def _store_block(
        self,
        block: bytes,
        refs: list[RecordRef],
        fast: list[int],
        spans: list[tuple[int, int]],
        offsets: array[int],
        others: list[tuple[int, SendOutcome]],
        born_host: str,
    ) -> int:
        """Append the plain records as one block; their queue offsets go into ``offsets``, any
        other outcome into ``others``. Returns their store timestamp."""
        if len(spans) != len(offsets):  # some records stay out of the block
            block = b"".join(block[a:b] for a, b in spans)
        try:
            results, durable_error = await self.service.writer.append_records(
                block, refs, born_host
            )
        except ApogeeError as err:  # closed, failed, disk full: nothing of the block stored
            for j, ref in zip(fast, refs, strict=True):
                offsets[j] = -1
                others.append((j, SendOutcome(ref[0], ref[1], ref[5], None, err)))
            return 0
        if durable_error is not None:  # stored, durability unconfirmed: every one says so
            for j, r in zip(fast, results, strict=True):
                offsets[j] = -1
                others.append((j, SendOutcome(r.topic, r.queue_id, r.unique_id, r, durable_error)))
            return results[0].store_timestamp
        for j, r in zip(fast, results, strict=True):
            offsets[j] = r.queue_offset
        return results[0].store_timestamp


def _settle_claims(
    dedup: DedupWindow,
    claims: list[tuple[int, str, str]],
    dups: list[tuple[int, str, str]],
    offsets: array[int],
    others: list[tuple[int, SendOutcome]],
) -> None:
    """Remember where the claimed records were stored (forget those that were not), and
    answer each duplicate with its first copy's queue offset (0 while that is unknown)."""
    outcome = dict(others)
    for j, topic, key in claims:
        if offsets[j] >= 0:
            dedup.stored(topic, key, offsets[j])
            continue
        o = outcome.get(j)
        if o is not None and o.result is not None:
            dedup.stored(topic, key, o.result.queue_offset)
        else:
            dedup.release(topic, key)
    for j, topic, key in dups:
        offsets[j] = max(dedup.offset_of(topic, key), 0)


def _message(
    block: bytes,
    f: tuple[object, ...],
    topic: str,
    tags: str | None,
    keys: tuple[str, ...],
    uid: str,
    props: str,
    pos: int,
    born_host: str,
) -> Message:
    """The record at ``pos`` (header fields ``f``) as a store message, for the ordinary path.
    Its reconsume times and prepared offset are not a sender's to set: they stay 0."""
    user = {k: v for k, v in decode_properties(props).items() if k not in OWN_FIELDS}
    qid, flag, sys_flag, born, host, body_len = f[3], f[4], f[7], f[8], f[10], f[14]
    assert isinstance(host, bytes)
    assert isinstance(body_len, int)
    body_at = pos + HEADER_SIZE
    return Message(
        topic,
        block[body_at : body_at + body_len],
        qid,  # type: ignore[arg-type]
        tags,
        keys,
        user or None,
        uid or None,
        flag,  # type: ignore[arg-type]
        sys_flag,  # type: ignore[arg-type]
        born,  # type: ignore[arg-type]
        born_host if host == EMPTY_HOST else decode_host(host),
    )


def _has_group(block: bytes, start: int, end: int) -> bool:
    """Whether the properties' text at ``block[start:end]`` has a message group
    (``__SHARDINGKEY``), found in the bytes before they are decoded."""
    return block.startswith(_GROUP_FIRST, start, end) or block.find(_GROUP_LATER, start, end) >= 0


def _check_own_fields_once(props: str) -> None:
    """Refuse properties that name one of the message's own fields (tags, keys, unique id) more
    than once: which one counts would be a reader's guess."""
    seen: set[str] = set()
    for item in props.split(PROP_SEP):
        name = item.partition(NAME_SEP)[0]
        if name in OWN_FIELDS:
            if name in seen:
                raise InvalidPropertyError(
                    field=name, rule="appears more than once; a message has one"
                )
            seen.add(name)


def _broken(i: int, at: int, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(field=f"records[{i}] (at byte {at})", rule=what)


def _too_many(block: bytes, pos: int, seen: int, limit: int) -> InvalidArgumentError:
    count = seen
    total = len(block)
    while pos < total and total - pos >= HEADER_SIZE:
        size = int.from_bytes(block[pos : pos + 4], "little", signed=True)
        if size <= 0:
            break
        pos += size
        count += 1
    return InvalidArgumentError(
        field="messages",
        rule=f"{count} messages in one request; at most {limit} are allowed "
        "(max_messages_per_request)",
    )
