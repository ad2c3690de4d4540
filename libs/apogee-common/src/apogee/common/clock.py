"""Time, injected: code that waits or stamps takes a :class:`Clock`, so tests can control it."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time_ms(self) -> int:
        """Wall-clock milliseconds since the epoch (stamps written to disk)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (timeouts and intervals)."""
        ...


class SystemClock:
    """The real clock."""

    def time_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to; for tests of retention, timers and expiry."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._ms = start_ms
        self._mono = 0.0

    def time_ms(self) -> int:
        return self._ms

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        self._ms += int(seconds * 1000)
        self._mono += seconds


SYSTEM_CLOCK = SystemClock()
