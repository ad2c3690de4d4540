"""The transaction checker's spans (when it traces): ``check <topic>``, one per half checked.

The checker reads only the half queue's metadata (ScanHalf), so a tracing checker looks the
half up by its unique id (the transaction id: ``Broker.GetMessage``) to read the trace context
it carries, the context of the producer's send span, and checks it under a ``check`` span
(kind CLIENT: the check goes, through the broker, to a producer of the group), a child of that
context, with the outcome (``messaging.apogee.check.outcome``: ``check_sent``, ``decided``,
``gave_up``, ...) and the checks made so far. A half without a trace context (or one the lookup
cannot find) is checked without a span. The lookup is one small call per check, made only when
the checker traces; checks are rare (rate-limited per producer group).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from opentelemetry.trace import SpanContext, SpanKind, Tracer

from apogee.common import tracing as t
from apogee.common.errors import ApogeeError
from apogee_txn_checker.core.model import CheckResult, HalfEntry

log = logging.getLogger(__name__)


@runtime_checkable
class TraceLookup(Protocol):
    """What a tracing checker asks of a broker besides the checks."""

    async def trace_context(self, unique_id: str) -> tuple[str, str]:
        """The ``traceparent`` and ``tracestate`` of the message stored with ``unique_id``
        (``""`` each when it has none); raises ApogeeError (NOT_FOUND, ...)."""
        ...


class CheckSpans:
    """Runs the checks of one broker under their spans."""

    def __init__(self, tracer: Tracer, broker: str, lookup: TraceLookup) -> None:
        self.tracer = tracer
        self.broker = broker
        self.lookup = lookup

    async def _context(self, h: HalfEntry) -> SpanContext | None:
        try:
            parent, state = await self.lookup.trace_context(h.unique_id)
        except ApogeeError as err:
            log.debug("transaction %s: no trace context (%s)", h.unique_id, err)
            return None
        return t.remote_context(parent, state)

    async def check(
        self, h: HalfEntry, call: Callable[[], Awaitable[CheckResult | None]]
    ) -> CheckResult | None:
        """``await call()`` (the check of ``h``) under its span, when ``h`` carries a trace
        context."""
        ctx = await self._context(h)
        if ctx is None:
            return await call()
        span = self.tracer.start_span(
            f"check {h.topic}",
            t.parent(ctx),
            SpanKind.CLIENT,
            {
                t.MESSAGING_SYSTEM: t.SYSTEM,
                t.OPERATION_NAME: "check",
                t.DESTINATION: h.topic,
                t.MESSAGE_ID: h.unique_id,
                t.TRANSACTION_ID: h.unique_id,
                t.CLIENT_GROUP: h.producer_group,
                t.BROKER: self.broker,
                t.CHECK_TIMES: h.check_times,
            },
            start_time=time.time_ns(),
        )
        try:
            result = await call()
        except BaseException as exc:
            t.failed(span, exc)
            span.end()
            raise
        if result is None:
            t.failed(span, "the check failed; the half is left for the next round")
        else:
            span.set_attribute(t.CHECK_OUTCOME, result.outcome.value)
            span.set_attribute(t.CHECK_TIMES, max(h.check_times, result.check_times))
        span.end()
        return result
