"""Time, injected: code that waits or stamps takes a :class:`Clock`, so tests can control it."""

from __future__ import annotations

import time
from typing import Final, Protocol

from apogee.common.errors import InvalidArgumentError

#: The latest time Apogee takes or shows as a date: 9999-12-31T23:59:59.999Z, in ms since the
#: epoch (protobuf's int64 holds more, but no calendar a user reads does).
MAX_EPOCH_MS: Final = 253_402_300_799_999
#: The rule of every time given in ms since the epoch.
EPOCH_MS_RULE: Final = (
    f"must be a time from 1970-01-01 to 9999-12-31 UTC (0 to {MAX_EPOCH_MS} ms since the epoch)"
)


def check_epoch_ms(field: str, value: object) -> int:
    """``value`` when it is an int from 0 to :data:`MAX_EPOCH_MS`; else
    :class:`InvalidArgumentError` naming ``field`` and :data:`EPOCH_MS_RULE`."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_EPOCH_MS:
        return value
    got = repr(value)
    if len(got) > 40:
        got = f"{got[:24]}... ({len(got)} characters)"
    raise InvalidArgumentError(field=field, rule=f"{EPOCH_MS_RULE}, got {got}")


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
