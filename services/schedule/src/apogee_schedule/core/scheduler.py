"""The scheduler: one :class:`~.session.BrokerWorker` per live broker.

The broker list comes from the nameservers' cluster info, read at start and then every
``broker_refresh_s``: a new broker gets a worker, a broker gone from every nameserver has its
worker stopped (progress committed when it still answers), a broker that moved to another
address is started again there. When no nameserver answers, the current brokers are kept.
Every ``REPORT_INTERVAL_S`` the deliveries since the last report are logged with their
lateness.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from apogee.common.clock import Clock
from apogee.common.errors import ApogeeError
from apogee.common.loops import BackgroundLoop
from apogee.rpc.directory import NameServerDirectory
from apogee_schedule.core.client import BrokerScheduleClient
from apogee_schedule.core.session import BrokerWorker, ClientFactory
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
        self.workers: dict[str, BrokerWorker] = {}
        self._discovery: Discovery | None = None
        self._reporter: Reporter | None = None
        self._nameservers_down = False

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
        grace = self.settings.shutdown_grace_s
        for name, worker in list(self.workers.items()):
            address = brokers.get(name)
            if address == worker.address:
                continue
            del self.workers[name]
            if address is None:
                log.info("broker %s left the cluster; its worker stops", name)
            else:
                log.info("broker %s moved from %s to %s", name, worker.address, address)
            await worker.stop(grace)
        for name, address in sorted(brokers.items()):
            if name not in self.workers:
                log.info("serving broker %s at %s", name, address)
                worker = BrokerWorker(
                    name, address, self.settings, self.clock, self.stats, self._factory
                )
                self.workers[name] = worker
                worker.start()

    async def stop(self) -> None:
        grace = self.settings.shutdown_grace_s
        if self._discovery is not None:
            await self._discovery.stop()
        if self._reporter is not None:
            await self._reporter.stop()
            self._reporter.report()
        workers = list(self.workers.values())
        self.workers.clear()
        if workers:
            stops = [asyncio.create_task(w.stop(grace)) for w in workers]
            _, slow = await asyncio.wait(stops, timeout=3 * grace + 5.0)
            for task in slow:
                task.cancel()
            if slow:
                log.warning("%d brokers' workers did not stop in time; cut", len(slow))
                await asyncio.wait(slow, timeout=1.0)
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
        if not delivered and now.parked == last.parked and now.dropped == last.dropped:
            return
        recent = sorted(list(s.lateness_ms)[-delivered:]) if delivered else [0]
        log.info(
            "delivered %d, parked %d, dropped %d since the last report; lateness p50 %d ms, "
            "p99 %d ms, max %d ms",
            delivered,
            now.parked - last.parked,
            now.dropped - last.dropped,
            recent[len(recent) // 2],
            recent[min(len(recent) - 1, int(0.99 * len(recent)))],
            recent[-1],
        )
