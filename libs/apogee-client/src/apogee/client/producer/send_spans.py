"""The producer's spans (when it traces): one ``send <topic>`` span per message, whose context
the message carries to every later hop in its ``traceparent`` property.

A send span (kind PRODUCER) starts when the message is handed to the producer and ends when
its send settles (stored, failed, timed out): its duration is the send's, retries and waiting
in a batch included. Its parent is the caller's current span; a message that already carries
a ``traceparent`` (set by the application, or a dead letter being redriven) keeps a link to
it, and is its child when the caller has no span of its own, so a redriven message stays in
the trace it came from.

A batch (``send_batch``) is one request for many messages: each message gets a short
``create <topic>`` span (its own context), and the request one ``send <topic>`` span that links
to them all.

None of this runs when the producer does not trace: the producer checks for a tracer once per
send and takes its ordinary path without one (see :mod:`apogee.common.tracing`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Tracer
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:
    from apogee.client.producer.config import ProducerConfig

from apogee.client.message import Message, SendResult
from apogee.client.producer import wire
from apogee.client.producer.delivery import Delivery
from apogee.codec import PROP_TRACEPARENT, PROP_TRACESTATE, TRACE_PROPERTIES
from apogee.common import tracing as t

__all__ = [
    "TracedDelivery",
    "abandon",
    "carried_context",
    "encode_batch_traced",
    "encode_traced",
    "start_create",
    "start_send",
    "trace_field",
    "trace_properties",
    "without_trace",
]

_PARENT_AT: Final = f"{PROP_TRACEPARENT}\x01"
_STATE_AT: Final = f"{PROP_TRACESTATE}\x01"


def carried_context(msg: Message) -> SpanContext | None:
    """The trace context ``msg`` already carries in its properties, if a valid one."""
    props = msg.properties
    if not props or PROP_TRACEPARENT not in props:
        return None
    return t.remote_context(props[PROP_TRACEPARENT], props.get(PROP_TRACESTATE, ""))


def without_trace(msg: Message) -> Message:
    """``msg`` as the producer encodes it when it traces: the trace properties it carried give
    way to the send span's (the caller's object is not changed)."""
    props = msg.properties
    if not props or not TRACE_PROPERTIES.intersection(props):
        return msg
    kept = {k: v for k, v in props.items() if k not in TRACE_PROPERTIES}
    return dataclasses.replace(msg, properties=kept)


def _attributes(msg: Message, uid: str, group: str, operation: str) -> dict[str, AttributeValue]:
    attrs: dict[str, AttributeValue] = {
        t.MESSAGING_SYSTEM: t.SYSTEM,
        t.OPERATION_NAME: operation,
        t.OPERATION_TYPE: operation,
        t.DESTINATION: msg.topic,
        t.MESSAGE_ID: uid,
        t.CLIENT_GROUP: group,
    }
    if msg.tags:
        attrs[t.TAG] = msg.tags
    if msg.keys:
        attrs[t.KEYS] = list(msg.keys)
    if msg.delay_level:
        attrs[t.DELAY_LEVEL] = msg.delay_level
    if msg.deliver_at is not None:
        attrs[t.DELIVERY_TIMESTAMP] = msg.deliver_at_ms
    return attrs


def _start(
    tracer: Tracer, msg: Message, uid: str, group: str, operation: str, kind: SpanKind
) -> Span:
    carried = carried_context(msg)
    links: list[Link] = []
    context = None  # the caller's
    if carried is not None:
        if trace.get_current_span().get_span_context().is_valid:
            links.append(Link(carried))
        else:
            context = t.parent(carried)
    return tracer.start_span(
        f"{operation} {msg.topic}",
        context,
        kind,
        _attributes(msg, uid, group, operation),
        links,
    )


def start_send(tracer: Tracer, msg: Message, uid: str, group: str) -> Span:
    """The send span of one message (ended by its :class:`TracedDelivery`)."""
    return _start(tracer, msg, uid, group, "send", SpanKind.PRODUCER)


def start_create(tracer: Tracer, msg: Message, uid: str, group: str) -> Span:
    """The create span of one message of a batch (the caller ends it once encoded)."""
    return _start(tracer, msg, uid, group, "create", SpanKind.PRODUCER)


def trace_properties(span: Span) -> dict[str, str]:
    """The trace properties of a message sent under ``span``."""
    ctx = span.get_span_context()
    props = {PROP_TRACEPARENT: t.traceparent(ctx)}
    state = t.tracestate(ctx)
    if state:
        props[PROP_TRACESTATE] = state
    return props


def trace_field(span: Span) -> bytes:
    """The trace properties of a message sent under ``span``, as the record holds them."""
    ctx = span.get_span_context()
    state = t.tracestate(ctx)
    text = f"{_PARENT_AT}{t.traceparent(ctx)}\x02"
    if state:
        text += f"{_STATE_AT}{state}\x02"
    return text.encode()


class TracedDelivery(Delivery):
    """A :class:`~apogee.client.producer.delivery.Delivery` that ends its span when the send
    settles, with where the message went (or why it failed)."""

    __slots__ = ("span",)

    span: Span

    def _cleanup(self, outcome: Any) -> None:
        if not self.finished:
            _end(self, self.span, outcome)
        super()._cleanup(outcome)


def _end(delivery: Delivery, span: Span, outcome: Any) -> None:
    mq = delivery.mq
    if mq is not None:
        span.set_attribute(t.PARTITION, str(mq.queue_id))
        span.set_attribute(t.BROKER, mq.broker_name)
    if delivery.attempt:
        span.set_attribute(t.SEND_RETRIES, delivery.attempt)
    if isinstance(outcome, BaseException):
        t.failed(span, outcome)
    elif isinstance(outcome, SendResult):
        _stored(span, outcome)
    elif isinstance(outcome, list):
        span.set_attribute(t.BATCH_COUNT, len(outcome))
    span.end()


def _stored(span: Span, result: SendResult) -> None:
    attrs: Mapping[str, AttributeValue] = {
        t.BROKER: result.broker_name,
        t.PARTITION: str(result.queue_id),
        t.QUEUE_OFFSET: result.queue_offset,
    }
    span.set_attributes(attrs)
    if result.status.value != "OK":
        span.set_attribute(t.SEND_STATUS, result.status.value)


def encode_traced(
    tracer: Tracer | None, cfg: ProducerConfig, msg: Message, uid: str, dedup: str
) -> tuple[bytearray, Span]:
    """The record of ``msg`` (its dedup id ``dedup``, or none) carrying the context of its
    send span, started here."""
    assert tracer is not None
    span = start_send(tracer, msg, uid, cfg.group)
    try:
        record = wire.encode(
            without_trace(msg),
            uid,
            cfg.clock.time_ms(),
            cfg.compress_over,
            0,
            trace_field(span),
            dedup,
        )
    except BaseException as exc:
        abandon(span, exc)
        raise
    return record, span


def encode_batch_traced(
    tracer: Tracer,
    cfg: ProducerConfig,
    batch: list[Message],
    ids: list[str],
    born: int,
    dedups: list[str],
) -> tuple[list[bytearray], Span]:
    """The records of a batch, each carrying the context of its create span (started and
    ended here), and the batch's send span, linked to them (ended by its delivery)."""
    records: list[bytearray] = []
    links: list[Link] = []
    for m, uid, d in zip(batch, ids, dedups, strict=True):
        create = start_create(tracer, m, uid, cfg.group)
        try:
            records.append(
                wire.encode(
                    without_trace(m), uid, born, cfg.compress_over, 0, trace_field(create), d
                )
            )
        finally:
            create.end()
        links.append(Link(create.get_span_context()))
    span = tracer.start_span(
        f"send {batch[0].topic}",
        kind=SpanKind.PRODUCER,
        attributes={
            t.MESSAGING_SYSTEM: t.SYSTEM,
            t.OPERATION_NAME: "send",
            t.OPERATION_TYPE: "send",
            t.DESTINATION: batch[0].topic,
            t.BATCH_COUNT: len(batch),
            t.CLIENT_GROUP: cfg.group,
        },
        links=links,
    )
    return records, span


def abandon(span: Span | None, exc: BaseException) -> None:
    """End the span of a send that failed before its delivery started."""
    if span is not None:
        t.failed(span, exc)
        span.end()
