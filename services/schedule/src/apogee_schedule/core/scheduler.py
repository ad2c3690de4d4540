"""The scheduler: one :class:`~apogee.common.workers.BrokerWorker` per live broker.

The broker list comes from the nameservers' cluster info
(:class:`~apogee.rpc.directory.NameServerDirectory`), read at start and then every
``broker_refresh_s``; :class:`~apogee.common.workers.BrokerWorkers` matches the workers to it:
a new broker gets a worker, a broker gone from every nameserver has its worker stopped
(progress committed when it still answers), a broker that moved to another address is started
again there. When no nameserver answers, the current brokers are kept. Every
``REPORT_INTERVAL_S`` the deliveries since the last report are logged with their lateness.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from apogee.common.clock import Clock
from apogee.common.errors import ApogeeError
from apogee.common.loops import BackgroundLoop
from apogee.common.workers import BrokerWorker, BrokerWorkers
from apogee.rpc.directory import NameServerDirectory
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
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.stats = stats
        timeout = settings.rpc_timeout_s
        self._factory: ClientFactory = client_factory or (
            lambda address: BrokerScheduleClient(address, timeout)
        )
        self._directory: NameServerDirectory | None = None
        self._workers: BrokerWorkers[BrokerSession] = BrokerWorkers(
            self._new_worker, settings.shutdown_grace_s
        )
        self._discovery: Discovery | None = None
        self._reporter: Reporter | None = None
        self._nameservers_down = False

    @property
    def workers(self) -> dict[str, BrokerWorker[BrokerSession]]:
        """Broker -> its worker."""
        return self._workers.workers

    def _new_worker(self, broker: str, address: str) -> BrokerWorker[BrokerSession]:
        return broker_worker(broker, address, self.settings, self.clock, self.stats, self._factory)

    async def start(self) -> None:
        self._directory = NameServerDirectory(
            self.settings.nameservers, self.settings.rpc_timeout_s
        )
        await self.refresh()
        self._discovery = Discovery(self, self.settings.broker_refresh_s)
        self._discovery.start()
        self._reporter = Reporter(self.stats, REPORT_INTERVAL_S)
        self._reporter.start()

    async def refresh(self) -> None:
        """Read the brokers from the nameservers and start or stop workers to match."""
        assert self._directory is not None
        try:
            brokers = await self._directory.brokers()
        except Exception as err:
            if not self._nameservers_down:
                log.warning(
                    "cannot read the brokers (keeping %d): %s",
                    len(self.workers),
                    err,
                    exc_info=None if isinstance(err, ApogeeError) else err,
                )
            self._nameservers_down = True
            return
        if self._nameservers_down:
            log.info("nameservers answer again")
            self._nameservers_down = False
        await self._workers.sync(brokers)

    async def stop(self) -> None:
        if self._discovery is not None:
            await self._discovery.stop()
        if self._reporter is not None:
            await self._reporter.stop()
            self._reporter.report()
        await self._workers.stop()
        if self._directory is not None:
            await self._directory.close()
            self._directory = None


#: How often the broker list is read while it is empty.
EMPTY_REFRESH_S = 1.0


class Discovery(BackgroundLoop):
    name = "broker discovery"

    def __init__(self, scheduler: Scheduler, interval_s: float) -> None:
        super().__init__(self._failed)
        self._scheduler = scheduler
        self._interval_s = interval_s

    def _failed(self, exc: BaseException) -> None:  # pragma: no cover - refresh never raises
        log.error("broker discovery stopped: %r", exc)

    async def _run(self) -> None:
        while True:
            # while no broker is known (a service started before its brokers), look every
            # second, so that the first delayed messages are not late by a whole interval
            idle = not self._scheduler.workers
            await asyncio.sleep(
                min(self._interval_s, EMPTY_REFRESH_S) if idle else self._interval_s
            )
            await self._scheduler.refresh()


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
