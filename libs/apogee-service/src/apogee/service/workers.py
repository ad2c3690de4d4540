"""One worker per broker: a session kept running, and started again with backoff after a failure.

A service that works on every broker (schedule, the transaction checker) runs one
:class:`BrokerWorker` per live broker. The worker makes a :class:`Session` (the service's own
work on that broker: its channel and its loops), starts it and waits until it fails; then it
stops the session (bounded), waits out a :class:`Backoff` (0.25 s doubling to 5 s by default,
back to the first step once a session has started) and makes a new one. :class:`BrokerWorkers`
keeps one worker per broker of a list (as :class:`apogee.service.directory.NameServerDirectory`
answers it): a new broker gets a worker; a broker gone, or moved to another address, has its
worker stopped (and, when moved, started again there).

What the services' own sessions share: :class:`BrokerSessionBase` (the broker's name, its
client, closed when the session stops, and ``failed``), and :func:`counted_worker` (a worker
that counts the failed sessions in the service's stats and stops a failed one within a second).

The waits between sessions go through an injected ``sleep``, so tests can see and drive them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from apogee.common.errors import ApogeeError

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


class Session(Protocol):
    """What a worker needs of one session with a broker."""

    #: Set (to the reason) when the session fails after it started.
    failed: asyncio.Future[BaseException]

    async def start(self) -> None:
        """Connect and start the session's loops; raises when the broker does not answer."""

    async def stop(self, grace_s: float) -> None:
        """Stop the loops and let go of what the session holds (its channel), within about
        ``grace_s``; never raises for a broker that does not answer. Also called for a session
        whose :meth:`start` failed."""


S = TypeVar("S", bound=Session)


@dataclass(frozen=True, slots=True)
class Backoff:
    """The wait before the next session: ``first_s``, doubling with each failure in a row, at
    most ``max_s``."""

    first_s: float = 0.25
    max_s: float = 5.0

    def delay_s(self, failures: int) -> float:
        """The wait after ``failures`` failures in a row (1, 2, ...)."""
        return float(min(self.max_s, self.first_s * 2 ** max(0, failures - 1)))


class BrokerWorker(Generic[S]):
    """Keeps a session (made by ``new_session(address)``) running for one broker until stopped.

    ``failure_grace_s`` bounds the stop of a failed session; ``on_failure`` is told every
    failure (for counters); ``failure_note`` ends the warning a failure logs (what the service
    loses with the session, say)."""

    def __init__(
        self,
        broker: str,
        address: str,
        new_session: Callable[[str], S],
        *,
        backoff: Backoff = Backoff(),
        failure_grace_s: float = 1.0,
        on_failure: Callable[[BaseException], None] | None = None,
        failure_note: str = "",
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.broker = broker
        self.address = address
        self._new_session = new_session
        self._backoff = backoff
        self._failure_grace_s = failure_grace_s
        self._on_failure = on_failure
        self._failure_note = failure_note
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None
        #: the running session (None between sessions)
        self.session: S | None = None
        #: sessions started (1 after the first start; more after failures)
        self.sessions_started = 0

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"broker {self.broker}")

    async def _run(self) -> None:
        failures = 0
        while True:
            session = self.session = self._new_session(self.address)
            try:
                await session.start()
            except Exception as err:  # the broker does not answer, or answers nonsense
                reason: BaseException = err
            else:
                self.sessions_started += 1
                failures = 0
                reason = await session.failed
            failures += 1
            delay = self._backoff.delay_s(failures)
            log.warning(
                "broker %s at %s failed (%s); %strying again in %.2fs",
                self.broker,
                self.address,
                reason if isinstance(reason, ApogeeError) else repr(reason),
                self._failure_note,
                delay,
                exc_info=None if isinstance(reason, ApogeeError) else reason,
            )
            self.session = None
            if self._on_failure is not None:
                self._on_failure(reason)
            await session.stop(self._failure_grace_s)
            await self._sleep(delay)

    async def stop(self, grace_s: float) -> None:
        """Stop the worker, then its session (which gets ``grace_s`` to finish its work)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=grace_s + 2.0)
        session, self.session = self.session, None
        if session is not None:
            await session.stop(grace_s)


class SessionStats(Protocol):
    """Where a service counts its broker sessions that failed."""

    session_failures: int


def counted_worker(
    broker: str,
    address: str,
    new_session: Callable[[str], S],
    *,
    shutdown_grace_s: float,
    stats: SessionStats,
    failure_note: str,
    sleep: Sleep = asyncio.sleep,
) -> BrokerWorker[S]:
    """The worker of a service that keeps a session per broker: every failure counts in
    ``stats.session_failures`` (exported with :func:`apogee.service.metrics.session_failures`),
    a failed session gets ``min(1, shutdown_grace_s)`` seconds to stop, ``failure_note`` ends
    the warning (see :class:`BrokerWorker`)."""

    def failed(_: BaseException) -> None:
        stats.session_failures += 1

    return BrokerWorker(
        broker,
        address,
        new_session,
        failure_grace_s=min(1.0, shutdown_grace_s),
        on_failure=failed,
        failure_note=failure_note,
        sleep=sleep,
    )


class Closable(Protocol):
    async def close(self) -> None: ...


C = TypeVar("C", bound=Closable)


class BrokerSessionBase(Generic[C]):
    """A :class:`Session` on the broker named ``broker`` through ``client``: ``failed`` is set
    by the first :meth:`_fail` (what the session's loops are given as their ``on_error``);
    :meth:`stop` winds the session down (:meth:`_wind_down`, given at least 0.1 s) and closes
    the client whatever happens. Subclasses implement :meth:`start` and :meth:`_wind_down`."""

    def __init__(self, broker: str, client: C) -> None:
        self.broker = broker
        self.client = client
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    def _fail(self, exc: BaseException) -> None:
        if not self.failed.done():
            self.failed.set_result(exc)

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self, grace_s: float) -> None:
        try:
            await self._wind_down(max(0.1, grace_s))
        finally:
            await self.client.close()

    async def _wind_down(self, grace_s: float) -> None:
        """Stop the session's loops and save what they did, each step bounded by ``grace_s``;
        never raises for a broker that does not answer."""
        raise NotImplementedError


class BrokerWorkers(Generic[S]):
    """One worker per broker, made by ``new_worker(broker, address)``; ``grace_s`` is what each
    stopping worker's session gets."""

    def __init__(self, new_worker: Callable[[str, str], BrokerWorker[S]], grace_s: float) -> None:
        self._new_worker = new_worker
        self.grace_s = grace_s
        #: broker -> its worker
        self.workers: dict[str, BrokerWorker[S]] = {}

    def __len__(self) -> int:
        return len(self.workers)

    async def sync(self, brokers: Mapping[str, str]) -> None:
        """Match ``brokers`` (broker -> address): stop the workers of brokers gone or moved,
        start workers for brokers without one."""
        for name, worker in list(self.workers.items()):
            address = brokers.get(name)
            if address == worker.address:
                continue
            del self.workers[name]
            if address is None:
                log.info("broker %s left the cluster; its worker stops", name)
            else:
                log.info("broker %s moved from %s to %s", name, worker.address, address)
            await worker.stop(self.grace_s)
        for name, address in sorted(brokers.items()):
            if name not in self.workers:
                log.info("serving broker %s at %s", name, address)
                worker = self.workers[name] = self._new_worker(name, address)
                worker.start()

    async def stop(self) -> None:
        """Stop every worker at once, bounded: a worker still stopping after ``3 * grace_s +
        5`` seconds is cut."""
        workers = list(self.workers.values())
        self.workers.clear()
        if not workers:
            return
        stops = [asyncio.create_task(w.stop(self.grace_s)) for w in workers]
        _, slow = await asyncio.wait(stops, timeout=3 * self.grace_s + 5.0)
        for task in slow:
            task.cancel()
        if slow:
            log.warning("%d brokers' workers did not stop in time; cut", len(slow))
            await asyncio.wait(slow, timeout=1.0)
