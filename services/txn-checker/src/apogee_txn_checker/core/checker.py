"""The checker: one :class:`~apogee.common.workers.BrokerWorker` per live broker.

The broker list comes from the nameservers' cluster info
(:class:`~apogee.rpc.directory.NameServerDirectory`), read at start and then every
``broker_refresh_s`` (every second while none is known);
:class:`~apogee.common.workers.BrokerWorkers` matches the workers to it: a new broker gets a
worker, a broker gone from every nameserver has its worker stopped (its round cut and what it
processed committed), a broker that moved is served again at its new address. When no
nameserver answers, the current brokers are kept. Every worker shares one
:class:`~.ratelimit.GroupLimiter`: a producer group's rate limit holds over all brokers.
"""

from __future__ import annotations

import asyncio
import logging
import random

from apogee.common.clock import Clock
from apogee.common.errors import ApogeeError
from apogee.common.loops import BackgroundLoop
from apogee.common.workers import BrokerWorker, BrokerWorkers
from apogee.rpc.directory import NameServerDirectory
from apogee_txn_checker.core.client import BrokerTransactionClient
from apogee_txn_checker.core.ratelimit import GroupLimiter
from apogee_txn_checker.core.session import BrokerSession, ClientFactory, broker_worker
from apogee_txn_checker.core.stats import CheckerStats
from apogee_txn_checker.settings import TxnCheckerSettings

log = logging.getLogger(__name__)

#: How often the broker list is read while it is empty.
EMPTY_REFRESH_S = 1.0


class Checker:
    """``await start()`` finds the brokers and checks them; ``await stop()`` stops every
    worker (each commits what its round processed), bounded by ``shutdown_grace_s``."""

    def __init__(
        self,
        settings: TxnCheckerSettings,
        clock: Clock,
        stats: CheckerStats,
        client_factory: ClientFactory | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.stats = stats
        self.rng = rng or random.Random()
        timeout = settings.rpc_timeout_s
        self._factory: ClientFactory = client_factory or (
            lambda address: BrokerTransactionClient(address, timeout)
        )
        self.limiter = GroupLimiter(
            settings.checks_per_group_per_s,
            settings.check_burst,
            clock,
            self.rng,
            jitter_s=settings.jitter_ms / 1000,
        )
        self._directory: NameServerDirectory | None = None
        self._workers: BrokerWorkers[BrokerSession] = BrokerWorkers(
            self._new_worker, settings.shutdown_grace_s
        )
        self._discovery: Discovery | None = None
        self._nameservers_down = False

    @property
    def workers(self) -> dict[str, BrokerWorker[BrokerSession]]:
        """Broker -> its worker."""
        return self._workers.workers

    def _new_worker(self, broker: str, address: str) -> BrokerWorker[BrokerSession]:
        return broker_worker(
            broker,
            address,
            self.settings,
            self.clock,
            self.stats,
            self.limiter,
            self.rng,
            self._factory,
        )

    async def start(self) -> None:
        self._directory = NameServerDirectory(
            self.settings.nameservers, self.settings.rpc_timeout_s
        )
        await self.refresh()
        self._discovery = Discovery(self, self.settings.broker_refresh_s)
        self._discovery.start()

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
            self._discovery = None
        await self._workers.stop()
        if self._directory is not None:
            await self._directory.close()
            self._directory = None


class Discovery(BackgroundLoop):
    name = "broker discovery"

    def __init__(self, checker: Checker, interval_s: float) -> None:
        super().__init__(self._failed)
        self._checker = checker
        self._interval_s = interval_s

    def _failed(self, exc: BaseException) -> None:  # pragma: no cover - refresh never raises
        log.error("broker discovery stopped: %r", exc)

    async def _run(self) -> None:
        while True:
            idle = not self._checker.workers
            await asyncio.sleep(
                min(self._interval_s, EMPTY_REFRESH_S) if idle else self._interval_s
            )
            await self._checker.refresh()
