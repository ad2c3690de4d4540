"""Messages between the v2 wire (``apache.rocketmq.v2.Message``) and the store, following the
mapping RocketMQ 5's proxy uses: tag is ``TAGS``, keys are ``KEYS`` (space-joined), the message
id is ``UNIQ_KEY`` (kept from the client, given back on every delivery), the message group is
``__SHARDINGKEY``, the delivery time ``DELIVER_AT_MS``, the trace context ``traceparent``,
``delivery_attempt`` is ``reconsume_times + 1`` of the delivery; user properties are the
properties that are neither the message's own fields nor the broker's.

A GZIP body is stored inflated (a v2 client compresses with gzip, Apogee's records with zlib);
bodies are delivered as stored (IDENTITY), or inflated first when Apogee's SDK compressed them.
Every delivery carries an upper-case MD5 digest of its body (the clients check it).
"""

from __future__ import annotations

import hashlib
import socket
import zlib
from dataclasses import dataclass
from typing import Final

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from apogee.codec import (
    PROP_DELIVER_AT,
    PROP_DLQ_ORIGIN_TOPIC,
    PROP_KEYS,
    PROP_SHARDING_KEY,
    PROP_TAGS,
    PROP_TIMER_DELIVER,
    PROP_TRACEPARENT,
    PROP_TRAN_MSG,
    PROP_UNIQ_KEY,
    SYSFLAG_COMPRESSED,
    Message,
    StoredMessage,
    is_broker_property,
)
from apogee.common.errors import InvalidArgumentError
from apogee.common.topics import MessageType
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee_broker.servicers.v2.status import V2Error

#: v2 message types and Apogee's.
TYPES: Final = {
    d.NORMAL: MessageType.NORMAL,
    d.FIFO: MessageType.FIFO,
    d.DELAY: MessageType.DELAY,
    d.TRANSACTION: MessageType.TRANSACTION,
}
WIRE_TYPES: Final = {v: k for k, v in TYPES.items()}
#: What a MIXED topic accepts, as routes list it.
ALL_TYPES: Final = (d.NORMAL, d.FIFO, d.DELAY, d.TRANSACTION)
#: Longest message group (upstream's limit).
MAX_MESSAGE_GROUP: Final = 64
#: What a protobuf ``Timestamp`` may hold (the years 1 to 9999), in ms.
MIN_TIMESTAMP_MS: Final = -62_135_596_800_000
MAX_TIMESTAMP_MS: Final = 253_402_300_799_999
#: Most user properties, and their bytes (upstream's limits).
MAX_USER_PROPERTIES: Final = 128
MAX_USER_PROPERTY_BYTES: Final = 16 * 1024
#: The message's own properties: not user properties when delivered (the dedup id is the
#: message id, which v2 carries in a field of its own). The W3C trace context (``traceparent``,
#: ``tracestate``) is a user property that Apogee's store spans read: a client may send it as
#: one (as OpenTelemetry's propagators do) or in ``trace_context``.
_OWN: Final = frozenset({PROP_TAGS, PROP_KEYS, PROP_UNIQ_KEY, PROP_SHARDING_KEY, "APOGEE_DEDUP_ID"})


@dataclass(slots=True)
class Incoming:
    """A v2 message made ready for the store: the record, its type, why it has that type, and
    its delivery time (ms, 0: none)."""

    message: Message
    kind: MessageType
    why: str
    deliver_at_ms: int
    message_group: str


def accepted_types(message_type: str) -> list[int]:
    """The v2 types a topic of ``message_type`` accepts."""
    kind = MessageType(message_type) if message_type else MessageType.MIXED
    if kind is MessageType.MIXED:
        return list(ALL_TYPES)
    return [WIRE_TYPES[kind]]


def _bad(field: str, code: int, rule: str) -> V2Error:
    return V2Error(code, f"{field}: {rule}")


def _check_text(field: str, code: int, value: str, separators: str = "") -> None:
    if not value.strip():
        raise _bad(field, code, "must not be blank")
    for ch in value:
        if ord(ch) < 0x20 or ord(ch) == 0x7F or ch in separators:
            raise _bad(field, code, f"must not contain {ch!r}")


def _ms(ts: Timestamp, field: str, code: int) -> int:
    """``ts`` in ms; :class:`V2Error` naming ``field`` when it is no valid timestamp."""
    try:
        return ts.ToMilliseconds()
    except ValueError:
        raise _bad(
            field,
            code,
            f"seconds {ts.seconds}, nanos {ts.nanos} is not a valid timestamp (the years 1 to "
            "9999, nanos from 0 to 999999999)",
        ) from None


def from_wire(m: d.Message, max_body: int) -> Incoming:
    """The store's record of ``m`` (not yet given a queue); :class:`V2Error` naming the field
    for what the protocol refuses."""
    sp = m.system_properties
    body = bytes(m.body)
    if sp.body_encoding == d.GZIP:
        try:  # wbits 47: a gzip or a zlib header, whichever it has
            inflater = zlib.decompressobj(wbits=47)
            body = inflater.decompress(body, max_body + 1)
        except zlib.error as exc:
            raise _bad(
                "message.body", d.BAD_REQUEST, f"is marked GZIP but does not inflate: {exc}"
            ) from None
    if not body:
        raise _bad("message.body", d.MESSAGE_BODY_EMPTY, "must not be empty")
    if len(body) > max_body:
        raise _bad(
            "message.body",
            d.MESSAGE_BODY_TOO_LARGE,
            f"is more than {max_body} bytes (the broker's max_message_size)",
        )
    if not sp.message_id:
        raise _bad("message.system_properties.message_id", d.ILLEGAL_MESSAGE_ID, "is required")
    tag = sp.tag if sp.HasField("tag") else None
    if tag is not None:
        _check_text("message.system_properties.tag", d.ILLEGAL_MESSAGE_TAG, tag, "|")
    for i, key in enumerate(sp.keys):
        _check_text(f"message.system_properties.keys[{i}]", d.ILLEGAL_MESSAGE_KEY, key)
    props: dict[str, str] = {}
    if len(m.user_properties) > MAX_USER_PROPERTIES:
        raise _bad(
            "message.user_properties",
            d.MESSAGE_PROPERTIES_TOO_LARGE,
            f"has {len(m.user_properties)} entries; at most {MAX_USER_PROPERTIES}",
        )
    size = 0
    for name, value in m.user_properties.items():
        field = f"message.user_properties[{name!r}]"
        if not name or name in _OWN or name == PROP_TRAN_MSG or is_broker_property(name):
            raise _bad(field, d.ILLEGAL_MESSAGE_PROPERTY_KEY, "is a system property's name")
        _check_text(field, d.ILLEGAL_MESSAGE_PROPERTY_KEY, name, "\x01\x02")
        if any(ord(ch) < 0x20 and ch not in "\t\n\r" for ch in value):
            raise _bad(field, d.BAD_REQUEST, "its value must not contain control characters")
        size += len(name.encode()) + len(value.encode())
        props[name] = value
    if size > MAX_USER_PROPERTY_BYTES:
        raise _bad(
            "message.user_properties",
            d.MESSAGE_PROPERTIES_TOO_LARGE,
            f"are {size} bytes; at most {MAX_USER_PROPERTY_BYTES}",
        )
    group = sp.message_group if sp.HasField("message_group") else ""
    if sp.HasField("message_group"):
        _check_text("message.system_properties.message_group", d.ILLEGAL_MESSAGE_GROUP, group)
        if len(group.encode()) >= MAX_MESSAGE_GROUP:
            raise _bad(
                "message.system_properties.message_group",
                d.ILLEGAL_MESSAGE_GROUP,
                f"is {len(group.encode())} bytes; it must be shorter than {MAX_MESSAGE_GROUP}",
            )
        props[PROP_SHARDING_KEY] = group
    if sp.HasField("trace_context") and sp.trace_context:
        props.setdefault(PROP_TRACEPARENT, sp.trace_context)
    at = 0
    if sp.HasField("delivery_timestamp"):
        at = _ms(
            sp.delivery_timestamp,
            "message.system_properties.delivery_timestamp",
            d.ILLEGAL_DELIVERY_TIME,
        )
        if at <= 0:
            raise _bad(
                "message.system_properties.delivery_timestamp",
                d.ILLEGAL_DELIVERY_TIME,
                "must be a time after the epoch",
            )
    kind, why = _kind_of(sp, group, at)
    born = 0
    if sp.HasField("born_timestamp"):
        born = _ms(sp.born_timestamp, "message.system_properties.born_timestamp", d.BAD_REQUEST)
    msg = Message(
        m.topic.name,
        body,
        0,
        tag,
        tuple(sp.keys),
        props or None,
        sp.message_id,
        born_timestamp=max(born, 0),
        born_host=_with_port(sp.born_host),
    )
    return Incoming(msg, kind, why, at, group)


def _with_port(host: str) -> str:
    """A v2 born host (an address without a port) as the store keeps hosts: ``ip:port``."""
    if not host:
        return ""
    try:
        socket.inet_pton(socket.AF_INET, host)
        return f"{host}:0"
    except (OSError, ValueError):  # ValueError: a NUL in it
        pass
    try:
        socket.inet_pton(socket.AF_INET6, host.strip("[]"))
        return f"[{host.strip('[]')}]:0"
    except (OSError, ValueError):
        return ""  # a name: the broker puts the caller's address instead


def _kind_of(sp: d.SystemProperties, group: str, at: int) -> tuple[MessageType, str]:
    declared = sp.message_type
    if declared == d.TRANSACTION:
        if group or at:
            raise _bad(
                "message.system_properties.message_type",
                d.BAD_REQUEST,
                "a TRANSACTION message cannot have a message group or a delivery time",
            )
        return MessageType.TRANSACTION, "it is a transactional half message"
    if group and at:
        raise _bad(
            "message.system_properties",
            d.BAD_REQUEST,
            "a message cannot have both a message group and a delivery time",
        )
    if group:
        return MessageType.FIFO, f"it has message group {group!r}"
    if at:
        return MessageType.DELAY, "it has a delivery timestamp"
    if declared in (d.FIFO, d.DELAY):
        raise _bad(
            "message.system_properties.message_type",
            d.BAD_REQUEST,
            f"is {d.MessageType.Name(declared)} but the message has no "
            + ("message group" if declared == d.FIFO else "delivery timestamp"),
        )
    if declared in (d.LITE, d.PRIORITY):
        raise _bad(
            "message.system_properties.message_type",
            d.UNSUPPORTED,
            f"{d.MessageType.Name(declared)} messages are not supported by Apogee",
        )
    return MessageType.NORMAL, "it has no message group, delivery time or transaction"


def _ts(ms: int) -> Timestamp:
    """``ms`` as a timestamp, brought into the range one can hold (a stored time may be any
    64-bit number an Apogee client gave)."""
    t = Timestamp()
    t.FromMilliseconds(min(max(ms, MIN_TIMESTAMP_MS), MAX_TIMESTAMP_MS))
    return t


def _host(raw: str) -> str:
    """A stored ``ip:port`` as v2 shows a host: the address alone."""
    host, sep, _ = raw.rpartition(":")
    return host.strip("[]") if sep else raw


def message_type_of(props: dict[str, str], topic_type: str) -> int:
    """A stored message's v2 type: from what it carries (a message group, a due time), else
    from its topic's type (a committed transaction keeps no mark of it)."""
    if PROP_TRAN_MSG in props or topic_type == MessageType.TRANSACTION:
        return d.TRANSACTION
    if PROP_SHARDING_KEY in props:
        return d.FIFO
    if PROP_DELIVER_AT in props or PROP_TIMER_DELIVER in props or topic_type == MessageType.DELAY:
        return d.DELAY
    return d.NORMAL


def to_wire(
    msg: StoredMessage,
    *,
    topic: str,
    handle: str = "",
    attempt: int = 1,
    invisible_ms: int = 0,
    topic_type: str = "",
    dead_letter: tuple[str, str] | None = None,
) -> d.Message:
    """``msg`` as v2 delivers it (``topic``: the name the consumer asked for)."""
    props = msg.properties
    body = msg.body
    if msg.sys_flag & SYSFLAG_COMPRESSED:
        body = zlib.decompress(body)
    sp = d.SystemProperties(
        keys=msg.keys,
        message_id=msg.unique_id or f"{msg.phys_offset:032X}",
        body_digest=d.Digest(type=d.MD5, checksum=hashlib.md5(body).hexdigest().upper()),
        body_encoding=d.IDENTITY,
        message_type=message_type_of(props, topic_type),  # type: ignore[arg-type]
        born_timestamp=_ts(msg.born_timestamp),
        born_host=_host(msg.born_host),
        store_timestamp=_ts(msg.store_timestamp),
        store_host=msg.store_host,
        queue_id=msg.queue_id,
        queue_offset=msg.queue_offset,
        delivery_attempt=max(attempt, 1),
    )
    tag = props.get(PROP_TAGS)
    if tag is not None:
        sp.tag = tag
    if handle:
        sp.receipt_handle = handle
    if invisible_ms:
        sp.invisible_duration.CopyFrom(
            Duration(seconds=invisible_ms // 1000, nanos=invisible_ms % 1000 * 1_000_000)
        )
    group = props.get(PROP_SHARDING_KEY)
    if group:
        sp.message_group = group
    at = props.get(PROP_TIMER_DELIVER) or props.get(PROP_DELIVER_AT)
    if at and at.isdigit():
        sp.delivery_timestamp.CopyFrom(_ts(int(at)))
    trace = props.get(PROP_TRACEPARENT)
    if trace:
        sp.trace_context = trace
    origin = props.get(PROP_DLQ_ORIGIN_TOPIC)
    if dead_letter is None and origin and topic.startswith("%DLQ%"):
        dead_letter = (origin, sp.message_id)  # a dead letter read from %DLQ%<group>
    if dead_letter is not None:
        sp.dead_letter_queue.CopyFrom(
            d.DeadLetterQueue(topic=dead_letter[0], message_id=dead_letter[1])
        )
    user = {
        k: v
        for k, v in props.items()
        if k not in _OWN and not is_broker_property(k) and k != PROP_TRAN_MSG
    }
    return d.Message(
        topic=d.Resource(name=topic), user_properties=user, system_properties=sp, body=body
    )


def endpoints_of(address: str) -> d.Endpoints:
    """The v2 endpoints of ``host:port`` (IPv4, IPv6 or a domain name, as the host is)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    scheme = d.DOMAIN_NAME
    try:
        socket.inet_pton(socket.AF_INET, host)
        scheme = d.IPv4
    except OSError:
        try:
            socket.inet_pton(socket.AF_INET6, host)
            scheme = d.IPv6
        except OSError:
            pass
    return d.Endpoints(scheme=scheme, addresses=[d.Address(host=host, port=int(port or 0))])


def check_invisible_ms(ms: int, field: str) -> int:
    """An invisible time a client asked for: 1 s to 12 h."""
    if not 1000 <= ms <= 12 * 3_600_000:
        raise InvalidArgumentError(
            field=field, rule=f"must be between 1 s and 12 h, got {ms / 1000:g} s"
        )
    return ms
