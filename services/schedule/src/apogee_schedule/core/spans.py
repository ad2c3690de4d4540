"""The schedule service's spans (when it traces): ``hold`` and ``deliver``, per message.

The service never reads a message (a scan returns ConsumeQueue entries; a broker reads the
record when it resolves the entry), so a tracing service asks each Resolve call for the trace
context of the messages it resolves, and records their spans once the call has answered, both
children of the context the message carries (its producer's send span):

- ``hold <topic>`` (INTERNAL): from when the broker stored the message under the schedule
  topic until the Resolve call that delivered it (or parked it again in a later slot: then
  ``messaging.apogee.schedule.action`` is ``park`` and a later hold follows);
- ``deliver <topic>`` (PRODUCER): the Resolve call that stored it in its real topic, with how
  late it was (``messaging.apogee.schedule.lateness_ms``: the call's start after the delivery
  time). A FAILED or DROPPED delivery ends with an error.

Messages without a trace context get no spans. Nothing here runs when the service does not
trace (see :mod:`apogee.common.tracing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.util.types import AttributeValue

from apogee.common import tracing as t
from apogee_schedule.core.heap import Pending
from apogee_schedule.core.model import Outcome, ResolveAction, ResolveResult

_MS: Final = 1_000_000


class ResolveSpans:
    """Records the hold and deliver spans of one broker's resolved messages."""

    def __init__(self, tracer: Tracer, broker: str) -> None:
        self.tracer = tracer
        self.broker = broker

    def resolved(
        self,
        batch: Sequence[Pending],
        results: Sequence[ResolveResult],
        began_ns: int,
        ended_ns: int,
    ) -> None:
        """One Resolve call, from ``began_ns`` to ``ended_ns`` (ns since the epoch), answered
        ``results`` for ``batch``."""
        for p, r in zip(batch, results, strict=True):
            info = r.trace
            if info is None:
                continue
            ctx = t.remote_context(info.traceparent, info.tracestate)
            if ctx is None:
                continue
            parent = t.parent(ctx)
            e = p.entry
            topic = info.real_topic or r.topic
            common: dict[str, AttributeValue] = {
                t.MESSAGING_SYSTEM: t.SYSTEM,
                t.DESTINATION: topic,
                t.MESSAGE_ID: info.unique_id,
                t.BROKER: self.broker,
                t.DELIVERY_TIMESTAMP: e.deliver_at_ms,
            }
            held_from = info.store_timestamp_ms * _MS if info.store_timestamp_ms else began_ns
            hold = self.tracer.start_span(
                f"hold {topic}",
                parent,
                SpanKind.INTERNAL,
                {**common, t.OPERATION_NAME: "hold", t.SCHEDULE_ACTION: p.action.value},
                start_time=min(held_from, began_ns),
            )
            hold.end(began_ns)
            if p.action is not ResolveAction.DELIVER:
                continue
            deliver = self.tracer.start_span(
                f"deliver {topic}",
                parent,
                SpanKind.PRODUCER,
                {
                    **common,
                    t.OPERATION_NAME: "deliver",
                    t.OPERATION_TYPE: "send",
                    t.LATENESS_MS: max(0, began_ns // _MS - e.deliver_at_ms),
                    t.REAL_TOPIC: topic,
                },
                start_time=began_ns,
            )
            if r.outcome is Outcome.RESOLVED:
                deliver.set_attribute(t.DESTINATION, r.topic)
            else:
                t.failed(deliver, f"{r.outcome.value}: {r.reason or 'no reason given'}")
            deliver.end(ended_ns)
