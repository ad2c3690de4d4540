"""One broker's check work: a session per connection, running one round after another.

A :class:`BrokerSession` reads the broker's transaction state (to say where it starts) and
runs a :class:`RoundLoop`: a :class:`~.rounds.CheckRound` every ``check_interval_s`` (from the
start of one to the start of the next, plus up to ``jitter_ms``; the first after up to
``jitter_ms``, so that the brokers' loops do not tick together). A round that overruns its
interval is cut at the next one's start and the next starts at once. Any failed call ends the
session; a :class:`apogee.service.workers.BrokerWorker` (:func:`broker_worker`) starts a new one
after a backoff (0.25 s doubling to 5 s, reset once a session starts), without stopping the
other brokers' sessions. Stopping a session (bounded by ``shutdown_grace_s``) cuts the round in
progress and commits what it processed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from opentelemetry.trace import Tracer

from apogee.common.clock import Clock
from apogee.common.errors import ApogeeError
from apogee.service.loops import BackgroundLoop, ErrorHandler
from apogee.service.workers import BrokerSessionBase, BrokerWorker, counted_worker
from apogee_txn_checker.core.client import TransactionCheckClient
from apogee_txn_checker.core.ratelimit import GroupLimiter
from apogee_txn_checker.core.rounds import CheckRound, RoundReport
from apogee_txn_checker.core.stats import CheckerStats
from apogee_txn_checker.settings import TxnCheckerSettings

log = logging.getLogger(__name__)

ClientFactory = Callable[[str], TransactionCheckClient]
Sleep = Callable[[float], Awaitable[None]]


class RoundLoop(BackgroundLoop):
    """Rounds on one broker, one after another."""

    name = "check rounds"

    def __init__(
        self,
        broker: str,
        client: TransactionCheckClient,
        settings: TxnCheckerSettings,
        clock: Clock,
        stats: CheckerStats,
        limiter: GroupLimiter,
        rng: random.Random,
        on_error: ErrorHandler,
        sleep: Sleep = asyncio.sleep,
        tracer: Tracer | None = None,
    ) -> None:
        super().__init__(on_error)
        self.broker = broker
        self.tracer = tracer
        self.client = client
        self.settings = settings
        self.clock = clock
        self.stats = stats
        self.limiter = limiter
        self.rng = rng
        self._sleep = sleep
        #: the round running, or the last one
        self.current: CheckRound | None = None
        #: reports of the rounds finished, oldest first (the last few)
        self.reports: list[RoundReport] = []

    def _jitter_s(self) -> float:
        return self.rng.uniform(0.0, self.settings.jitter_ms / 1000)

    async def _run(self) -> None:
        interval = self.settings.check_interval_s
        start = self.clock.monotonic() + self._jitter_s()
        while True:
            wait = start - self.clock.monotonic()
            if wait > 0:
                await self._sleep(wait)
            started = self.clock.monotonic()
            current = self.current = CheckRound(
                self.broker,
                self.client,
                self.settings,
                self.clock,
                self.stats,
                self.limiter,
                deadline=started + interval,
                sleep=self._sleep,
                tracer=self.tracer,
            )
            report = await current.run()
            self.reports = [*self.reports[-9:], report]
            if report.eventful:
                log.info("broker %s: round: %s", self.broker, report.summary())
            else:
                log.debug("broker %s: round: %s", self.broker, report.summary())
            start = started + interval + self._jitter_s()


class BrokerSession(BrokerSessionBase[TransactionCheckClient]):
    """One broker from its state until it fails or is stopped."""

    def __init__(
        self,
        broker: str,
        client: TransactionCheckClient,
        settings: TxnCheckerSettings,
        clock: Clock,
        stats: CheckerStats,
        limiter: GroupLimiter,
        rng: random.Random,
        sleep: Sleep = asyncio.sleep,
        tracer: Tracer | None = None,
    ) -> None:
        super().__init__(broker, client)
        self.settings = settings
        self.loop = RoundLoop(
            broker, client, settings, clock, stats, limiter, rng, self._fail, sleep, tracer
        )

    async def start(self) -> None:
        """Read the broker's state and start the rounds; raises ApogeeError when the broker
        does not answer."""
        st = await self.client.get_state()
        log.info(
            "broker %s (%s): half queue [%d, %d), op queue [%d, %d), progress %s; %d producer "
            "groups connected",
            self.broker,
            st.broker_name,
            st.half_min_offset,
            st.half_max_offset,
            st.op_min_offset,
            st.op_max_offset,
            f"half {st.half_progress}, op {st.op_progress}"
            if st.half_progress >= 0
            else "never committed",
            len(st.producers),
        )
        self.loop.start()

    async def _wind_down(self, grace_s: float) -> None:
        """Cut the round in progress (checks in flight are cancelled: they are not counted as
        processed), commit what it processed (then the client is closed); each step bounded by
        ``grace_s``; never raises for a broker that does not answer."""
        await self.loop.stop(grace_s)
        current = self.loop.current
        if current is not None and not self.failed.done():
            try:
                await asyncio.wait_for(current.commit(), grace_s)
            except (ApogeeError, TimeoutError) as err:
                log.warning(
                    "broker %s: the final progress commit failed (%s); the next session "
                    "scans again from the progress committed before (the broker answers "
                    "CLOSED for what was checked since)",
                    self.broker,
                    err,
                )


def broker_worker(
    broker: str,
    address: str,
    settings: TxnCheckerSettings,
    clock: Clock,
    stats: CheckerStats,
    limiter: GroupLimiter,
    rng: random.Random,
    client_factory: ClientFactory,
    sleep: Sleep = asyncio.sleep,
    tracer: Tracer | None = None,
) -> BrokerWorker[BrokerSession]:
    """The worker that keeps a :class:`BrokerSession` running for ``broker``."""

    def new_session(address: str) -> BrokerSession:
        return BrokerSession(
            broker, client_factory(address), settings, clock, stats, limiter, rng, sleep, tracer
        )

    return counted_worker(
        broker,
        address,
        new_session,
        shutdown_grace_s=settings.shutdown_grace_s,
        stats=stats,
        failure_note="the round in progress is dropped (scanned again from the committed "
        "progress), ",
        sleep=sleep,
    )
