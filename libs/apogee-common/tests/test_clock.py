from __future__ import annotations

import pytest

from apogee.common.clock import ManualClock, SystemClock

pytestmark = pytest.mark.unit


def test_manual_clock_moves_only_when_told() -> None:
    clock = ManualClock(start_ms=1_000)
    assert clock.time_ms() == 1_000
    assert clock.monotonic() == 0.0
    clock.advance(2.5)
    assert clock.time_ms() == 3_500
    assert clock.monotonic() == 2.5


def test_system_clock_is_monotonic_and_in_ms() -> None:
    clock = SystemClock()
    a, b = clock.monotonic(), clock.monotonic()
    assert b >= a
    assert clock.time_ms() > 1_600_000_000_000
