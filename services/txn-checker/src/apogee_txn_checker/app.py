"""Wiring: the health server, leadership, and the checker while this replica leads.

Start: serve grpc.health.v1 (overall NOT_SERVING until active; ``apogee.txn_checker.Process``
SERVING while the process runs), make a first attempt at the lock (an unusable lock file fails
the start), then in the background wait for leadership (a standby says so in the log), start
the checker and go SERVING. Stop, bounded: each broker's round in progress is cut and what it
processed is committed, the lock is released (a standby takes over), the server stops. The
replica's life is :class:`apogee.service.leader_app.LeaderApp`'s.
"""

from __future__ import annotations

import logging
from typing import Final

from prometheus_client.registry import Collector

from apogee.common import tracing
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.service.leader_app import LeaderApp
from apogee.service.leadership import Leadership
from apogee_txn_checker.core.checker import Checker
from apogee_txn_checker.core.session import ClientFactory
from apogee_txn_checker.core.stats import CheckerStats
from apogee_txn_checker.metrics import CheckerCollector
from apogee_txn_checker.settings import TxnCheckerSettings

log = logging.getLogger(__name__)

#: Health service that is SERVING while the process runs, active or standby (liveness).
PROCESS_HEALTH: Final = "apogee.txn_checker.Process"


class TxnCheckerApp(LeaderApp[TxnCheckerSettings, Checker]):
    """One replica of the transaction checker: ``port = await app.start()``,
    ``await app.stop()``.

    ``stats`` holds the counters (rounds, checks by outcome, ...) of this process; ``active``
    says whether this replica leads (exported as the gauge ``apogee_txn_checker_leader``)."""

    name = "txn-checker"
    title = "the transaction checker"
    process_health = PROCESS_HEALTH
    leader_help = (
        "1 while this replica is the active one (holds the leadership and checks), 0 on a standby."
    )

    def __init__(
        self,
        settings: TxnCheckerSettings,
        clock: Clock = SYSTEM_CLOCK,
        leadership: Leadership | None = None,
        client_factory: ClientFactory | None = None,
    ) -> None:
        super().__init__(settings, clock, leadership)
        self.stats = CheckerStats()
        self._client_factory = client_factory

    @property
    def checker(self) -> Checker | None:
        """The checker while this replica leads."""
        return self.work

    def _new_work(self) -> Checker:
        return Checker(
            self.settings,
            self.clock,
            self.stats,
            self._client_factory,
            tracer=tracing.service_tracer("apogee.txn_checker"),
        )

    def _log_active(self, work: Checker) -> None:
        s = self.settings
        log.info(
            "active: checking the transactions of %d brokers (every %gs, immunity %gs, %d "
            "checks at most, %g checks/s per producer group)",
            len(work.workers),
            s.check_interval_s,
            s.immunity_s,
            s.max_check_times,
            s.checks_per_group_per_s,
        )

    def _collectors(self) -> list[Collector]:
        return [CheckerCollector(self.stats)]

    def _log_stopped(self) -> None:
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
