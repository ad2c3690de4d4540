"""The checker's spans, on the in-memory broker and virtual time: a tracing round looks each
half it checks up for its trace context and checks it under a ``check`` span, child of that
context, with the outcome; a half without one (or not found) is checked without a span; an
untraced round looks nothing up."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from apogee.common.errors import NotFoundError, UnavailableError
from apogee_txn_checker.core.rounds import CheckRound

pytestmark = pytest.mark.unit

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SEND_SPAN = 0xB7AD6B7169203331
PARENT = f"00-{TRACE_ID:032x}-{SEND_SPAN:016x}-01"


class Lookups:
    """The broker's answers to a tracing checker's lookups, by transaction id."""

    def __init__(self, contexts: dict[str, str]) -> None:
        self.contexts = contexts
        self.asked: list[str] = []

    async def __call__(self, unique_id: str) -> tuple[str, str]:
        self.asked.append(unique_id)
        if unique_id == "broken":
            raise UnavailableError(what="broker", detail="lookup failed")
        if unique_id not in self.contexts:
            raise NotFoundError(what=f"message {unique_id!r}", detail="no such message")
        return self.contexts[unique_id], ""


def traced_round(rounds: Any, exporter: InMemorySpanExporter | None) -> CheckRound:
    provider = TracerProvider()
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return CheckRound(
        "cluster/broker-a",
        rounds.broker,
        rounds.settings,
        rounds.vt.clock,
        rounds.stats,
        rounds.limiter,
        deadline=rounds.vt.now + rounds.settings.check_interval_s,
        sleep=rounds.vt.sleep,
        tracer=provider.get_tracer("test") if exporter is not None else None,
    )


async def test_traced_halves_are_checked_under_their_spans(rounds: Any) -> None:
    b = rounds.broker
    lookups = Lookups({"t-traced": PARENT, "t-plain": ""})
    b.trace_context = lookups
    for uid in ("t-traced", "t-plain", "t-unknown", "broken"):
        b.send_half(uid)
    await rounds.vt.advance(7)
    exporter = InMemorySpanExporter()
    await rounds.vt.run(traced_round(rounds, exporter).run())
    assert b.checked() == [0, 1, 2, 3]
    assert lookups.asked == ["t-traced", "t-plain", "t-unknown", "broken"]
    (span,) = exporter.get_finished_spans()
    assert span.name == "check Orders"
    assert span.kind is SpanKind.CLIENT
    assert span.context.trace_id == TRACE_ID
    assert span.parent is not None
    assert span.parent.span_id == SEND_SPAN
    assert span.attributes is not None
    assert span.attributes["messaging.apogee.transaction_id"] == "t-traced"
    assert span.attributes["messaging.apogee.client_group"] == "G"
    assert span.attributes["messaging.apogee.check.outcome"] == "check_sent"
    assert span.attributes["messaging.apogee.check.times"] == 1
    assert span.status.status_code is StatusCode.UNSET


async def test_a_failed_check_ends_its_span_with_an_error(rounds: Any) -> None:
    b = rounds.broker
    b.trace_context = Lookups({"t1": PARENT})
    b.send_half("t1")
    b.fail["check_half"] = NotFoundError(what="half offset 0", detail="gone")
    await rounds.vt.advance(7)
    exporter = InMemorySpanExporter()
    report = await rounds.vt.run(traced_round(rounds, exporter).run())
    assert report.errors == 1
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR


async def test_an_untraced_round_looks_nothing_up(rounds: Any) -> None:
    b = rounds.broker
    lookups = Lookups({"t1": PARENT})
    b.trace_context = lookups
    b.send_half("t1")
    await rounds.vt.advance(7)
    await rounds.vt.run(traced_round(rounds, None).run())
    assert b.checked() == [0]
    assert lookups.asked == []
