"""Progress per schedule queue of one broker: where to scan next and what to commit.

Each queue has a *cursor* (where the next scan starts) and the offsets scanned but not yet
resolved (held in memory, parked or delivered by a call still in flight). The progress
committed to the broker is the smallest unresolved offset, else the cursor: everything below it
is resolved, so a restart from there loses nothing (entries resolved above it are resolved
again: at-least-once)::

    offsets    10  11  12  13  14  15  16 | 17  (cursor)
    resolved    ✓   ✓   ·   ✓   ·   ✓   ✓ |
                        ▲ progress = 12
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueState:
    """A queue as the broker reports it: bounds and the progress committed (-1: none)."""

    queue_id: int
    min_offset: int
    max_offset: int
    progress: int


class QueueProgress:
    """One queue's cursor and unresolved offsets."""

    __slots__ = ("_heap", "_pending", "cursor")

    def __init__(self, cursor: int) -> None:
        self.cursor = cursor
        self._pending: set[int] = set()
        self._heap: list[int] = []  # the pending offsets, stale ones removed lazily

    def scanned(self, offset: int) -> None:
        """An entry at ``offset`` was read and awaits its resolution."""
        if offset not in self._pending:
            self._pending.add(offset)
            heapq.heappush(self._heap, offset)

    def advance(self, next_offset: int) -> None:
        """A scan returned up to ``next_offset``: past what it returned, up to the earliest
        entry kept (retention), or back to the queue's end when the scan started beyond it
        (the broker's store was reset)."""
        self.cursor = next_offset

    def resolved(self, offset: int) -> None:
        self._pending.discard(offset)
        heap = self._heap
        while heap and heap[0] not in self._pending:
            heapq.heappop(heap)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def progress(self) -> int:
        """The first offset not yet resolved."""
        return self._heap[0] if self._heap else self.cursor


class ProgressBook:
    """Every schedule queue of one broker."""

    def __init__(self, queues: Iterable[QueueState] = ()) -> None:
        self._queues: dict[int, QueueProgress] = {}
        self._committed: dict[int, int] = {}
        for q in queues:
            # never committed: nothing of it was resolved, start at the earliest entry kept
            start = q.progress if q.progress >= 0 else q.min_offset
            self._queues[q.queue_id] = QueueProgress(max(start, 0))
            if q.progress >= 0:
                self._committed[q.queue_id] = q.progress

    def queue(self, queue_id: int) -> QueueProgress:
        qp = self._queues.get(queue_id)
        if qp is None:
            qp = self._queues[queue_id] = QueueProgress(0)
        return qp

    def cursor(self, queue_id: int) -> int:
        return self.queue(queue_id).cursor

    def offsets(self) -> dict[int, int]:
        """Progress of every queue known (what a commit sends)."""
        return {q: qp.progress for q, qp in self._queues.items()}

    def uncommitted(self) -> dict[int, int] | None:
        """The offsets to commit, or None when nothing changed since the last commit."""
        offsets = self.offsets()
        return None if offsets == self._committed else offsets

    def committed(self, offsets: dict[int, int]) -> None:
        self._committed = dict(offsets)

    @property
    def pending(self) -> int:
        return sum(qp.pending for qp in self._queues.values())
