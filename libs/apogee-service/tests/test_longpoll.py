"""HeldWaits: a hold ends when woken, timed out, cancelled or stopped, and always disarms.

Timeouts are fake timers the tests fire; wake-ups are the callbacks the holds arm.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from apogee.service.longpoll import HeldWaits

pytestmark = pytest.mark.unit

WAIT_S = 5.0


class FakeTimer:
    def __init__(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.delay_s = delay_s
        self._callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        assert not self.cancelled
        self._callback()


class FakeTimers:
    def __init__(self) -> None:
        self.made: list[FakeTimer] = []

    def __call__(self, delay_s: float, callback: Callable[[], None]) -> FakeTimer:
        self.made.append(FakeTimer(delay_s, callback))
        return self.made[-1]


class Watch:
    """What a hold arms: records its wake callback; counts disarms."""

    def __init__(self) -> None:
        self.wakes: list[Callable[[], None]] = []
        self.disarmed = 0
        self.armed = asyncio.Event()

    def __call__(self, wake: Callable[[], None]) -> Callable[[], None]:
        self.wakes.append(wake)
        self.armed.set()
        return self._disarm

    def _disarm(self) -> None:
        self.disarmed += 1

    async def wake(self) -> Callable[[], None]:
        await asyncio.wait_for(self.armed.wait(), WAIT_S)
        return self.wakes[-1]


async def held(waits: HeldWaits, timeout_s: float, watch: Watch) -> asyncio.Task[bool]:
    task = asyncio.create_task(waits.hold(timeout_s, watch))
    await asyncio.wait_for(watch.armed.wait(), WAIT_S)
    return task


async def test_a_wake_up_ends_the_hold_and_disarms() -> None:
    timers = FakeTimers()
    waits = HeldWaits(timers)
    watch = Watch()
    task = await held(waits, 15.0, watch)
    assert waits.held == 1
    assert [t.delay_s for t in timers.made] == [15.0]
    (await watch.wake())()
    assert await asyncio.wait_for(task, WAIT_S) is True
    assert watch.disarmed == 1
    assert timers.made[0].cancelled
    assert waits.held == 0


async def test_a_wake_up_from_another_thread_ends_the_hold() -> None:
    waits = HeldWaits(FakeTimers())
    watch = Watch()
    task = await held(waits, 15.0, watch)
    wake = await watch.wake()
    thread = threading.Thread(target=wake)
    thread.start()
    thread.join(WAIT_S)
    assert await asyncio.wait_for(task, WAIT_S) is True
    assert watch.disarmed == 1


async def test_the_timeout_ends_the_hold_with_false_and_disarms() -> None:
    timers = FakeTimers()
    waits = HeldWaits(timers)
    watch = Watch()
    task = await held(waits, 0.5, watch)
    timers.made[0].fire()
    assert await asyncio.wait_for(task, WAIT_S) is False
    assert watch.disarmed == 1
    assert waits.held == 0


async def test_whichever_of_wake_up_and_timeout_comes_first_decides() -> None:
    timers = FakeTimers()
    waits = HeldWaits(timers)
    first, second = Watch(), Watch()
    woken = await held(waits, 1.0, first)
    expired = await held(waits, 1.0, second)
    (await first.wake())()
    timers.made[0].fire()  # too late: already woken
    timers.made[1].fire()
    (await second.wake())()  # too late: already timed out
    assert await asyncio.wait_for(woken, WAIT_S) is True
    assert await asyncio.wait_for(expired, WAIT_S) is False


async def test_a_cancelled_hold_disarms_and_is_cancelled() -> None:
    timers = FakeTimers()
    waits = HeldWaits(timers)
    watch = Watch()
    task = await held(waits, 15.0, watch)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, WAIT_S)
    assert watch.disarmed == 1
    assert timers.made[0].cancelled
    assert waits.held == 0


async def test_stop_ends_every_hold_and_refuses_new_ones() -> None:
    waits = HeldWaits(FakeTimers())
    watches = [Watch(), Watch()]
    tasks = [await held(waits, 15.0, w) for w in watches]
    assert waits.held == 2
    waits.stop()
    assert waits.stopping
    assert await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S) == [False, False]
    assert [w.disarmed for w in watches] == [1, 1]
    late = Watch()
    assert await waits.hold(15.0, late) is False
    assert not late.wakes  # never armed
    assert waits.held == 0


async def test_no_time_left_answers_at_once_without_arming() -> None:
    timers = FakeTimers()
    waits = HeldWaits(timers)
    watch = Watch()
    assert await waits.hold(0.0, watch) is False
    assert await waits.hold(-0.1, watch) is False
    assert not watch.wakes
    assert not timers.made


async def test_a_failing_arm_leaves_nothing_held() -> None:
    timers = FakeTimers()
    waits = HeldWaits(timers)

    def broken(wake: Callable[[], None]) -> Callable[[], None]:
        raise OSError("no watch")

    with pytest.raises(OSError, match="no watch"):
        await waits.hold(1.0, broken)
    assert timers.made[0].cancelled
    assert waits.held == 0


async def test_the_event_loop_timer_is_the_default() -> None:
    waits = HeldWaits()
    watch = Watch()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await asyncio.wait_for(waits.hold(0.02, watch), WAIT_S) is False
    assert loop.time() - started >= 0.015  # asyncio may fire a timer a hair early
    assert watch.disarmed == 1
