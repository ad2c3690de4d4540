"""The checker: one :class:`~apogee.service.workers.BrokerWorker` per live broker.

The broker list comes from the nameservers' cluster info, read at start and then every
``broker_refresh_s`` (every second while none is known);
:class:`~apogee.service.directory.DirectoryWorkers` matches the workers to it: a new broker gets a
worker, a broker gone from every nameserver has its worker stopped (its round cut and what it
processed committed), a broker that moved is served again at its new address. When no
nameserver answers, the current brokers are kept. Every worker shares one
:class:`~.ratelimit.GroupLimiter`: a producer group's rate limit holds over all brokers.
"""

from __future__ import annotations

import logging
import random

from opentelemetry.trace import Tracer

from apogee.common.clock import Clock
from apogee.service.directory import DirectoryWorkers
from apogee.service.workers import BrokerWorker
from apogee_txn_checker.core.client import BrokerTransactionClient
from apogee_txn_checker.core.ratelimit import GroupLimiter
from apogee_txn_checker.core.session import BrokerSession, ClientFactory, broker_worker
from apogee_txn_checker.core.stats import CheckerStats
from apogee_txn_checker.settings import TxnCheckerSettings

log = logging.getLogger(__name__)


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
        tracer: Tracer | None = None,
    ) -> None:
        """``tracer``: the checker's, when it traces (see :mod:`.spans`)."""
        self.settings = settings
        self.tracer = tracer
        self.clock = clock
        self.stats = stats
        self.rng = rng or random.Random()
        self._factory: ClientFactory = client_factory or BrokerTransactionClient.factory(settings)
        self.limiter = GroupLimiter(
            settings.checks_per_group_per_s,
            settings.check_burst,
            clock,
            self.rng,
            jitter_s=settings.jitter_ms / 1000,
        )
        self._brokers = DirectoryWorkers.from_settings(settings, self._new_worker, log)

    @property
    def workers(self) -> dict[str, BrokerWorker[BrokerSession]]:
        """Broker -> its worker."""
        return self._brokers.workers

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
            tracer=self.tracer,
        )

    async def start(self) -> None:
        await self._brokers.start()

    async def stop(self) -> None:
        await self._brokers.stop()
