"""One check round on one broker: RocketMQ's ``TransactionalMessageServiceImpl.check``.

A round::

    GetTransactionState          half queue [min, max), op queue [min, max), committed progress
                                 (-1: none; then each queue's min), the broker's now_ms
    ScanOps from op progress     up to the op max as it was: an op record whose half offset is
      (batches)                  below the half progress is done (doneOpOffset); one at or above
                                 it goes to the remove map, half offset -> op offsets
    ScanHalf from half progress  up to the half max as it was (copies put back during the round
      (batches)                  are the next round's), in queue order, each half:
        in the remove map        done: passed, no call
        decided (another copy    CheckHalf at once (no producer is asked, so neither its due
          was ended)             time nor a token is waited for): the broker writes its op record
        not due                  the scan ends here (queue order is store order)
        due, checked max times   CheckHalf (GAVE_UP: the broker moves it aside), no token
        due                      queued in its producer group's lane: CheckHalf when a token
                                 of the group's rate limit is there
    lanes drained                or cut at the round's deadline (the next round's start)
    CommitTransactionProgress    half progress: the first half not processed; op progress:
                                 calculateOpOffset, over the op records that are done (their
                                 half is behind the new half progress), stopping at the first
                                 that is not

Due: a half never checked is due ``immunity`` after its transaction's first copy was stored
(``HalfEntry.immunity_ms``, else the ``immunity_s`` setting); a copy already checked is due
``check_interval_s`` after it was stored. Now is the broker's ``now_ms`` advanced by the local
monotonic clock. A checked copy that falls due before the round's deadline is waited for (the
scan goes on at its due time), so that a copy put back late in one round is not passed over
for a whole extra interval by the next; a half never checked that is not due ends the scan.

Rate limit: the checks to one producer group take tokens of the group's bucket
(:class:`~.ratelimit.GroupLimiter`, shared by every broker's loop). Each group has its own lane,
drained in order at the group's pace, so a group with 100,000 stuck halves neither storms its
producers nor holds up other groups' checks. A lane holds what the group's rate lets through in
one round (``TxnCheckerSettings.lane_capacity``); once it turns a half away, the group's later
halves are left for the next round too (they stay in order), and so is what a lane still holds
at the deadline: the half progress never passes a
half not processed, so those are scanned again by the next round (the halves processed after
them are then in the remove map).

Restart: every processed copy has its op record before the progress passes it (CheckHalf writes
one for the checked copy and puts a new copy at the end), so a checker killed mid-round scans
again at most what it had not committed and never checks a copy twice: a copy it had checked is
in the remove map, or the broker answers CLOSED (counted, passed).

Errors: a retriable failure (the broker unreachable, a deadline) ends the round and the session
(its worker starts again after a backoff); any other failure of one CheckHalf is logged and
counted, and that half is left for the next round.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

from opentelemetry.trace import Tracer

from apogee.common.clock import Clock
from apogee.common.errors import ApogeeError
from apogee_txn_checker.core.client import TransactionCheckClient
from apogee_txn_checker.core.model import (
    CheckOutcome,
    CheckResult,
    Decision,
    HalfEntry,
    OpScan,
    TransactionState,
)
from apogee_txn_checker.core.ratelimit import GroupLimiter
from apogee_txn_checker.core.spans import CheckSpans, TraceLookup
from apogee_txn_checker.core.stats import CheckerStats
from apogee_txn_checker.settings import TxnCheckerSettings

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]

#: Checks without a token (decided, given up) a round holds before its scan waits for room.
DIRECT_LANE_CAPACITY: Final = 1024
_DECIDED = frozenset({Decision.COMMIT, Decision.ROLLBACK})
_LABELS: Final = (
    (CheckOutcome.CHECK_SENT, "sent to a producer"),
    (CheckOutcome.NO_PRODUCER, "with no producer"),
    (CheckOutcome.DECIDED, "decided"),
    (CheckOutcome.GAVE_UP, "given up"),
    (CheckOutcome.GONE, "gone"),
    (CheckOutcome.CLOSED, "already closed"),
)


class Stop(enum.Enum):
    """Why a round's scan ended."""

    #: it reached the half max offset as it was when the round started
    END = "end"
    #: at a half not due yet
    NOT_DUE = "not due"
    #: at the round's deadline
    DEADLINE = "deadline"


@dataclass(slots=True)
class RoundReport:
    """What one round did."""

    broker: str
    half_from: int = 0
    half_to: int = 0
    op_from: int = 0
    op_to: int = 0
    #: halves read by the scan
    scanned: int = 0
    #: halves passed because an op record said they were done
    skipped_done: int = 0
    outcomes: Counter[CheckOutcome] = field(default_factory=Counter)
    errors: int = 0
    #: halves left for the next round because their group's lane was full
    deferred: int = 0
    #: halves queued for a check but not checked by the deadline
    unchecked: int = 0
    stop: Stop = Stop.END
    committed: bool = False
    duration_ms: int = 0

    @property
    def checks(self) -> int:
        return sum(self.outcomes.values())

    @property
    def eventful(self) -> bool:
        """Whether anything happened beyond passing halves already done."""
        return bool(self.checks or self.errors or self.deferred or self.unchecked)

    def summary(self) -> str:
        """One line: the outcomes that happened, the progress, why the scan ended, the time."""
        counts = [f"{self.outcomes[o]} {label}" for o, label in _LABELS if self.outcomes[o]]
        parts = [f"{self.checks} checked" + (f" ({', '.join(counts)})" if counts else "")]
        if self.skipped_done:
            parts.append(f"{self.skipped_done} passed as done")
        if self.errors:
            parts.append(f"{self.errors} failed")
        if self.deferred or self.unchecked:
            parts.append(f"{self.deferred + self.unchecked} left for the next round")
        return (
            f"{', '.join(parts)}; half progress {self.half_from} -> {self.half_to}, op progress "
            f"{self.op_from} -> {self.op_to}; scan ended: {self.stop.value}; "
            f"{self.duration_ms} ms"
        )


class OpBook:
    """The op records read from the committed op progress: RocketMQ's remove map (half offset
    -> op offsets, for halves at or after the half progress) and its done op offsets (the
    others, implied: every op record read that is not in the remove map)."""

    def __init__(self, start: int, half_start: int) -> None:
        self.start = start
        #: op records below this were read
        self.end = start
        self.half_start = half_start
        self.remove: dict[int, list[int]] = {}
        self.read = 0

    def add(self, scan: OpScan, limit: int) -> bool:
        """Take a ScanOps answer (entries below ``limit`` only); False when reading is over
        (the limit is reached, or the scan made no progress)."""
        for op in scan.entries:
            if op.queue_offset < self.end:
                continue
            if op.queue_offset >= limit:
                self.end = limit
                return False
            self.read += 1
            if op.half_offset >= self.half_start:
                self.remove.setdefault(op.half_offset, []).append(op.queue_offset)
            self.end = op.queue_offset + 1
        nxt = min(max(scan.next_offset, self.end), limit)
        moved = nxt > self.end or bool(scan.entries)
        self.end = nxt
        return moved and self.end < limit

    def closes(self, half_offset: int) -> bool:
        return half_offset in self.remove

    def progress(self, half_progress: int) -> int:
        """calculateOpOffset: past every op record read whose half is behind ``half_progress``,
        up to the first whose half is not."""
        pending = [op for half, ops in self.remove.items() if half >= half_progress for op in ops]
        return min(pending, default=self.end)


class HalfBook:
    """Where the half scan is: every offset below ``cursor`` was passed, queued for a check
    (``open`` until answered) or left for the next round (the first in ``first_left``)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.cursor = start
        self.open: dict[int, None] = {}
        self.first_left: int | None = None

    def passed(self, offset: int) -> None:
        self.cursor = offset + 1

    def hold(self, offset: int) -> None:
        self.open[offset] = None
        self.cursor = offset + 1

    def release(self, offset: int) -> None:
        self.open.pop(offset, None)

    def leave(self, offset: int) -> None:
        if self.first_left is None:
            self.first_left = offset
        self.cursor = offset + 1

    def progress(self) -> int:
        """The first half not processed."""
        first = self.cursor
        if self.open:
            first = min(first, next(iter(self.open)))
        if self.first_left is not None:
            first = min(first, self.first_left)
        return first


class _Lane:
    """The checks of one producer group (``key``), in order; None: checks without a token."""

    def __init__(self, key: str | None) -> None:
        self.key = key
        self.queue: deque[HalfEntry] = deque()
        self.task: asyncio.Task[None] | None = None
        self.room = asyncio.Event()
        #: it turned a half away: the group's later halves are left for the next round too
        self.full = False


class CheckRound:
    """One round on one broker (see the module docstring); ``await run()`` once. ``deadline``
    is on ``clock.monotonic()``; every wait goes through ``sleep``."""

    def __init__(
        self,
        broker: str,
        client: TransactionCheckClient,
        settings: TxnCheckerSettings,
        clock: Clock,
        stats: CheckerStats,
        limiter: GroupLimiter,
        deadline: float,
        sleep: Sleep = asyncio.sleep,
        tracer: Tracer | None = None,
    ) -> None:
        """``tracer``: the checker's, when it traces (each check of a traced half gets its
        span, :mod:`.spans`; the client must then also be a :class:`TraceLookup`)."""
        self.broker = broker
        self.client = client
        self._spans = (
            CheckSpans(tracer, broker, client)
            if tracer is not None and isinstance(client, TraceLookup)
            else None
        )
        self.settings = settings
        self.clock = clock
        self.stats = stats
        self.limiter = limiter
        self.deadline = deadline
        self._sleep = sleep
        self.report = RoundReport(broker)
        self.state: TransactionState | None = None
        self.halves: HalfBook | None = None
        self.ops: OpBook | None = None
        self._mono0 = 0.0
        self._lanes: dict[str | None, _Lane] = {}
        self._slots = asyncio.Semaphore(settings.max_concurrent_checks)
        self._failure: asyncio.Future[None] | None = None
        self._commit_lock = asyncio.Lock()

    # -- time ------------------------------------------------------------------------------

    def now_ms(self) -> int:
        """The broker's clock, as of its last answer, advanced by the local monotonic clock."""
        assert self.state is not None
        return self.state.now_ms + int((self.clock.monotonic() - self._mono0) * 1000)

    def due_ms(self, h: HalfEntry) -> int:
        if h.check_times <= 0:
            immunity = h.immunity_ms or int(self.settings.immunity_s * 1000)
            return (h.first_stored_ms or h.store_timestamp_ms) + immunity
        return h.store_timestamp_ms + int(self.settings.check_interval_s * 1000)

    def _mono_at(self, broker_ms: int) -> float:
        assert self.state is not None
        return self._mono0 + (broker_ms - self.state.now_ms) / 1000

    # -- the round -------------------------------------------------------------------------

    async def run(self) -> RoundReport:
        """The round; raises ApogeeError when the broker fails (nothing more is committed)."""
        t0 = self.clock.monotonic()
        self._failure = asyncio.get_running_loop().create_future()
        work = asyncio.ensure_future(self._work())
        try:
            either: set[asyncio.Future[None]] = {work, self._failure}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if self._failure.done():  # a lane's check failed: the broker is not answering
                self._failure.result()
            work.result()
        finally:
            if self._failure.done():
                self._failure.exception()  # retrieved, whatever ended the round
            if not work.done():
                work.cancel()
                await asyncio.wait({work})
            await self._cut_lanes()
            self.report.duration_ms = int((self.clock.monotonic() - t0) * 1000)
        self.stats.rounds += 1
        self.stats.last_round_ms = self.report.duration_ms
        return self.report

    async def _work(self) -> None:
        st = self.state = await self.client.get_state()
        self._mono0 = self.clock.monotonic()
        half_start = _clamp(st.half_progress, st.half_min_offset, st.half_max_offset)
        op_start = _clamp(st.op_progress, st.op_min_offset, st.op_max_offset)
        if st.half_progress > st.half_max_offset:
            log.warning(
                "broker %s: the committed half progress %d is past the half queue's end %d "
                "(the queue was truncated by recovery?); scanning from %d",
                self.broker,
                st.half_progress,
                st.half_max_offset,
                half_start,
            )
        self.halves = HalfBook(half_start)
        self.ops = OpBook(op_start, half_start)
        r = self.report
        r.half_from = r.half_to = half_start
        r.op_from = r.op_to = op_start
        await self._read_ops(st.op_max_offset)
        await self._scan(st.half_max_offset)
        await self._drain()
        await self.commit()

    async def _read_ops(self, limit: int) -> None:
        ops = self.ops
        assert ops is not None
        batch = self.settings.op_scan_batch
        while ops.end < limit:
            scan = await self.client.scan_ops(ops.end, min(batch, limit - ops.end))
            if not ops.add(scan, limit):
                break

    async def _scan(self, end: int) -> None:
        book = self.halves
        assert book is not None
        batch = self.settings.half_scan_batch
        while book.cursor < end:
            if self.clock.monotonic() >= self.deadline:
                self.report.stop = Stop.DEADLINE
                return
            offset = book.cursor
            scan = await self.client.scan_half(offset, min(batch, end - offset))
            for h in scan.entries:
                if h.queue_offset < book.cursor:
                    continue
                if h.queue_offset >= end:
                    break
                self.report.scanned += 1
                if not await self._take(h):
                    return
            book.cursor = min(max(book.cursor, scan.next_offset), end)
            if book.cursor <= offset:
                log.warning(
                    "broker %s: ScanHalf from %d made no progress (next offset %d, half max "
                    "%d); the round ends here",
                    self.broker,
                    offset,
                    scan.next_offset,
                    end,
                )
                return
        self.report.stop = Stop.END

    async def _take(self, h: HalfEntry) -> bool:
        """Deal with one half in scan order; False when the scan ends at it."""
        book, ops = self.halves, self.ops
        assert book is not None
        assert ops is not None
        offset = h.queue_offset
        if ops.closes(offset):
            book.passed(offset)
            self.report.skipped_done += 1
            self.stats.skipped_done += 1
            return True
        if h.decided in _DECIDED:
            await self._queue_direct(h)
            return True
        due = self.due_ms(h)
        if self.now_ms() < due:
            if h.check_times <= 0 or self._mono_at(due) > self.deadline:
                self.report.stop = Stop.NOT_DUE
                return False
            await self._sleep(max(0.0, (due - self.now_ms()) / 1000))
        if h.check_times >= self.settings.max_check_times:
            await self._queue_direct(h)
            return True
        lane = self._lane(h.producer_group)
        if lane.full or len(lane.queue) >= self.settings.lane_capacity:
            lane.full = True  # the group's later halves too: they stay in order
            book.leave(offset)
            self.report.deferred += 1
            self.stats.deferred += 1
            return True
        self._enqueue(lane, h)
        return True

    # -- lanes -----------------------------------------------------------------------------

    def _lane(self, key: str | None) -> _Lane:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(key)
        return lane

    async def _queue_direct(self, h: HalfEntry) -> None:
        lane = self._lane(None)
        while len(lane.queue) >= DIRECT_LANE_CAPACITY:
            lane.room.clear()
            await lane.room.wait()
        self._enqueue(lane, h)

    def _enqueue(self, lane: _Lane, h: HalfEntry) -> None:
        assert self.halves is not None
        self.halves.hold(h.queue_offset)
        lane.queue.append(h)
        if lane.task is None or lane.task.done():
            lane.task = asyncio.ensure_future(self._run_lane(lane))

    async def _run_lane(self, lane: _Lane) -> None:
        try:
            while lane.queue:
                h = lane.queue[0]
                if lane.key is not None:
                    await self.limiter.acquire(lane.key)
                result = await self._check(h)
                lane.queue.popleft()
                lane.room.set()
                if result is not None:
                    self._record(h, result)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if self._failure is not None and not self._failure.done():
                self._failure.set_exception(exc)

    async def _check(self, h: HalfEntry) -> CheckResult | None:
        """CheckHalf; None after a failure that is not retriable (the half stays open)."""
        async with self._slots:
            if self._spans is not None:
                return await self._spans.check(h, lambda: self._check_half(h))
            return await self._check_half(h)

    async def _check_half(self, h: HalfEntry) -> CheckResult | None:
        try:
            return await self.client.check_half(h.queue_offset, self.settings.max_check_times)
        except ApogeeError as err:
            if err.retriable:
                raise
            self.report.errors += 1
            self.stats.errors += 1
            log.error(
                "broker %s: checking half offset %d (transaction %s of producer group %s) "
                "failed: %s; it is left for the next round",
                self.broker,
                h.queue_offset,
                h.unique_id,
                h.producer_group,
                err,
            )
            return None

    def _record(self, h: HalfEntry, result: CheckResult) -> None:
        assert self.halves is not None
        self.halves.release(h.queue_offset)
        self.report.outcomes[result.outcome] += 1
        self.stats.record(result.outcome)
        if result.outcome is CheckOutcome.GAVE_UP:
            log.warning(
                "transaction %s of producer group %s (topic %s) is still undecided after %d "
                "checks: broker %s moved it to TRANS_CHECK_MAX_TIME_TOPIC",
                h.unique_id,
                h.producer_group,
                h.topic,
                max(h.check_times, result.check_times),
                self.broker,
            )

    async def _drain(self) -> None:
        """Until every lane is empty, or the deadline."""
        remaining = self.deadline - self.clock.monotonic()
        timer = asyncio.ensure_future(self._sleep(max(0.0, remaining)))
        try:
            while True:
                busy = {
                    lane.task
                    for lane in self._lanes.values()
                    if lane.task is not None and not lane.task.done()
                }
                if not busy:
                    return
                if timer.done():
                    self.report.stop = Stop.DEADLINE
                    return
                await asyncio.wait({*busy, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()

    async def _cut_lanes(self) -> None:
        tasks = [lane.task for lane in self._lanes.values() if lane.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self.report.unchecked = sum(len(lane.queue) for lane in self._lanes.values())

    # -- progress --------------------------------------------------------------------------

    def progress(self) -> tuple[int, int] | None:
        """(half progress, op progress) as far as this round got; None before it started."""
        if self.halves is None or self.ops is None:
            return None
        half = self.halves.progress()
        return half, self.ops.progress(half)

    async def commit(self) -> None:
        """Commit the progress made (when it moved); after a stop, what was processed."""
        async with self._commit_lock:
            progress = self.progress()
            if progress is None or self.report.committed:
                return
            assert self.state is not None
            half, op = progress
            self.report.half_to, self.report.op_to = half, op
            if (half, op) != (self.state.half_progress, self.state.op_progress):
                await self.client.commit_progress(half, op)
            self.report.committed = True


def _clamp(progress: int, least: int, most: int) -> int:
    """A committed progress within the queue's bounds (-1, nothing committed: the start)."""
    if progress < 0:
        return least
    return max(least, min(progress, most))
