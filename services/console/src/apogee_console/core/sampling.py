"""The charts' series: sampled by the console itself, or read from Prometheus.

:class:`Series` keeps one label's points, at most :data:`WINDOW_S` of them (older ones are
dropped), and :class:`SeriesStore` at most :data:`MAX_SERIES` series per kind, so memory stays
bounded whatever the cluster holds.

:class:`Sampler` is a background loop (``start()``, ``stop()``, a bounded shutdown): every
``interval_s`` it reads each topic's max offsets (the rate is the growth between two samples),
each group's lag and the schedule backlog per delay level through
:class:`~apogee_console.core.cluster.ClusterView`. A failed round is logged and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Final, Literal

from apogee.common.errors import ApogeeError
from apogee.common.topics import is_system_topic
from apogee_console.core.cluster import ClusterView
from apogee_console.core.views import Json

log = logging.getLogger(__name__)

Kind = Literal["topic_rate", "group_lag", "schedule_backlog"]
#: Points older than this are dropped.
WINDOW_S: Final = 3600.0
#: Most series of one kind kept (the first ones seen).
MAX_SERIES: Final = 2000
#: Topics (groups) described at once by a round: a round is spread out rather than a burst
#: that holds up the requests being answered.
SAMPLE_CONCURRENCY: Final = 4
#: How long stop() waits for a round in flight.
STOP_TIMEOUT_S: Final = 2.0


class Series:
    def __init__(self) -> None:
        self.points: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        self.points.append((t, value))
        while self.points and self.points[0][0] < t - WINDOW_S:
            self.points.popleft()

    def since(self, t: float) -> list[list[float]]:
        return [[round(p[0], 3), p[1]] for p in self.points if p[0] >= t]

    def last(self) -> float | None:
        return self.points[-1][1] if self.points else None


class SeriesStore:
    def __init__(self) -> None:
        self._by_kind: dict[Kind, dict[str, Series]] = {
            "topic_rate": {},
            "group_lag": {},
            "schedule_backlog": {},
        }

    def add(self, kind: Kind, label: str, t: float, value: float) -> None:
        series = self._by_kind[kind]
        s = series.get(label)
        if s is None:
            if len(series) >= MAX_SERIES:
                return
            s = series[label] = Series()
        s.add(t, value)

    def get(self, kind: Kind, label: str) -> Series | None:
        return self._by_kind[kind].get(label)

    def all(self, kind: Kind) -> dict[str, Series]:
        return self._by_kind[kind]

    def last(self, kind: Kind, label: str) -> float | None:
        s = self.get(kind, label)
        return s.last() if s is not None else None


class Sampler:
    """The sampling loop (see the module docstring)."""

    def __init__(
        self,
        cluster: ClusterView,
        interval_s: float,
        store: SeriesStore | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.store = store or SeriesStore()
        self.clock = clock
        self.rounds = 0
        self._offsets: dict[str, tuple[float, int]] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._stopping.clear()
            self._task = asyncio.create_task(self._run(), name="console sampler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping.set()
        try:
            await asyncio.wait_for(task, STOP_TIMEOUT_S)
        except TimeoutError:
            log.warning("the sampler did not stop within %.0f s; cancelled", STOP_TIMEOUT_S)
        except asyncio.CancelledError:
            if task.cancelled():
                return
            raise

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.sample_once()
            except ApogeeError as err:
                log.info("sampling the cluster failed: %s", err)
            except Exception:
                log.exception("sampling the cluster failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.interval_s)

    async def sample_once(self) -> None:
        """One round: topics, groups, schedule."""
        await asyncio.gather(self._topics(), self._groups(), self._schedule())
        self.rounds += 1

    async def _topics(self) -> None:
        names = [n for n in await self.cluster.topic_names() if not is_system_topic(n)]
        gate = asyncio.Semaphore(SAMPLE_CONCURRENCY)

        async def one(name: str) -> None:
            async with gate:
                try:
                    offsets = await self.cluster.offsets(name)
                except ApogeeError:
                    return
            now = self.clock()
            total = sum(offsets.values())
            before = self._offsets.get(name)
            self._offsets[name] = (now, total)
            if before is not None and now > before[0]:
                rate = max(0, total - before[1]) / (now - before[0])
                self.store.add("topic_rate", name, now, rate)

        await asyncio.gather(*map(one, names))

    async def _groups(self) -> None:
        groups = await self.cluster.groups()
        gate = asyncio.Semaphore(SAMPLE_CONCURRENCY)

        async def one(name: str) -> None:
            async with gate:
                try:
                    desc = await self.cluster.group(name)
                except ApogeeError:
                    return
            lag = desc["lag_messages"]
            if lag is not None:
                self.store.add("group_lag", name, self.clock(), float(lag))

        await asyncio.gather(*(one(g.group) for g in groups))

    async def _schedule(self) -> None:
        rows = await self.cluster.schedule()
        now = self.clock()
        for r in rows:
            self.store.add("schedule_backlog", str(r["level"]), now, float(r["backlog"]))

    def chart(self, kind: Kind, label: str | None, minutes: float) -> Json:
        """``{"source": "sampling", "series": [...]}`` of the last ``minutes``."""
        since = self.clock() - minutes * 60
        if label is not None:
            s = self.store.get(kind, label)
            series = [{"label": label, "points": s.since(since) if s else []}]
        else:
            series = [
                {"label": name, "points": s.since(since)}
                for name, s in sorted(self.store.all(kind).items(), key=_level_order)
            ]
        return {"source": "sampling", "series": series}


def _level_order(item: tuple[str, Series]) -> tuple[bool, int, str]:
    name = item[0]
    return (not name.isdigit(), int(name) if name.isdigit() else 0, name)
