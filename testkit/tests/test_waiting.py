"""Polls with a deadline: they return once the check holds, check once more after the bound, and
fail naming what was awaited."""

from __future__ import annotations

import asyncio
import time

import pytest

from apogee.testkit.waiting import eventually, wait_until

pytestmark = pytest.mark.unit


def test_wait_until_returns_the_seconds_it_took() -> None:
    ready = time.monotonic() + 0.1
    took = wait_until(lambda: time.monotonic() >= ready, 5, "the time", every=0.01)
    assert 0.09 <= took < 5


def test_a_check_that_first_holds_after_the_bound_still_passes() -> None:
    calls: list[float] = []

    def slow() -> bool:
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(0.1)  # the machine stalls past the deadline during the first check
            return False
        return True

    wait_until(slow, 0.05, "the second check")
    assert len(calls) == 2


def test_a_failure_names_what_and_adds_the_detail() -> None:
    with pytest.raises(AssertionError, match=r"not within 0\.05s: the impossible\nthe log"):
        wait_until(lambda: False, 0.05, "the impossible", detail=lambda: "the log")


def test_wait_until_refuses_an_async_check() -> None:
    async def check() -> bool:
        return True

    with pytest.raises(TypeError, match="eventually"):
        wait_until(check, 1, "an async check")


async def test_eventually_takes_plain_and_coroutine_checks() -> None:
    seen: list[int] = []

    async def later() -> bool:
        await asyncio.sleep(0)
        seen.append(1)
        return len(seen) >= 3

    assert await eventually(later, 5, "three calls", every=0.001) < 5
    assert await eventually(lambda: [1], 5, "a true value") < 5
    with pytest.raises(AssertionError, match=r"not within 0\.05s: nothing"):
        await eventually(lambda: None, 0.05, "nothing")
