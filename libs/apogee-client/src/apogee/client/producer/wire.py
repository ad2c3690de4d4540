"""Messages on the wire, encoded once, as send records.

A message is encoded once, when it is sent, as a send record: the CommitLog record layout with
the fields the broker assigns left zero (drawn in :mod:`apogee.codec.send`), its delay
level and delivery time in two of those slots. Each attempt writes the queue id it chose into
the record (four bytes, in place), and a request is the records of its messages back to back in
``SendMessagesRequest.records``, plus the producer group: batching costs no protobuf object per
message, a retry on another queue does not encode the message again, and the broker appends the
bytes as they came, writing in only what it assigns. Byte counts for the batch caps are exact.

The answer is read per request (:class:`Answer`): the queue offsets of the stored messages as
one packed array and one store timestamp, and a full result only for the others (refused,
delayed, or stored with a status); a message's :class:`SendResult` is built from what the
producer knows of it when someone wants it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Final

from apogee.client.message import Message, SendResult, SendStatus, encode_body
from apogee.codec.send import QUEUE_AT, QUEUE_ID, encode_send_record
from apogee.common.errors import ApogeeError
from apogee.rpc.errors import from_status
from apogee.rpc.protowire import varint
from apogee.v1 import broker_pb2

_TAG_GROUP: Final = b"\x12"  # SendMessagesRequest.producer_group: field 2, length-delimited
_TAG_RECORDS: Final = b"\x1a"  # SendMessagesRequest.records: field 3, length-delimited

_CACHE_MAX: Final = 4096
#: encoded topics and tag properties by their text (topics and tags repeat; bounded)
_topics: dict[str, bytes] = {}
_tag_parts: dict[str, bytes] = {}
_UNIQ: Final = b"UNIQ_KEY\x01"
_END: Final = b"\x02"
#: The property that asks a broker to store a message once within its dedup window (the
#: broker's ``dedup_window_s``), and the id it is known by: what an idempotent send sets.
DEDUP_PROPERTY: Final = "APOGEE_DEDUP_ID"
_DEDUP: Final = DEDUP_PROPERTY.encode() + b"\x01"
_OWN: Final = frozenset({"TAGS", "KEYS", "UNIQ_KEY"})
_set_queue = QUEUE_ID.pack_into


def _cached(cache: dict[str, bytes], text: str, raw: bytes) -> bytes:
    if len(cache) < _CACHE_MAX:
        cache[text] = raw
    return raw


def encode(
    msg: Message,
    unique_id: str,
    born_ms: int,
    compress_over: int,
    flag: int = 0,
    trace: bytes = b"",
    dedup: str = "",
) -> bytearray:
    """``msg`` as a send record (queue id 0: see :func:`set_queue`); the body compressed when
    longer than ``compress_over`` and smaller for it. The message was validated. ``trace``:
    the trace properties of a traced send, written last (the message's own give way to them:
    see :func:`apogee.client.producer.send_spans.without_trace`). ``dedup``: the dedup id of
    an idempotent send whose message carries none of its own (:data:`DEDUP_PROPERTY`)."""
    raw = msg.body if type(msg.body) is bytes else bytes(msg.body)
    body, sys_flag = encode_body(raw, compress_over)
    topic = msg.topic
    topic_b = _topics.get(topic) or _cached(_topics, topic, topic.encode())
    tags = msg.tags
    parts: list[bytes] = []
    if tags:
        parts.append(
            _tag_parts.get(tags) or _cached(_tag_parts, tags, f"TAGS\x01{tags}\x02".encode())
        )
    if msg.keys:
        parts.append(f"KEYS\x01{' '.join(msg.keys)}\x02".encode())
    parts += (_UNIQ, unique_id.encode(), _END)
    if dedup:
        parts += (_DEDUP, dedup.encode(), _END)
    if msg.properties:
        parts.append(_user_properties(msg.properties))
    if trace:
        parts.append(trace)
    at_ms = msg.deliver_at_ms if msg.deliver_at is not None else 0
    return encode_send_record(
        topic_b,
        body,
        b"".join(parts),
        0,
        flag,
        sys_flag,
        born_ms,
        msg.delay_level,
        at_ms,
    )


def _user_properties(props: Mapping[str, str]) -> bytes:
    return "".join(
        f"{name}\x01{value}\x02" for name, value in props.items() if name not in _OWN
    ).encode()


def set_queue(record: bytearray, queue_id: int) -> None:
    """Place ``record`` on ``queue_id`` (each attempt, before it is queued)."""
    _set_queue(record, QUEUE_AT, queue_id)


def group_field(group: str) -> bytes:
    raw = group.encode()
    return _TAG_GROUP + varint(len(raw)) + raw if raw else b""


def request(records: Sequence[bytes | bytearray], group_bytes: bytes) -> bytes:
    """The serialized ``SendMessagesRequest`` of ``records``."""
    size = 0
    for r in records:
        size += len(r)
    return b"".join((group_bytes, _TAG_RECORDS, varint(size), *records))


class Answer:
    """A request's answer, read per request: ``outcome(i, ...)`` is the outcome of its ``i``-th
    message. ``len()`` is the number of messages it answers."""

    __slots__ = ("broker_name", "offsets", "others", "store_timestamp")

    def __init__(self, resp: broker_pb2.SendMessagesResponse, broker_name: str) -> None:
        self.broker_name = resp.broker_name or broker_name
        packed = resp.queue_offsets
        n = len(packed) // 8
        self.offsets: tuple[int, ...] = struct.unpack(f"<{n}q", packed) if n else ()
        self.store_timestamp = resp.store_timestamp_ms
        self.others = {r.index: r for r in resp.results} if len(resp.results) else {}

    def __len__(self) -> int:
        return len(self.offsets)

    def ok(self, i: int) -> bool:
        """Whether message ``i`` was stored with no more to say (no result object needed)."""
        return self.offsets[i] >= 0

    def stored(self, i: int, message_id: str, topic: str, queue_id: int) -> SendResult:
        """The result of message ``i``, which :meth:`ok` says was stored."""
        return _result(
            message_id,
            topic,
            queue_id,
            self.offsets[i],
            self.broker_name,
            SendStatus.OK,
            self.store_timestamp,
        )

    def outcome(
        self, i: int, message_id: str, topic: str, queue_id: int
    ) -> SendResult | BaseException:
        """Where message ``i`` (its id, topic and queue as sent) was stored, or its error."""
        offset = self.offsets[i]
        if offset >= 0:
            return _result(
                message_id,
                topic,
                queue_id,
                offset,
                self.broker_name,
                SendStatus.OK,
                self.store_timestamp,
            )
        r = self.others.get(i)
        if r is None:
            return ApogeeError.from_wire("INTERNAL", f"the answer has no outcome for message {i}")
        return result_of(r, self.broker_name)


def result_of(r: broker_pb2.SendResult, broker_name: str) -> SendResult | BaseException:
    """One full result of an answer: where the message was stored, or its error."""
    status = r.status
    # FLUSH_TIMEOUT: stored, but durability was not confirmed in time
    if status.code == 0 or status.reason == "FLUSH_TIMEOUT":
        return _result(
            r.unique_id,
            r.topic,
            r.queue_id,
            r.queue_offset,
            broker_name,
            SendStatus.OK if status.code == 0 else SendStatus.FLUSH_DISK_TIMEOUT,
            r.store_timestamp_ms,
        )
    err = from_status(status)
    return err if err is not None else ApogeeError.from_wire("INTERNAL", "no status")


_new = object.__new__
_set = object.__setattr__


def _result(
    message_id: str,
    topic: str,
    queue_id: int,
    queue_offset: int,
    broker_name: str,
    status: SendStatus,
    store_timestamp_ms: int,
) -> SendResult:
    """``SendResult(...)`` without the frozen dataclass's ``__init__`` (a third of the cost)."""
    r: SendResult = _new(SendResult)
    _set(r, "message_id", message_id)
    _set(r, "topic", topic)
    _set(r, "queue_id", queue_id)
    _set(r, "queue_offset", queue_offset)
    _set(r, "broker_name", broker_name)
    _set(r, "status", status)
    _set(r, "store_timestamp_ms", store_timestamp_ms)
    return r
