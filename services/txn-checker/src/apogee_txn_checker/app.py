"""Wiring: the health server, leadership, and the checker while this replica leads.

Start: serve grpc.health.v1 (overall NOT_SERVING until active; ``apogee.txn_checker.Process``
SERVING while the process runs), make a first attempt at the lock (an unusable lock file fails
the start), then in the background wait for leadership (a standby says so in the log), start
the checker and go SERVING. Stop, bounded: each broker's round in progress is cut and what it
processed is committed, the lock is released (a standby takes over), the server stops.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from grpc_health.v1 import health_pb2

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.leadership import FileLockLeadership, Leadership
from apogee.rpc.server import GrpcServer
from apogee_txn_checker.core.checker import Checker
from apogee_txn_checker.core.session import ClientFactory
from apogee_txn_checker.core.stats import CheckerStats
from apogee_txn_checker.settings import TxnCheckerSettings

log = logging.getLogger(__name__)

#: Health service that is SERVING while the process runs, active or standby (liveness).
PROCESS_HEALTH: Final = "apogee.txn_checker.Process"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class TxnCheckerApp:
    """One replica of the transaction checker: ``port = await app.start()``,
    ``await app.stop()``.

    ``stats`` holds the counters (rounds, checks by outcome, ...) of this process; ``active``
    says whether this replica leads."""

    def __init__(
        self,
        settings: TxnCheckerSettings,
        clock: Clock = SYSTEM_CLOCK,
        leadership: Leadership | None = None,
        client_factory: ClientFactory | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.stats = CheckerStats()
        self.leadership = leadership or FileLockLeadership(settings.lock_file, settings.lock_poll_s)
        self.checker: Checker | None = None
        self.port = 0
        self._client_factory = client_factory
        self._server: GrpcServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._active = asyncio.Event()

    @property
    def active(self) -> bool:
        return self._active.is_set()

    async def wait_active(self) -> None:
        """Returns once this replica leads and its checker has started."""
        await self._active.wait()

    async def start(self) -> int:
        """Serve health and start leading (or waiting to); returns the bound port. Raises
        OSError when the address cannot be bound or the lock file cannot be opened."""
        if self._server is not None:
            raise RuntimeError("the transaction checker is already started")
        server = GrpcServer(self.settings.listen, "txn-checker")
        self.port = server.bind()
        await server.server.start()
        self._server = server
        await server.health.set("", NOT_SERVING)
        await server.health.set(PROCESS_HEALTH, SERVING)
        log.info("txn-checker health service listening on port %d", self.port)
        try:
            await self.leadership.try_acquire()
        except BaseException:
            await self.stop()
            raise
        self._task = asyncio.create_task(self._lead(), name="leadership")
        self._task.add_done_callback(self._lead_ended)
        return self.port

    def _lead_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("leadership failed: %r", task.exception())

    async def _lead(self) -> None:
        while True:
            await self.leadership.acquire()
            await self._activate()
            await self.leadership.wait_lost()
            log.warning("leadership lost: this replica becomes a standby")
            await self._deactivate()

    async def _activate(self) -> None:
        assert self._server is not None
        self.checker = Checker(self.settings, self.clock, self.stats, self._client_factory)
        await self.checker.start()
        await self._server.health.set("", SERVING)
        self._active.set()
        s = self.settings
        log.info(
            "active: checking the transactions of %d brokers (every %gs, immunity %gs, %d "
            "checks at most, %g checks/s per producer group)",
            len(self.checker.workers),
            s.check_interval_s,
            s.immunity_s,
            s.max_check_times,
            s.checks_per_group_per_s,
        )

    async def _deactivate(self) -> None:
        self._active.clear()
        if self._server is not None:
            await self._server.health.set("", NOT_SERVING)
        checker, self.checker = self.checker, None
        if checker is not None:
            await checker.stop()

    async def stop(self) -> None:
        """Stop gracefully (see the module docstring); safe to call twice."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=self.settings.shutdown_grace_s + 5.0)
        try:
            await self._deactivate()
        finally:
            await self.leadership.release()
            server, self._server = self._server, None
            if server is not None:
                await server.stop(min(1.0, self.settings.shutdown_grace_s))
                snap = self.stats.snapshot()
                log.info(
                    "txn-checker stopped: %d rounds, %d checks sent, %d with no producer, "
                    "%d decided, %d given up, %d closed, %d errors",
                    snap.rounds,
                    snap.checks_sent,
                    snap.no_producer,
                    snap.decided,
                    snap.gave_up,
                    snap.closed,
                    snap.errors,
                )
