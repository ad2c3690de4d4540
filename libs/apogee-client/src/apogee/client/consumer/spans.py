"""The consumers' spans (when they trace): ``receive`` and ``process``, per message.

- ``receive <topic>`` (kind CONSUMER), one per message, a child of the context the message
  carries (its ``traceparent``; a message without one starts a trace of its own). It starts when
  the message arrives at the consumer and ends when the listener gets it (push consumer) or
  ``poll`` returns it (pull consumer): its duration is the time the message waited in the
  consumer. A message of the retry topic is received under its original topic, with its
  reconsume times.
- ``process <topic>`` (kind CONSUMER), one per listener call: a child of the message's receive
  span when the call has one message (the default, ``consume_batch_size=1``); for a call with
  several, no parent of its own and a link to each message's receive span. The listener runs
  with it as the current span (so the application's spans are its children); a failed call
  (raised, ``RETRY_LATER``, past ``consume_timeout``) ends it with an error.

A message the listener failed on is sent back with the context of that attempt (its process
span, or the receive span for a pull consumer), and the broker links the stored retry or dead
letter to it.

None of this runs when the consumer does not trace (see :mod:`apogee.common.tracing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Tracer
from opentelemetry.util.types import AttributeValue

from apogee.client.consumer.records import ReceivedMessage
from apogee.codec import PROP_TRACEPARENT, PROP_TRACESTATE
from apogee.common import tracing as t

__all__ = ["MessageTrace", "attempt_traceparent", "handed_over", "received", "start_process"]

_NO_LINKS: Final[tuple[Link, ...]] = ()


class MessageTrace:
    """What a traced message carries through the consumer: its receive span, and the context
    of its last listener call."""

    __slots__ = ("attempt", "receive")

    def __init__(self, receive: Span) -> None:
        self.receive = receive
        self.attempt: SpanContext = receive.get_span_context()


def _trace_of(m: ReceivedMessage) -> MessageTrace | None:
    trace: MessageTrace | None = getattr(m, "_trace", None)
    return trace


def received(tracer: Tracer, msgs: Sequence[ReceivedMessage], group: str, client_id: str) -> None:
    """Start the receive span of each message just arrived."""
    for m in msgs:
        props = m.properties
        carried = t.remote_context(props.get(PROP_TRACEPARENT, ""), props.get(PROP_TRACESTATE, ""))
        attrs: dict[str, AttributeValue] = {
            t.MESSAGING_SYSTEM: t.SYSTEM,
            t.OPERATION_NAME: "receive",
            t.OPERATION_TYPE: "receive",
            t.DESTINATION: m.topic,
            t.PARTITION: str(m.queue_id),
            t.CONSUMER_GROUP: group,
            t.CLIENT_ID: client_id,
            t.MESSAGE_ID: m.unique_id,
            t.BROKER: m.broker_name,
            t.QUEUE_OFFSET: m.queue_offset,
            t.RECONSUME_TIMES: m.reconsume_times,
        }
        if m.tags:
            attrs[t.TAG] = m.tags
        span = tracer.start_span(f"receive {m.topic}", t.parent(carried), SpanKind.CONSUMER, attrs)
        m._trace = MessageTrace(span)  # type: ignore[attr-defined]


def handed_over(msgs: Sequence[ReceivedMessage]) -> None:
    """The application has the messages: end their receive spans."""
    for m in msgs:
        trace = _trace_of(m)
        if trace is not None and trace.receive.is_recording():
            trace.receive.end()


def start_process(
    tracer: Tracer, msgs: Sequence[ReceivedMessage], group: str, client_id: str
) -> Span:
    """The process span of one listener call on ``msgs`` (receive spans end here); the caller
    ends it."""
    handed_over(msgs)
    first = msgs[0]
    attrs: dict[str, AttributeValue] = {
        t.MESSAGING_SYSTEM: t.SYSTEM,
        t.OPERATION_NAME: "process",
        t.OPERATION_TYPE: "process",
        t.DESTINATION: first.topic,
        t.CONSUMER_GROUP: group,
        t.CLIENT_ID: client_id,
    }
    traces = [_trace_of(m) for m in msgs]
    if len(msgs) == 1:
        trace = traces[0]
        attrs[t.MESSAGE_ID] = first.unique_id
        attrs[t.PARTITION] = str(first.queue_id)
        attrs[t.QUEUE_OFFSET] = first.queue_offset
        attrs[t.RECONSUME_TIMES] = first.reconsume_times
        context = t.parent(trace.receive.get_span_context() if trace is not None else None)
        links: Sequence[Link] = _NO_LINKS
    else:
        attrs[t.BATCH_COUNT] = len(msgs)
        context = t.ROOT
        links = [Link(tr.receive.get_span_context()) for tr in traces if tr is not None]
    span = tracer.start_span(f"process {first.topic}", context, SpanKind.CONSUMER, attrs, links)
    attempt = span.get_span_context()
    for trace in traces:
        if trace is not None:
            trace.attempt = attempt
    return span


def attempt_traceparent(m: ReceivedMessage) -> str:
    """The ``traceparent`` of the last attempt on ``m`` (its process span, else its receive
    span), ``""`` when it is not traced."""
    trace = _trace_of(m)
    return "" if trace is None else t.traceparent(trace.attempt)
