"""GroupLimiter: a token bucket per producer group, with jitter on the waits."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from apogee_txn_checker.core.ratelimit import PRUNE_ABOVE, GroupLimiter

pytestmark = pytest.mark.unit


def test_a_burst_then_the_rate(vt: Any) -> None:
    limiter = GroupLimiter(2.0, 3, vt.clock, random.Random(1))
    assert [limiter.try_take("G") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.try_take("G") == pytest.approx(0.5)
    assert limiter.try_take("H") == 0.0  # each group has its own bucket
    vt.clock.mono += 0.5
    assert limiter.try_take("G") == 0.0
    assert limiter.try_take("G") == pytest.approx(0.5)
    vt.clock.mono += 100
    assert limiter.available("G") == 3  # never more than the burst


async def test_waits_are_spread_by_jitter(vt: Any) -> None:
    limiter = GroupLimiter(10.0, 1, vt.clock, random.Random(3), jitter_s=0.05, sleep=vt.sleep)
    times = []
    for _ in range(5):
        await vt.run(limiter.acquire("G"))
        times.append(vt.now)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0
    assert all(0.1 <= g <= 0.15 for g in gaps), gaps
    assert len({round(g, 6) for g in gaps}) > 1  # not in lockstep
    assert sum(gaps) / len(gaps) < 0.15


def test_full_buckets_are_forgotten(vt: Any) -> None:
    limiter = GroupLimiter(1.0, 1, vt.clock, random.Random(1))
    for i in range(PRUNE_ABOVE):
        limiter.try_take(f"g{i}")
    vt.clock.mono += 2  # every bucket full again
    limiter.try_take("new")
    assert limiter.available("g0") == 1


def test_a_rate_and_a_burst_are_needed(vt: Any) -> None:
    with pytest.raises(ValueError, match="rate must be positive"):
        GroupLimiter(0.0, 1, vt.clock, random.Random(1))
