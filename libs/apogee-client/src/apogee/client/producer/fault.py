"""Latency fault tolerance, as RocketMQ's ``MQFaultStrategy`` and ``LatencyFaultToleranceImpl``.

After every request to a broker the producer records how long it took; a slow broker (or one
that failed) is then avoided for a while. The latency is put in the first band, counted from the
top, that it reaches, and the band says for how long the broker is not available:

    latency  >= 15000  3000  2000  1000  550  100  50 ms
    avoided     600000 180000 120000 60000 30000  0   0 ms

A failed request counts as a latency of 30000 ms (isolation), so the broker is avoided for ten
minutes, or until a later request to it succeeds quickly (each request overwrites the record).
When every broker is avoided, :meth:`LatencyFaultTolerance.pick_one_at_least` names the one
most likely to work: available first, then the lowest latency, then the soonest available,
rotating through the better half so that retries do not all land on the same broker.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from apogee.common.clock import SYSTEM_CLOCK, Clock

LATENCY_MAX_MS: Final = (50, 100, 550, 1000, 2000, 3000, 15000)
NOT_AVAILABLE_DURATION_MS: Final = (0, 0, 30000, 60000, 120000, 180000, 600000)
#: The latency a failed request counts as.
ISOLATION_LATENCY_MS: Final = 30000


def compute_not_available_duration(latency_ms: float) -> int:
    """How long (ms) to avoid a broker whose last request took ``latency_ms``."""
    for i in range(len(LATENCY_MAX_MS) - 1, -1, -1):
        if latency_ms >= LATENCY_MAX_MS[i]:
            return NOT_AVAILABLE_DURATION_MS[i]
    return 0


@dataclass(slots=True)
class FaultItem:
    name: str
    latency_ms: float
    #: monotonic milliseconds from which the broker is available again
    start_ms: float

    def available(self, now_ms: float) -> bool:
        return now_ms - self.start_ms >= 0

    def sort_key(self, now_ms: float) -> tuple[bool, float, float]:
        return (not self.available(now_ms), self.latency_ms, self.start_ms)


class LatencyFaultTolerance:
    """Per-broker latency records; thread-safe, time from the injected clock."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._items: dict[str, FaultItem] = {}
        self._lock = threading.Lock()
        self._which_worst = itertools.count()
        #: brokers whose last record made them unavailable for a while; any other broker is
        #: available without looking at the clock (its record started being available when
        #: it was made, and monotonic time only moves on)
        self._avoided: frozenset[str] = frozenset()

    def _now_ms(self) -> float:
        return self._clock.monotonic() * 1000.0

    def update(self, name: str, latency_ms: float, not_available_ms: float) -> None:
        start = self._now_ms() + not_available_ms
        with self._lock:
            item = self._items.get(name)
            if item is None:
                self._items[name] = FaultItem(name, latency_ms, start)
            else:
                item.latency_ms = latency_ms
                item.start_ms = start
            if not_available_ms > 0:
                self._avoided = self._avoided | {name}
            elif name in self._avoided:
                self._avoided = self._avoided - {name}

    def is_available(self, name: str) -> bool:
        if name not in self._avoided:
            return True
        item = self._items.get(name)
        return item is None or item.available(self._now_ms())

    def remove(self, name: str) -> None:
        with self._lock:
            self._items.pop(name, None)
            self._avoided = self._avoided - {name}

    def pick_one_at_least(self, among: Iterable[str] | None = None) -> str | None:
        """The broker most likely to work, of those with a record (restricted to ``among``
        when given); ``None`` when there is no record."""
        now = self._now_ms()
        with self._lock:
            items = list(self._items.values())
        if among is not None:
            allowed = set(among)
            items = [i for i in items if i.name in allowed]
        if not items:
            return None
        items.sort(key=lambda i: i.sort_key(now))
        half = len(items) // 2
        if half <= 0:
            return items[0].name
        return items[next(self._which_worst) % half].name

    def snapshot(self) -> dict[str, tuple[float, bool]]:
        """Each broker's last latency (ms) and whether it is available now."""
        now = self._now_ms()
        with self._lock:
            return {n: (i.latency_ms, i.available(now)) for n, i in self._items.items()}


class FaultStrategy:
    """Turns request outcomes into fault records (``enabled=False``: records nothing, every
    broker always available)."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tolerance = LatencyFaultTolerance(clock)

    def update(self, broker: str, latency_ms: float, isolation: bool) -> None:
        if not self.enabled:
            return
        latency = ISOLATION_LATENCY_MS if isolation else latency_ms
        self.tolerance.update(broker, latency, compute_not_available_duration(latency))

    def is_available(self, broker: str) -> bool:
        return not self.enabled or self.tolerance.is_available(broker)

    def pick_one_at_least(self, among: Iterable[str]) -> str | None:
        if not self.enabled:
            return None
        return self.tolerance.pick_one_at_least(among)
