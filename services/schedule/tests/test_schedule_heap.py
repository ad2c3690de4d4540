"""The in-memory fine scheduler: due order, ties in arrival order, batches, retries."""

from __future__ import annotations

import pytest

from apogee_schedule.core.heap import DueHeap, Pending
from apogee_schedule.core.model import ResolveAction, ScheduleEntry

pytestmark = pytest.mark.unit


def pending(offset: int, due: int, queue: int = 32) -> Pending:
    return Pending(ScheduleEntry(queue, offset, 1000 + offset, 100, due), ResolveAction.DELIVER)


def test_entries_come_out_in_due_order_ties_in_arrival_order() -> None:
    heap = DueHeap()
    for offset, due in [(0, 500), (1, 100), (2, 300), (3, 100), (4, 200)]:
        heap.push(pending(offset, due))
    assert heap.next_wake() == 100
    out = heap.pop_due(1000, 10)
    assert [p.entry.queue_offset for p in out] == [1, 3, 4, 2, 0]
    assert len(heap) == 0
    assert heap.next_wake() is None


def test_nothing_comes_out_before_its_time_and_batches_are_capped() -> None:
    heap = DueHeap()
    for i in range(10):
        heap.push(pending(i, 100 + i))
    assert heap.pop_due(99, 100) == []
    first = heap.pop_due(105, 4)
    assert [p.entry.deliver_at_ms for p in first] == [100, 101, 102, 103]
    second = heap.pop_due(105, 4)
    assert [p.entry.deliver_at_ms for p in second] == [104, 105]
    assert heap.next_wake() == 106


def test_a_retry_waits_for_its_own_time_not_its_due_time() -> None:
    heap = DueHeap()
    retry = pending(0, 100)
    heap.push(retry, wake_ms=400)
    heap.push(pending(1, 300))
    assert [p.entry.queue_offset for p in heap.pop_due(350, 10)] == [1]
    assert heap.pop_due(399, 10) == []
    assert heap.pop_due(400, 10) == [retry]
    heap.push(pending(2, 1))
    assert len(heap.clear()) == 1
    assert len(heap) == 0
