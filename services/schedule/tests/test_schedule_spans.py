"""The schedule service's spans: a tracing resolver asks each Resolve call for its messages'
trace contexts and records, per traced message, a hold span (from its store under the schedule
topic to the call) and, when delivered, a deliver span (the call, with its lateness); a failed
delivery ends with an error; an untraced resolver asks for nothing."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from apogee.common.clock import ManualClock
from apogee_schedule.core.heap import Pending
from apogee_schedule.core.layout import Layout
from apogee_schedule.core.model import (
    BrokerScheduleState,
    Outcome,
    ResolveAction,
    ResolveResult,
    ScanQueue,
    ScanResult,
    ScheduleEntry,
    TraceInfo,
)
from apogee_schedule.core.progress import ProgressBook, QueueState
from apogee_schedule.core.resolving import Resolver
from apogee_schedule.core.scanning import SessionState
from apogee_schedule.core.stats import ScheduleStats

pytestmark = pytest.mark.unit

LAYOUT = Layout(delay_ms=(1000, 2000), first_slot_queue=32, slots=10, slot_ms=1000)
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SEND_SPAN = 0xB7AD6B7169203331
PARENT = f"00-{TRACE_ID:032x}-{SEND_SPAN:016x}-01"


class FakeClient:
    """Answers every Resolve: RESOLVED, with the trace contexts it holds when asked."""

    address = "fake"

    def __init__(self, traces: Mapping[int, TraceInfo], failing: frozenset[int]) -> None:
        self.traces = traces
        self.failing = failing
        self.asked: list[bool] = []

    async def get_state(self) -> BrokerScheduleState:
        raise NotImplementedError

    async def scan(self, queues: Sequence[ScanQueue], max_entries: int, hold_ms: int) -> ScanResult:
        raise NotImplementedError

    async def resolve(
        self, items: Sequence[tuple[ScheduleEntry, ResolveAction]], trace_context: bool = False
    ) -> list[ResolveResult]:
        self.asked.append(trace_context)
        out = []
        for e, action in items:
            trace = self.traces.get(e.queue_offset) if trace_context else None
            if e.queue_offset in self.failing:
                out.append(ResolveResult(Outcome.FAILED, "disk full", "", trace))
            else:
                topic = "Orders" if action is ResolveAction.DELIVER else "SCHEDULE_TOPIC_XXXX"
                out.append(ResolveResult(Outcome.RESOLVED, "", topic, trace))
        return out

    async def commit(self, offsets: Mapping[int, int]) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass


@dataclass
class Parts:
    resolver: Resolver
    exporter: InMemorySpanExporter
    state: SessionState


def parts(client: FakeClient, clock: ManualClock, traced: bool) -> Parts:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    state = SessionState(LAYOUT, ProgressBook([QueueState(0, 0, 9, 0)]))
    r = Resolver(
        "broker-a",
        client,
        state,
        ScheduleStats(),
        clock,
        max_batch=8,
        on_error=lambda exc: None,
        tracer=provider.get_tracer("test") if traced else None,
    )
    return Parts(r, exporter, state)


async def test_delivered_and_parked_messages_get_their_spans() -> None:
    now_ms = time.time_ns() // 1_000_000
    clock = ManualClock(now_ms)
    stored_ms = now_ms - 1500
    traces = {
        0: TraceInfo(PARENT, "rojo=1", stored_ms, "ID-0", "Orders"),
        1: TraceInfo(PARENT, "", stored_ms, "ID-1", "Orders"),
        3: TraceInfo(PARENT, "", stored_ms, "ID-3", "Orders"),
    }
    client = FakeClient(traces, failing=frozenset({3}))
    p = parts(client, clock, traced=True)
    due = now_ms - 200  # 200 ms late
    for offset, at in ((0, due), (1, now_ms + 60_000), (2, due), (3, due)):
        p.state.heap.push(
            Pending(ScheduleEntry(0, offset, 100 + offset, 200, at), ResolveAction.DELIVER)
        )
    await p.resolver.hand_back()
    assert client.asked == [True]
    spans: list[ReadableSpan] = list(p.exporter.get_finished_spans())
    names = sorted((s.name, s.attributes["messaging.message.id"]) for s in spans)  # type: ignore[index]
    assert names == [
        ("deliver Orders", "ID-0"),
        ("deliver Orders", "ID-3"),
        ("hold Orders", "ID-0"),
        ("hold Orders", "ID-1"),  # parked again (due later): a hold and no deliver
        ("hold Orders", "ID-3"),
    ]
    for s in spans:
        assert s.context.trace_id == TRACE_ID
        assert s.parent is not None
        assert s.parent.span_id == SEND_SPAN
        assert s.attributes is not None
        assert s.attributes["messaging.apogee.broker_name"] == "broker-a"
    by = {(s.name, s.attributes["messaging.message.id"]): s for s in spans}  # type: ignore[index]
    hold = by[("hold Orders", "ID-0")]
    deliver = by[("deliver Orders", "ID-0")]
    assert hold.kind is SpanKind.INTERNAL
    assert deliver.kind is SpanKind.PRODUCER
    assert hold.start_time == stored_ms * 1_000_000
    assert hold.end_time == deliver.start_time
    assert (deliver.end_time or 0) >= (deliver.start_time or 0)
    assert hold.attributes is not None
    assert hold.attributes["messaging.apogee.schedule.action"] == "deliver"
    assert deliver.attributes is not None
    assert deliver.attributes["messaging.apogee.schedule.lateness_ms"] >= 200  # type: ignore[operator]
    assert deliver.status.status_code is StatusCode.UNSET
    parked = by[("hold Orders", "ID-1")]
    assert parked.attributes is not None
    assert parked.attributes["messaging.apogee.schedule.action"] == "park"
    failed = by[("deliver Orders", "ID-3")]
    assert failed.status.status_code is StatusCode.ERROR
    assert "disk full" in (failed.status.description or "")


async def test_an_untraced_resolver_asks_for_no_trace_context() -> None:
    clock = ManualClock(time.time_ns() // 1_000_000)
    client = FakeClient({0: TraceInfo(PARENT)}, failing=frozenset())
    p = parts(client, clock, traced=False)
    p.state.heap.push(Pending(ScheduleEntry(0, 0, 100, 200, 0), ResolveAction.DELIVER))
    await p.resolver.hand_back()
    assert client.asked == [False]
    assert p.exporter.get_finished_spans() == ()
