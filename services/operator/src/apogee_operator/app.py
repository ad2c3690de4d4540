"""Wiring: the health server, leadership, and the controller while this replica leads.

Start: serve grpc.health.v1 (overall NOT_SERVING until active; ``apogee.operator.Process``
SERVING while the process runs), make a first attempt at the Lease (or lock), then in the
background wait for leadership, start the controller and go SERVING. Stop, bounded: the
controller lets a reconcile in flight finish, the Lease is released (a standby takes over at
once), the server stops. The replica's life is :class:`apogee.service.leader_app.LeaderApp`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

from prometheus_client.registry import Collector

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.service.leader_app import LeaderApp
from apogee.service.leadership import Leadership
from apogee_operator.core.controller import Controller
from apogee_operator.core.stats import OperatorStats
from apogee_operator.metrics import OperatorCollector
from apogee_operator.settings import OperatorSettings

log = logging.getLogger(__name__)

#: Health service that is SERVING while the process runs, active or standby (liveness).
PROCESS_HEALTH: Final = "apogee.operator.Process"


class OperatorApp(LeaderApp[OperatorSettings, Controller]):
    """One replica of the operator: ``port = await app.start()``, ``await app.stop()``.
    ``api_client_factory`` builds the Kubernetes client of the controller (default: the pod's
    service account, else the kubeconfig)."""

    name = "operator"
    title = "the operator"
    process_health = PROCESS_HEALTH
    leader_help = "1 while this replica is the active one (holds the Lease), else 0."

    def __init__(
        self,
        settings: OperatorSettings,
        clock: Clock = SYSTEM_CLOCK,
        leadership: Leadership | None = None,
        api_client_factory: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(settings, clock, leadership)
        self.stats = OperatorStats()
        self.api_client_factory = api_client_factory

    @property
    def controller(self) -> Controller | None:
        """The controller while this replica leads."""
        return self.work

    def _new_work(self) -> Controller:
        return Controller(self.settings, self.stats, self.api_client_factory)

    def _log_active(self, work: Controller) -> None:
        log.info("active: reconciling every %.0fs and on every change", self.settings.resync_s)

    def _collectors(self) -> list[Collector]:
        return [OperatorCollector(self.stats)]

    def _log_stopped(self) -> None:
        total = sum(self.stats.reconciles.values())
        log.info("operator stopped after %d reconciles", total)
