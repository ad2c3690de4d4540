"""Messages on the wire, encoded once.

A message is serialized to its ``apogee.v1.Message`` bytes once, when it is sent, without its
queue id; each attempt adds the queue id it chose as one trailing varint field (protobuf
accepts fields in any order, and the last value of a field wins), and frames the result as
field 1 of ``SendMessagesRequest``. A request is then the concatenation of its messages' frames
and the producer group, so batching costs no protobuf object per request and a retry on
another queue does not serialize the message again. Byte counts for the batch caps are exact.

The bytes are written here rather than by protobuf: the same fields in field-number order, as
protobuf writes them, but with the framing of a topic, a tag and a timestamp computed once and
reused (a message costs about two thirds of what building and serializing a protobuf object
does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from apogee.client.message import Message, SendResult, SendStatus, encode_body
from apogee.common.errors import ApogeeError
from apogee.rpc.errors import from_status
from apogee.rpc.protowire import ONE_BYTE, varint
from apogee.v1 import broker_pb2

_TAG_MESSAGES: Final = b"\x0a"  # SendMessagesRequest.messages: field 1, length-delimited
_TAG_GROUP: Final = b"\x12"  # SendMessagesRequest.producer_group: field 2, length-delimited
_TAG_QUEUE_ID: Final = b"\x50"  # Message.queue_id: field 10, varint

# apogee.v1.Message fields: (number << 3) | wire type (0 varint, 2 length-delimited)
_TOPIC: Final = b"\x0a"
_BODY: Final = b"\x12"
_TAGS: Final = b"\x1a"
_KEYS: Final = b"\x22"
_PROPERTIES: Final = b"\x2a"
_UNIQUE_ID: Final = b"\x32"
_BORN_MS: Final = b"\x38"
_FLAG: Final = b"\x48"
_SYS_FLAG: Final = b"\x58"
_DELAY_LEVEL: Final = b"\x60"
_DELIVER_AT_MS: Final = b"\x68"  # field 13, varint
_ENTRY_KEY: Final = b"\x0a"  # map entry: key field 1
_ENTRY_VALUE: Final = b"\x12"  # map entry: value field 2

_CACHE_MAX: Final = 4096
#: encoded topic and tags fields by their text (topics and tags repeat; bounded)
_topic_fields: dict[str, bytes] = {}
_tags_fields: dict[str, bytes] = {}
#: the last born timestamp and its field, as one tuple (read and replaced whole: thread-safe)
_born_field: list[tuple[int, bytes]] = [(-1, b"")]
#: queue id fields (queue id 0 is left out, as protobuf does)
_QUEUE_FIELDS: Final = (b"", *(_TAG_QUEUE_ID + bytes((n,)) for n in range(1, 0x80)))


def _text_field(tag: bytes, text: str) -> bytes:
    raw = text.encode()
    return tag + varint(len(raw)) + raw


def _cached_field(cache: dict[str, bytes], tag: bytes, text: str) -> bytes:
    field = cache.get(text)
    if field is None:
        field = _text_field(tag, text)
        if len(cache) < _CACHE_MAX:
            cache[text] = field
    return field


def encode(msg: Message, unique_id: str, born_ms: int, compress_over: int, flag: int = 0) -> bytes:
    """``msg`` as ``apogee.v1.Message`` bytes, without a queue id; the body compressed when
    longer than ``compress_over`` and smaller for it."""
    raw = msg.body if type(msg.body) is bytes else bytes(msg.body)
    body, sys_flag = encode_body(raw, compress_over)
    topic = msg.topic
    parts = [
        _topic_fields.get(topic) or _cached_field(_topic_fields, _TOPIC, topic) if topic else b""
    ]
    if body:
        parts += (_BODY, varint(len(body)), body)
    tags = msg.tags
    if tags:
        parts.append(_tags_fields.get(tags) or _cached_field(_tags_fields, _TAGS, tags))
    for key in msg.keys:
        parts.append(_text_field(_KEYS, key))
    if msg.properties:
        for name, value in msg.properties.items():
            entry = _text_field(_ENTRY_KEY, name) + _text_field(_ENTRY_VALUE, value)
            parts += (_PROPERTIES, varint(len(entry)), entry)
    if unique_id:
        parts.append(_text_field(_UNIQUE_ID, unique_id))
    if born_ms:
        cached = _born_field[0]
        if cached[0] != born_ms:
            cached = _born_field[0] = (born_ms, _BORN_MS + varint(born_ms))
        parts.append(cached[1])
    if flag:
        parts += (_FLAG, varint(flag))
    if sys_flag:
        parts += (_SYS_FLAG, varint(sys_flag))
    if msg.delay_level:
        parts += (_DELAY_LEVEL, varint(msg.delay_level))
    if msg.deliver_at is not None:
        at_ms = msg.deliver_at_ms
        if at_ms:
            parts += (_DELIVER_AT_MS, varint(at_ms))
    return b"".join(parts)


def frame(encoded: bytes, queue_id: int) -> bytes:
    """One message's frame in a request, placed on ``queue_id``."""
    tail = _QUEUE_FIELDS[queue_id] if 0 <= queue_id < 0x80 else _TAG_QUEUE_ID + varint(queue_id)
    size = len(encoded) + len(tail)
    head = _TAG_MESSAGES + (ONE_BYTE[size] if size < 0x80 else varint(size))
    return b"".join((head, encoded, tail))


def group_field(group: str) -> bytes:
    raw = group.encode()
    return _TAG_GROUP + varint(len(raw)) + raw if raw else b""


def request(frames: Sequence[bytes], group_bytes: bytes) -> bytes:
    """The serialized ``SendMessagesRequest`` of ``frames``."""
    return b"".join((*frames, group_bytes))


def outcomes(
    resp: broker_pb2.SendMessagesResponse, broker_name: str
) -> list[SendResult | BaseException]:
    """One outcome per message of a request: where it was stored, or its error."""
    name = resp.broker_name or broker_name
    out: list[SendResult | BaseException] = []
    append = out.append
    for r in resp.results:
        status = r.status
        # FLUSH_TIMEOUT: stored, but durability was not confirmed in time
        if status.code == 0 or status.reason == "FLUSH_TIMEOUT":
            append(
                _result(
                    r.unique_id,
                    r.topic,
                    r.queue_id,
                    r.queue_offset,
                    name,
                    SendStatus.OK if status.code == 0 else SendStatus.FLUSH_DISK_TIMEOUT,
                    r.store_timestamp_ms,
                )
            )
        else:
            err = from_status(status)
            append(err if err is not None else ApogeeError.from_wire("INTERNAL", "no status"))
    return out


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
