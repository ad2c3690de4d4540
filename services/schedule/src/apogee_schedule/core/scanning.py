"""The scan loop of one broker: reads the schedule queues and hands entries on.

Each round scans, in one long-polled call, the active wheel slots and the catch-up slots not
read to their end yet, and, every ``scan_hold_ms`` at least, every delay-level queue (up to
``now + lead_ms``: a level queue is in due order, so reading stops at the first entry due
later). Level queues are not part of every held scan because an entry that is there but not due
yet cannot become due by an arrival (later arrivals are due later still); only time makes it
due, so they are read on a cadence, and a held scan waits for timer entries only. Every entry
read is recorded as unresolved in the progress book, then held in memory (due within the active
windows) or queued to be parked (due later). When too many entries wait in memory, scanning
pauses until the resolver has worked them down.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Final

from apogee.common.clock import Clock
from apogee.service.loops import BackgroundLoop, ErrorHandler
from apogee_schedule.core.client import ScheduleClient
from apogee_schedule.core.heap import DueHeap, Pending
from apogee_schedule.core.layout import Action, Layout
from apogee_schedule.core.model import ResolveAction, ScanQueue, ScanResult
from apogee_schedule.core.progress import ProgressBook
from apogee_schedule.core.stats import ScheduleStats

log = logging.getLogger(__name__)

#: Most entries one scan asks for.
SCAN_MAX_ENTRIES: Final = 4096
#: Scanning pauses while this many entries wait in memory (held or to be parked; about 450
#: bytes each) ...
MAX_WAITING: Final = 500_000
#: ... and resumes when they are down to this many.
RESUME_WAITING: Final = 400_000
#: A scan that found nothing and came back before its hold is not repeated sooner than this.
EMPTY_SCAN_GAP_S: Final = 0.01


class SessionState:
    """What the loops of one broker session share."""

    def __init__(self, layout: Layout, book: ProgressBook) -> None:
        self.layout = layout
        self.book = book
        #: entries to deliver, by due time (and failed ones, by retry time)
        self.heap = DueHeap()
        #: entries to park, first come first served
        self.parks: deque[Pending] = deque()
        #: set while scanning may go on (cleared when too much waits in memory)
        self.room = asyncio.Event()
        self.room.set()

    @property
    def waiting(self) -> int:
        return len(self.heap) + len(self.parks)

    def check_room(self) -> None:
        if self.waiting >= MAX_WAITING:
            self.room.clear()
        elif self.waiting <= RESUME_WAITING:
            self.room.set()


class Scanner(BackgroundLoop):
    def __init__(
        self,
        broker: str,
        client: ScheduleClient,
        state: SessionState,
        stats: ScheduleStats,
        clock: Clock,
        *,
        lead_ms: int,
        hold_ms: int,
        catch_up: dict[int, int | None],
        wake_resolver: Callable[[], None],
        on_error: ErrorHandler,
    ) -> None:
        super().__init__(on_error)
        self.name = f"scan {broker}"
        self.broker = broker
        self._client = client
        self._state = state
        self._stats = stats
        self._clock = clock
        self._lead_ms = lead_ms
        self._hold_ms = hold_ms
        #: slot queue -> offset to read it up to (None: until a scan finds nothing more)
        self.catch_up = catch_up
        self._wake_resolver = wake_resolver
        self._active: set[int] = set()

    def plan(self, now_ms: int, levels: bool = True) -> list[ScanQueue]:
        """The queues the next scan reads, each from its cursor: the active and catch-up
        slots, and the level queues when ``levels``."""
        layout, book = self._state.layout, self._state.book
        active = layout.active_queues(now_ms)
        for q in self._active.difference(active):
            # a slot that just stopped being active is read once more to its end
            self.catch_up.setdefault(q, None)
        self._active = set(active)
        plan: list[ScanQueue] = []
        if levels:
            due_before = now_ms + self._lead_ms
            plan += [ScanQueue(q, book.cursor(q), due_before) for q in layout.level_queues]
        for q in dict.fromkeys([*active, *self.catch_up]):
            plan.append(ScanQueue(q, book.cursor(q)))
        return plan

    async def _run(self) -> None:
        state = self._state
        loop = asyncio.get_running_loop()
        next_levels = 0.0
        while True:
            await state.room.wait()
            started = loop.time()
            levels = started >= next_levels
            if levels:
                next_levels = started + self._hold_ms / 1000
            plan = self.plan(self._clock.time_ms(), levels)
            hold_ms = max(0, min(self._hold_ms, int((next_levels - started) * 1000)))
            result = await self._client.scan(plan, SCAN_MAX_ENTRIES, hold_ms)
            self.take(plan, result, self._clock.time_ms())
            if not result.entries:
                gap = started + EMPTY_SCAN_GAP_S - loop.time()
                if gap > 0:
                    await asyncio.sleep(gap)

    def take(self, plan: list[ScanQueue], result: ScanResult, now_ms: int) -> None:
        """Record a scan's answer: cursors, entries (held or to be parked), catch-up done."""
        state, stats = self._state, self._stats
        layout, book = state.layout, state.book
        for qr in result.queues:
            book.queue(qr.queue_id).advance(qr.next_offset)
            if qr.skipped:
                stats.skipped += qr.skipped
                log.warning(
                    "broker %s: %d entries of schedule queue %d were removed by retention "
                    "before they were delivered",
                    self.broker,
                    qr.skipped,
                    qr.queue_id,
                )
        found: set[int] = set()
        for e in result.entries:
            found.add(e.queue_id)
            book.queue(e.queue_id).scanned(e.queue_offset)
            if layout.action(e.queue_id, e.deliver_at_ms, now_ms) is Action.PARK:
                state.parks.append(Pending(e, ResolveAction.PARK))
            else:
                state.heap.push(Pending(e, ResolveAction.DELIVER))
        stats.scanned += len(result.entries)
        truncated = len(result.entries) >= SCAN_MAX_ENTRIES
        asked = {q.queue_id: q.offset for q in plan}
        for q, target in list(self.catch_up.items()):
            if q not in asked:
                continue
            # read to its end (a complete scan found nothing more), or up to its bound
            ended = not (truncated or q in found)
            if ended if target is None else book.cursor(q) >= target:
                del self.catch_up[q]
                if target is not None and all(t is None for t in self.catch_up.values()):
                    log.info("broker %s: catch-up of passed timer slots done", self.broker)
        if result.entries:
            state.check_room()
            self._wake_resolver()
