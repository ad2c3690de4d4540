"""BrokerWorker and BrokerWorkers: sessions kept running, replaced with backoff, stopped bounded;
the counted worker and the sessions' shared base.

The sessions are fakes and the waits between them go through an injected sleep that the test
releases, so nothing here waits on the wall clock.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import pytest

from apogee.common.errors import UnavailableError
from apogee.service.loops import BackgroundLoop
from apogee.service.workers import (
    Backoff,
    BrokerSessionBase,
    BrokerWorker,
    BrokerWorkers,
    counted_worker,
)

pytestmark = pytest.mark.unit

WAIT_S = 5.0


class FakeSession:
    def __init__(self, address: str, start_error: Exception | None) -> None:
        self.address = address
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self._start_error = start_error
        self.started = False
        self.stopped_with: float | None = None

    async def start(self) -> None:
        if self._start_error is not None:
            raise self._start_error
        self.started = True

    async def stop(self, grace_s: float) -> None:
        self.stopped_with = grace_s


class Sessions:
    """Makes sessions (failing to start with the queued errors first) and hands each to the
    test as it is made."""

    def __init__(self, *start_errors: Exception) -> None:
        self._errors = deque(start_errors)
        self.made: asyncio.Queue[FakeSession] = asyncio.Queue()

    def __call__(self, address: str) -> FakeSession:
        session = FakeSession(address, self._errors.popleft() if self._errors else None)
        self.made.put_nowait(session)
        return session

    async def next(self) -> FakeSession:
        return await asyncio.wait_for(self.made.get(), WAIT_S)


class Waits:
    """An injected sleep: each wait is reported to the test and lasts until it is released."""

    def __init__(self) -> None:
        self.asked: asyncio.Queue[float] = asyncio.Queue()
        self._go: asyncio.Queue[None] = asyncio.Queue()

    async def sleep(self, delay: float) -> None:
        self.asked.put_nowait(delay)
        await self._go.get()

    async def next(self) -> float:
        return await asyncio.wait_for(self.asked.get(), WAIT_S)

    def release(self) -> None:
        self._go.put_nowait(None)


def running(loop: BrokerWorker[FakeSession] | BackgroundLoop) -> bool:
    return loop.running


def session_of(worker: BrokerWorker[FakeSession]) -> FakeSession | None:
    return worker.session


def test_backoff_doubles_and_is_capped() -> None:
    assert [Backoff().delay_s(n) for n in range(1, 8)] == [0.25, 0.5, 1, 2, 4, 5, 5]
    assert Backoff(first_s=0.1, max_s=0.3).delay_s(3) == 0.3


async def test_a_failed_session_is_stopped_and_replaced_after_the_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sessions, waits = Sessions(), Waits()
    failures: list[BaseException] = []
    worker = BrokerWorker(
        "east/a",
        "a:10911",
        sessions,
        failure_grace_s=0.5,
        on_failure=failures.append,
        failure_note="its work in memory is dropped, ",
        sleep=waits.sleep,
    )
    worker.start()
    try:
        first = await sessions.next()
        assert first.address == "a:10911"
        reason = UnavailableError(what="broker a:10911", detail="connection reset")
        first.failed.set_result(reason)
        assert await waits.next() == 0.25
        assert first.stopped_with == 0.5  # stopped before the wait, with the failure grace
        assert failures == [reason]
        assert session_of(worker) is None
        assert "broker east/a at a:10911 failed (" in caplog.text
        assert "connection reset); its work in memory is dropped, trying again in 0.25s" in (
            caplog.text
        )
        waits.release()
        second = await sessions.next()
        assert session_of(worker) is second
        assert second.started
        assert worker.sessions_started == 2
    finally:
        await worker.stop(1.0)
    assert not running(worker)


async def test_failures_in_a_row_wait_longer_and_a_started_session_resets_the_backoff() -> None:
    down = UnavailableError(what="broker a:10911", detail="refused")
    sessions, waits = Sessions(down, down, down), Waits()
    worker = BrokerWorker("east/a", "a:10911", sessions, sleep=waits.sleep)
    worker.start()
    try:
        delays = []
        for _ in range(3):
            never_started = await sessions.next()
            assert not never_started.started
            delays.append(await waits.next())
            assert never_started.stopped_with == 1.0  # what it holds is let go all the same
            waits.release()
        assert delays == [0.25, 0.5, 1.0]
        up = await sessions.next()
        assert up.started
        up.failed.set_result(RuntimeError("a bug in a loop"))
        assert await waits.next() == 0.25
    finally:
        await worker.stop(1.0)
    assert worker.sessions_started == 1


async def test_stop_gives_the_running_session_its_grace() -> None:
    sessions = Sessions()
    worker = BrokerWorker("east/a", "a:10911", sessions)
    worker.start()
    session = await sessions.next()
    await worker.stop(3.0)
    assert session.stopped_with == 3.0
    assert worker.session is None
    assert not running(worker)
    await worker.stop(3.0)  # twice is harmless


class Stats:
    def __init__(self) -> None:
        self.session_failures = 0


async def test_a_counted_worker_counts_each_failure_and_stops_the_session_within_the_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    down = UnavailableError(what="broker a:10911", detail="refused")
    sessions, waits, stats = Sessions(down), Waits(), Stats()
    worker = counted_worker(
        "east/a",
        "a:10911",
        sessions,
        shutdown_grace_s=0.5,
        stats=stats,
        failure_note="its work is dropped, ",
        sleep=waits.sleep,
    )
    worker.start()
    try:
        never_started = await sessions.next()
        assert await waits.next() == 0.25
        assert (stats.session_failures, never_started.stopped_with) == (1, 0.5)
        assert "refused); its work is dropped, trying again in 0.25s" in caplog.text
        waits.release()
        up = await sessions.next()
        up.failed.set_result(RuntimeError("a bug in a loop"))
        assert await waits.next() == 0.25
        assert stats.session_failures == 2
    finally:
        await worker.stop(1.0)


class Client:
    def __init__(self) -> None:
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


class WindingDown(BrokerSessionBase[Client]):
    def __init__(self, error: Exception | None = None) -> None:
        super().__init__("east/a", Client())
        self.error = error
        self.wound_down_with: float | None = None

    async def start(self) -> None:
        pass

    async def _wind_down(self, grace_s: float) -> None:
        self.wound_down_with = grace_s
        if self.error is not None:
            raise self.error


async def test_a_session_fails_once_and_closes_its_client_however_it_winds_down() -> None:
    session = WindingDown()
    first, second = UnavailableError(what="broker a:1", detail="reset"), ValueError("later")
    session._fail(first)
    session._fail(second)
    assert session.failed.result() is first  # the first reason is kept
    await session.stop(0.0)
    assert (session.wound_down_with, session.client.closed) == (0.1, 1)  # at least 0.1 s

    broken = WindingDown(ValueError("a bug in the wind-down"))
    with pytest.raises(ValueError, match="a bug in the wind-down"):
        await broken.stop(2.0)
    assert (broken.wound_down_with, broken.client.closed) == (2.0, 1)


async def test_workers_follow_the_broker_list(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    made: list[BrokerWorker[FakeSession]] = []
    sessions = Sessions()

    def new_worker(broker: str, address: str) -> BrokerWorker[FakeSession]:
        made.append(BrokerWorker(broker, address, sessions))
        return made[-1]

    workers = BrokerWorkers(new_worker, grace_s=2.0)
    await workers.sync({"east/a": "a:1", "east/b": "b:1"})
    assert sorted(workers.workers) == ["east/a", "east/b"]
    a, b = workers.workers["east/a"], workers.workers["east/b"]
    assert running(a)
    assert running(b)
    assert len(workers) == 2

    await workers.sync({"east/a": "a:1", "east/b": "b:2", "east/c": "c:1"})
    assert workers.workers["east/a"] is a  # unchanged: kept
    assert not running(b)  # moved: stopped, and a new worker at the new address
    assert workers.workers["east/b"].address == "b:2"
    assert "broker east/b moved from b:1 to b:2" in caplog.text

    await workers.sync({"east/b": "b:2", "east/c": "c:1"})
    assert not running(a)
    assert "broker east/a left the cluster; its worker stops" in caplog.text
    assert sorted(workers.workers) == ["east/b", "east/c"]

    await workers.stop()
    assert len(workers) == 0
    assert not any(running(w) for w in made)


async def test_a_background_loop_reports_its_failure_and_stops_bounded() -> None:
    errors: list[BaseException] = []
    reported = asyncio.Event()
    go = asyncio.Event()

    def on_error(exc: BaseException) -> None:
        errors.append(exc)
        reported.set()

    class Failing(BackgroundLoop):
        name = "failing"

        async def _run(self) -> None:
            await go.wait()
            raise ValueError("broken")

    failing = Failing(on_error)
    failing.start()
    with pytest.raises(RuntimeError, match="failing is already started"):
        failing.start()
    assert running(failing)
    go.set()
    await asyncio.wait_for(reported.wait(), WAIT_S)
    assert [str(e) for e in errors] == ["broken"]
    assert not running(failing)

    class Waiting(BackgroundLoop):
        name = "waiting"

        async def _run(self) -> None:
            await asyncio.Event().wait()

    waiting = Waiting(on_error)
    waiting.start()
    await waiting.stop(WAIT_S)
    assert not running(waiting)
    assert len(errors) == 1  # a stop is not a failure
