"""The delivery loop of one broker, and its progress commits.

:class:`Resolver` sleeps until the earliest entry in memory is due (``loop.call_at`` on the
event loop's clock, woken early when a scan brings something sooner), then sends what is due,
up to ``max_batch`` entries per ``Resolve`` call, with at most :data:`CALLS_IN_FLIGHT` calls
at once; the entries that fall due while a call runs make up the next batch. (One call at a
time batches best: in bench/schedule_bench.py on two cores, p99 lateness was 11 to 21 ms with
one call in flight, 52 to 103 ms with four.) An entry
is never sent before the service's clock has reached its ``deliver_at_ms``. Entries to park go
when nothing is due. Per entry: RESOLVED and DROPPED settle it (DROPPED is logged and
counted); FAILED is tried again after a backoff. A call that fails as a whole ends the session
(the entries stay unresolved, so progress stays below them).

:class:`Committer` commits the progress book every ``progress_interval_s`` when it changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from opentelemetry.trace import Tracer

from apogee.common.clock import Clock
from apogee.common.topics import SCHEDULE_DEAD_TOPIC as DEAD_TOPIC
from apogee.common.topics import SCHEDULE_RECALLED_REASON as RECALLED
from apogee.service.loops import BackgroundLoop, ErrorHandler
from apogee_schedule.core.client import ScheduleClient
from apogee_schedule.core.heap import Pending
from apogee_schedule.core.model import Outcome, ResolveAction, ResolveResult
from apogee_schedule.core.scanning import SessionState
from apogee_schedule.core.spans import ResolveSpans
from apogee_schedule.core.stats import ScheduleStats

log = logging.getLogger(__name__)

#: Resolve calls one broker may have in flight (see the module docstring).
CALLS_IN_FLIGHT: Final = 1
#: Retry of a FAILED entry: 100 ms, doubling, at most 5 s.
RETRY_FIRST_MS: Final = 100
RETRY_MAX_MS: Final = 5000


def retry_delay_ms(attempts: int) -> int:
    """Wait before the ``attempts``-th retry (1, 2, ...)."""
    return int(min(RETRY_MAX_MS, RETRY_FIRST_MS * 2 ** max(0, attempts - 1)))


class Resolver(BackgroundLoop):
    def __init__(
        self,
        broker: str,
        client: ScheduleClient,
        state: SessionState,
        stats: ScheduleStats,
        clock: Clock,
        *,
        max_batch: int,
        on_error: ErrorHandler,
        tracer: Tracer | None = None,
    ) -> None:
        super().__init__(on_error)
        self.name = f"resolve {broker}"
        #: None unless the service traces (then each message resolved gets its spans)
        self._spans = ResolveSpans(tracer, broker) if tracer is not None else None
        self.broker = broker
        self._client = client
        self._state = state
        self._stats = stats
        self._clock = clock
        self._max_batch = max_batch
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(CALLS_IN_FLIGHT)
        self._calls: set[asyncio.Task[None]] = set()

    def wake(self) -> None:
        """Something new is in memory: look again at what is due."""
        self._wake.set()

    def _next_batch(self) -> list[Pending]:
        state = self._state
        batch = state.heap.pop_due(self._clock.time_ms(), self._max_batch)
        if not batch and state.parks:
            n = min(self._max_batch, len(state.parks))
            batch = [state.parks.popleft() for _ in range(n)]
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            self._wake.clear()
            batch = self._next_batch()
            if batch:
                task = asyncio.create_task(self._resolve(batch), name=f"{self.name} call")
                self._calls.add(task)
                task.add_done_callback(self._calls.discard)
                continue
            self._slots.release()
            wake_ms = self._state.heap.next_wake()
            timer = None
            if wake_ms is not None:
                delay_s = max(0, wake_ms - self._clock.time_ms()) / 1000
                timer = loop.call_at(loop.time() + delay_s, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                if timer is not None:
                    timer.cancel()

    async def _call(self, batch: list[Pending]) -> list[ResolveResult]:
        """One Resolve call on ``batch`` (with its messages' spans when tracing)."""
        items = [(p.entry, p.action) for p in batch]
        if self._spans is None:
            return await self._client.resolve(items)
        began = time.time_ns()
        results = await self._client.resolve(items, True)
        self._spans.resolved(batch, results, began, time.time_ns())
        return results

    async def _resolve(self, batch: list[Pending]) -> None:
        try:
            results = await self._call(batch)
        except Exception as exc:
            self._on_error(exc)
            return
        finally:
            self._slots.release()
        self.settle(batch, results, self._clock.time_ms())

    def settle(self, batch: list[Pending], results: list[ResolveResult], now_ms: int) -> None:
        """Record the outcome of each entry of a Resolve call."""
        state, stats, book = self._state, self._stats, self._state.book
        dropped: list[str] = []
        recalled = 0
        dead: list[str] = []
        failed: list[str] = []
        for p, r in zip(batch, results, strict=True):
            e = p.entry
            if r.outcome is Outcome.FAILED:
                stats.failed += 1
                p.attempts += 1
                failed.append(r.reason)
                state.heap.push(p, now_ms + retry_delay_ms(p.attempts))
                continue
            book.queue(e.queue_id).resolved(e.queue_offset)
            if r.outcome is Outcome.DROPPED:
                stats.dropped += 1
                if r.reason == RECALLED:
                    recalled += 1
                else:
                    dropped.append(r.reason)
            elif r.topic == DEAD_TOPIC:
                stats.dead_lettered += 1
                dead.append(r.reason)
            elif p.action is ResolveAction.DELIVER:
                stats.record_delivery(max(0, now_ms - e.deliver_at_ms))
            else:
                stats.parked += 1
        if recalled:
            log.info(
                "broker %s dropped %d scheduled messages their producers recalled",
                self.broker,
                recalled,
            )
        if dropped:
            log.warning(
                "broker %s dropped %d scheduled messages (first reason: %s)",
                self.broker,
                len(dropped),
                dropped[0] or "none given",
            )
        if dead:
            log.warning(
                "broker %s kept %d scheduled messages as dead letters in %s (first reason: %s)",
                self.broker,
                len(dead),
                DEAD_TOPIC,
                dead[0] or "none given",
            )
        if failed:
            log.warning(
                "broker %s could not resolve %d scheduled messages; trying again (first "
                "reason: %s)",
                self.broker,
                len(failed),
                failed[0] or "none given",
            )
            self._wake.set()
        state.check_room()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop sending; calls in flight get ``timeout_s`` to finish (then they are cut, and
        their entries stay unresolved)."""
        await super().stop(timeout_s)
        calls = set(self._calls)
        if calls:
            _, slow = await asyncio.wait(calls, timeout=timeout_s)
            for task in slow:
                task.cancel()
            if slow:
                await asyncio.wait(slow, timeout=1.0)

    async def hand_back(self) -> int:
        """At a graceful stop (the loop stopped): deliver what is due and park what is held
        for later, so that the next session, resuming from the committed progress, resolves
        nothing twice. Returns how many entries were handed back; raises ApogeeError when the
        broker fails (what was not resolved stays below the progress)."""
        state = self._state
        items = state.heap.clear() + list(state.parks)
        state.parks.clear()
        now = self._clock.time_ms()
        for p in items:
            if p.entry.deliver_at_ms > now:
                p.action = ResolveAction.PARK
        for i in range(0, len(items), self._max_batch):
            batch = items[i : i + self._max_batch]
            results = await self._call(batch)
            self.settle(batch, results, self._clock.time_ms())
        return len(items)


class Committer(BackgroundLoop):
    def __init__(
        self,
        broker: str,
        client: ScheduleClient,
        state: SessionState,
        *,
        interval_s: float,
        on_error: ErrorHandler,
    ) -> None:
        super().__init__(on_error)
        self.name = f"commit {broker}"
        self._client = client
        self._state = state
        self._interval_s = interval_s

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.commit()

    async def commit(self) -> None:
        """Commit the progress book if it changed since the last commit."""
        offsets = self._state.book.uncommitted()
        if offsets is None:
            return
        await self._client.commit(offsets)
        self._state.book.committed(offsets)
