"""The broker's spans (when it traces): ``store <topic>``, one per stored message that carries a
trace context.

A message sent by a tracing producer carries the context of its send span in its
``traceparent`` property; every time a broker stores it (the send itself, its copy under the
schedule topic, its delivery there by the schedule service, a retry or a dead letter, a
transaction's half and its commit) a ``store`` span, child of that context, records where it
went: topic, queue, queue offset, broker, and for the schedule topic's copy its real topic and
delivery time. The span runs from the request's arrival to the append (and, with synchronous
flush, the fsync). A copy made for a failed delivery (send-back) also links to the attempt
that failed, when the consumer sent its context.

Messages without a trace context get no span: the broker does not start traces of its own (it
could not hand their context on: it stores the sender's bytes as they are). The kind is
CONSUMER, so that tools drawing a service graph from PRODUCER/CONSUMER pairs draw the
producer (or the schedule service) and the broker.

Nothing here runs when the broker does not trace: the send path checks for a
:class:`StoreSpans` once per request and decodes nothing for it otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from opentelemetry.trace import Link, SpanContext, SpanKind, Tracer
from opentelemetry.util.types import AttributeValue

from apogee.codec import (
    HEADER,
    PROP_DELAY,
    PROP_DELIVER_AT,
    PROP_REAL_TOPIC,
    PROP_TRACEPARENT,
    PROP_TRACESTATE,
)
from apogee.codec.send import RecordRef
from apogee.common import tracing as t
from apogee.common.errors import ApogeeError
from apogee.store import AppendResult, Message

_PARENT_AT: Final = f"{PROP_TRACEPARENT}\x01".encode()
_STATE_AT: Final = f"{PROP_TRACESTATE}\x01".encode()
#: What a link to a failed delivery attempt says.
FAILED_ATTEMPT: Final = {"messaging.apogee.link": "failed delivery attempt"}


class StoreSpans:
    """Records the store spans of one broker."""

    def __init__(self, tracer: Tracer, broker_name: str) -> None:
        self.tracer = tracer
        self.broker_name = broker_name

    def messages(
        self,
        batch: Sequence[Message],
        results: Sequence[AppendResult] | None,
        began_ns: int,
        error: ApogeeError | None = None,
        attempts: Sequence[str] | None = None,
    ) -> None:
        """``batch`` was stored (``results``; ``error``: durability unconfirmed) or not
        (``results`` None, ``error`` why); ``attempts``: per message, the ``traceparent`` of a
        failed delivery attempt to link to (``""``: none)."""
        for i, m in enumerate(batch):
            props = m.properties
            if not props or PROP_TRACEPARENT not in props:
                continue
            ctx = t.remote_context(props[PROP_TRACEPARENT], props.get(PROP_TRACESTATE, ""))
            if ctx is None:
                continue
            attrs: dict[str, AttributeValue] = {
                t.MESSAGING_SYSTEM: t.SYSTEM,
                t.OPERATION_NAME: "store",
                t.BROKER: self.broker_name,
            }
            topic, queue_id = m.topic, m.queue_id
            if results is not None:
                r = results[i]
                topic, queue_id = r.topic, r.queue_id
                attrs[t.QUEUE_OFFSET] = r.queue_offset
                attrs[t.MESSAGE_ID] = r.unique_id
            elif m.unique_id:
                attrs[t.MESSAGE_ID] = m.unique_id
            attrs[t.DESTINATION] = topic
            attrs[t.PARTITION] = str(queue_id)
            real = props.get(PROP_REAL_TOPIC)
            if real:
                attrs[t.REAL_TOPIC] = real
                due = props.get(PROP_DELIVER_AT, "")
                if due.isdigit():
                    attrs[t.DELIVERY_TIMESTAMP] = int(due)
                level = props.get(PROP_DELAY, "")
                if level.isdigit():
                    attrs[t.DELAY_LEVEL] = int(level)
            if m.reconsume_times:
                attrs[t.RECONSUME_TIMES] = m.reconsume_times
            links: list[Link] = []
            if attempts is not None and attempts[i]:
                attempt = t.remote_context(attempts[i])
                if attempt is not None:
                    links.append(Link(attempt, FAILED_ATTEMPT))
            self._record(ctx, topic, attrs, links, began_ns, error)

    def records(
        self,
        block: bytes,
        spans: Sequence[tuple[int, int]],
        refs: Sequence[RecordRef],
        queue_offsets: Sequence[int],
        began_ns: int,
        errors: dict[int, ApogeeError],
    ) -> None:
        """The send records of ``block`` at ``spans`` (``refs``: what the store needed of
        each) were appended: at ``queue_offsets`` (-1: not stored, ``errors[k]`` why)."""
        for k, (start, end) in enumerate(spans):
            ctx = _record_context(block, start, end)
            if ctx is None:
                continue
            topic, queue_id, _, _, _, uid = refs[k]
            attrs: dict[str, AttributeValue] = {
                t.MESSAGING_SYSTEM: t.SYSTEM,
                t.OPERATION_NAME: "store",
                t.BROKER: self.broker_name,
                t.DESTINATION: topic,
                t.PARTITION: str(queue_id),
                t.MESSAGE_ID: uid,
            }
            offset = queue_offsets[k]
            if offset >= 0:
                attrs[t.QUEUE_OFFSET] = offset
            self._record(ctx, topic, attrs, (), began_ns, errors.get(k))

    def _record(
        self,
        ctx: SpanContext,
        topic: str,
        attrs: dict[str, AttributeValue],
        links: Sequence[Link],
        began_ns: int,
        error: ApogeeError | None,
    ) -> None:
        span = self.tracer.start_span(
            f"store {topic}", t.parent(ctx), SpanKind.CONSUMER, attrs, links, began_ns
        )
        if error is not None:
            t.failed(span, error)
        span.end()


def _record_context(block: bytes, start: int, end: int) -> SpanContext | None:
    """The trace context in the properties of the send record at ``block[start:end]``, found
    in the bytes (only its values are decoded)."""
    plen = HEADER.unpack_from(block, start)[16]
    at = end - plen
    parent = _value(block, at, end, _PARENT_AT)
    if not parent:
        return None
    return t.remote_context(parent, _value(block, at, end, _STATE_AT))


def _value(block: bytes, at: int, end: int, name: bytes) -> str:
    """The value of the property ``name`` (with its ``\\x01``) in ``block[at:end]``, ``""``
    when absent."""
    if block.startswith(name, at):
        found = at
    else:
        found = block.find(b"\x02" + name, at, end)
        if found < 0:
            return ""
        found += 1
    value_at = found + len(name)
    stop = block.find(b"\x02", value_at, end)
    raw = block[value_at : end if stop < 0 else stop]
    return raw.decode(errors="replace")
