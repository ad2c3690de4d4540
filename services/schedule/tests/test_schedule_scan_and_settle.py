"""What a scan's answer and a Resolve's answer do to memory, progress and counters (a manual
clock; the broker client is never called)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from apogee.common.clock import ManualClock
from apogee_schedule.core.client import BrokerScheduleClient
from apogee_schedule.core.heap import Pending
from apogee_schedule.core.layout import Layout
from apogee_schedule.core.model import (
    Outcome,
    ResolveAction,
    ResolveResult,
    ScanQueue,
    ScanQueueResult,
    ScanResult,
    ScheduleEntry,
)
from apogee_schedule.core.progress import ProgressBook, QueueState
from apogee_schedule.core.resolving import Resolver, retry_delay_ms
from apogee_schedule.core.scanning import Scanner, SessionState
from apogee_schedule.core.stats import ScheduleStats

pytestmark = pytest.mark.unit

LAYOUT = Layout(delay_ms=(1000, 2000), first_slot_queue=32, slots=10, slot_ms=1000)
T0 = 1_700_000_000_000  # slot queue 32


class Parts:
    def __init__(self, client: BrokerScheduleClient, catch_up: dict[int, int | None]) -> None:
        self.clock = ManualClock(T0)
        self.stats = ScheduleStats()
        self.state = SessionState(
            LAYOUT, ProgressBook([QueueState(0, 0, 3, 1), QueueState(33, 0, 9, -1)])
        )
        self.wakes = 0

        def wake() -> None:
            self.wakes += 1

        self.scanner = Scanner(
            "b",
            client,
            self.state,
            self.stats,
            self.clock,
            lead_ms=2000,
            hold_ms=500,
            catch_up=catch_up,
            wake_resolver=wake,
            on_error=lambda exc: None,
        )
        self.resolver = Resolver(
            "b", client, self.state, self.stats, self.clock, max_batch=8, on_error=lambda e: None
        )


@pytest.fixture
async def client() -> AsyncIterator[BrokerScheduleClient]:
    c = BrokerScheduleClient("127.0.0.1:1", 1.0)
    try:
        yield c
    finally:
        await c.close()


def entry(queue: int, offset: int, due: int) -> ScheduleEntry:
    return ScheduleEntry(queue, offset, 10_000 + offset, 200, due)


async def test_a_plan_reads_levels_up_to_the_lead_active_slots_and_catch_up(
    client: BrokerScheduleClient,
) -> None:
    parts = Parts(client, catch_up={38: 5})
    plan = parts.scanner.plan(T0 + 100)
    assert plan == [
        ScanQueue(0, 1, T0 + 2100),  # level 1 from its committed progress
        ScanQueue(1, 0, T0 + 2100),
        ScanQueue(41, 0),
        ScanQueue(32, 0),
        ScanQueue(33, 0),  # never committed: from its earliest entry
        ScanQueue(34, 0),
        ScanQueue(38, 0),
    ]
    # without the levels (they are read on a cadence), and a slot that stopped being active
    # is read once more to its end
    plan = parts.scanner.plan(T0 + 1100, levels=False)
    assert [q.queue_id for q in plan] == [32, 33, 34, 35, 38, 41]
    assert parts.scanner.catch_up == {38: 5, 41: None}


async def test_scanned_entries_are_held_or_parked_and_tracked(
    client: BrokerScheduleClient,
) -> None:
    parts = Parts(client, catch_up={38: 2, 41: None})
    now = T0 + 100
    plan = parts.scanner.plan(now)
    result = ScanResult(
        entries=[
            entry(0, 1, T0 + 900),  # level 1: due within the lead
            entry(33, 0, T0 + 1500),  # active slot, due soon
            entry(33, 1, T0 + 86_400_000),  # a roll: park
            entry(38, 0, T0 - 5000),  # catch-up: overdue, deliver at once
            entry(38, 1, T0 + 8500),  # catch-up: next revolution's entry, park
        ],
        queues=[
            ScanQueueResult(0, 2, 0),
            ScanQueueResult(1, 0, 0),
            ScanQueueResult(32, 0, 0),
            ScanQueueResult(33, 2, 0),
            ScanQueueResult(34, 0, 0),
            ScanQueueResult(38, 2, 0),
            ScanQueueResult(41, 7, 3),  # 3 entries were removed by retention unread
        ],
        now_ms=now,
    )
    parts.scanner.take(plan, result, now)
    state = parts.state
    assert [p.entry.queue_offset for p in state.heap.pop_due(T0 + 10_000, 10)] == [0, 1, 0]
    assert [(p.entry.queue_id, p.entry.queue_offset) for p in state.parks] == [(33, 1), (38, 1)]
    assert all(p.action is ResolveAction.PARK for p in state.parks)
    assert parts.stats.scanned == 5
    assert parts.stats.skipped == 3
    assert parts.wakes == 1
    # catch-up: 38 reached its bound, 41 came back empty from a complete scan
    assert parts.scanner.catch_up == {}
    # nothing resolved yet: progress stays at the first entry read
    assert state.book.offsets() == {0: 1, 33: 0, 1: 0, 32: 0, 34: 0, 38: 0, 41: 7}


async def test_resolve_outcomes_settle_entries_count_and_retry_failures(
    client: BrokerScheduleClient,
) -> None:
    parts = Parts(client, catch_up={})
    state, stats = parts.state, parts.stats
    entries = [entry(33, i, T0 + 1000 + i) for i in range(4)]
    for e in entries:
        state.book.queue(33).scanned(e.queue_offset)
    state.book.queue(33).advance(4)
    batch = [Pending(e, ResolveAction.DELIVER) for e in entries[:3]] + [
        Pending(entries[3], ResolveAction.PARK)
    ]
    now = T0 + 1012
    parts.resolver.settle(
        batch,
        [
            ResolveResult(Outcome.RESOLVED),
            ResolveResult(Outcome.FAILED, "disk full"),
            ResolveResult(Outcome.DROPPED, "topic gone"),
            ResolveResult(Outcome.RESOLVED),
        ],
        now,
    )
    assert (stats.delivered, stats.parked, stats.dropped, stats.failed) == (1, 1, 1, 1)
    assert list(stats.lateness_ms) == [12]  # confirmed at T0 + 1012, due at T0 + 1000
    # the failed one is unresolved (progress waits for it) and comes back after its backoff
    assert state.book.offsets()[33] == 1
    assert state.heap.next_wake() == now + retry_delay_ms(1)
    retried = state.heap.pop_due(now + retry_delay_ms(1), 10)
    assert [(p.entry.queue_offset, p.attempts) for p in retried] == [(1, 1)]
    parts.resolver.settle(retried, [ResolveResult(Outcome.RESOLVED)], now + 150)
    assert state.book.offsets()[33] == 4
    assert stats.snapshot().lateness_max_ms == 161  # due at T0 + 1001


def test_retry_backoff_grows_and_is_capped() -> None:
    assert [retry_delay_ms(n) for n in (1, 2, 3, 4)] == [100, 200, 400, 800]
    assert retry_delay_ms(20) == 5000
