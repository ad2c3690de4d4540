"""The scheduler: one :class:`~apogee.service.workers.BrokerWorker` per live broker.

The broker list comes from the nameservers' cluster info, read at start and then every
``broker_refresh_s``; :class:`~apogee.service.directory.DirectoryWorkers` matches the workers to it:
a new broker gets a worker, a broker gone from every nameserver has its worker stopped
(progress committed when it still answers), a broker that moved to another address is started
again there. When no nameserver answers, the current brokers are kept. Every
``REPORT_INTERVAL_S`` the deliveries since the last report are logged with their lateness.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from opentelemetry.trace import Tracer

from apogee.common.clock import Clock
from apogee.service.directory import DirectoryWorkers
from apogee.service.loops import BackgroundLoop
from apogee.service.workers import BrokerWorker
from apogee_schedule.core.client import BrokerScheduleClient
from apogee_schedule.core.session import BrokerSession, ClientFactory, broker_worker
from apogee_schedule.core.stats import ScheduleStats
from apogee_schedule.settings import ScheduleSettings

log = logging.getLogger(__name__)

REPORT_INTERVAL_S: Final = 10.0


class Scheduler:
    """``await start()`` finds the brokers and serves them; ``await stop()`` stops every
    worker (each commits its progress), bounded by ``shutdown_grace_s``."""

    def __init__(
        self,
        settings: ScheduleSettings,
        clock: Clock,
        stats: ScheduleStats,
        client_factory: ClientFactory | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        """``tracer``: the service's, when it traces (see :mod:`.spans`)."""
        self.settings = settings
        self.tracer = tracer
        self.clock = clock
        self.stats = stats
        self._factory: ClientFactory = client_factory or BrokerScheduleClient.factory(settings)
        self._brokers = DirectoryWorkers.from_settings(settings, self._new_worker, log)
        self._reporter: Reporter | None = None

    @property
    def workers(self) -> dict[str, BrokerWorker[BrokerSession]]:
        """Broker -> its worker."""
        return self._brokers.workers

    def _new_worker(self, broker: str, address: str) -> BrokerWorker[BrokerSession]:
        return broker_worker(
            broker, address, self.settings, self.clock, self.stats, self._factory, self.tracer
        )

    async def start(self) -> None:
        await self._brokers.start()
        self._reporter = Reporter(self.stats, REPORT_INTERVAL_S)
        self._reporter.start()

    async def stop(self) -> None:
        if self._reporter is not None:
            await self._reporter.stop()
            self._reporter.report()
        await self._brokers.stop()


class Reporter(BackgroundLoop):
    """Logs the deliveries since the last report with their lateness."""

    name = "delivery report"

    def __init__(self, stats: ScheduleStats, interval_s: float) -> None:
        super().__init__(lambda exc: log.error("delivery report stopped: %r", exc))
        self._stats = stats
        self._interval_s = interval_s
        self._last = stats.snapshot()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            self.report()

    def report(self) -> None:
        s = self._stats
        now = s.snapshot()
        last, self._last = self._last, now
        delivered = now.delivered - last.delivered
        others = (now.parked, now.dropped, now.dead_lettered)
        if not delivered and others == (last.parked, last.dropped, last.dead_lettered):
            return
        recent = sorted(list(s.lateness_ms)[-delivered:]) if delivered else [0]
        log.info(
            "delivered %d, parked %d, dropped %d, dead-lettered %d since the last report; "
            "lateness p50 %d ms, p99 %d ms, max %d ms",
            delivered,
            now.parked - last.parked,
            now.dropped - last.dropped,
            now.dead_lettered - last.dead_lettered,
            recent[len(recent) // 2],
            recent[min(len(recent) - 1, int(0.99 * len(recent)))],
            recent[-1],
        )
