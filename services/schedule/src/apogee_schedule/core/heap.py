"""The in-memory fine scheduler: entries ordered by when they are next to be resolved.

An entry scanned within the active window waits here until its ``deliver_at_ms``; one whose
resolution failed waits again until its retry time. :meth:`DueHeap.pop_due` hands out what is
due, earliest first (ties in the order they were pushed), in batches.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from apogee_schedule.core.model import ResolveAction, ScheduleEntry


@dataclass(slots=True)
class Pending:
    """An entry on its way to a Resolve call."""

    entry: ScheduleEntry
    action: ResolveAction
    #: failed resolutions so far (the retry backoff grows with it)
    attempts: int = 0


class DueHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Pending]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: Pending, wake_ms: int | None = None) -> None:
        """Resolve ``item`` at ``wake_ms`` (default: its delivery time)."""
        at = item.entry.deliver_at_ms if wake_ms is None else wake_ms
        heapq.heappush(self._heap, (at, item.entry.deliver_at_ms, next(self._seq), item))

    def next_wake(self) -> int | None:
        """When the earliest entry is due, or None when there is none."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_ms: int, limit: int) -> list[Pending]:
        """Up to ``limit`` entries due at or before ``now_ms``, earliest first."""
        out: list[Pending] = []
        heap = self._heap
        while heap and heap[0][0] <= now_ms and len(out) < limit:
            out.append(heapq.heappop(heap)[3])
        return out

    def clear(self) -> list[Pending]:
        items = [t[3] for t in self._heap]
        self._heap.clear()
        return items
