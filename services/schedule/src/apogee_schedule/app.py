"""Wiring: the health server, leadership, and the scheduler while this replica leads.

Start: serve grpc.health.v1 (overall NOT_SERVING until active; ``apogee.schedule.Process``
SERVING while the process runs), make a first attempt at the lock (an unusable lock file fails
the start), then in the background wait for leadership (a standby says so in the log), start
the scheduler and go SERVING. Stop, bounded: the scheduler's workers let deliveries in flight
finish and commit their progress, the lock is released (a standby takes over), the server
stops. The replica's life is :class:`apogee.service.leader_app.LeaderApp`'s.
"""

from __future__ import annotations

import logging
from typing import Final

from prometheus_client.registry import Collector

from apogee.common import tracing
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.service.leader_app import LeaderApp
from apogee.service.leadership import Leadership
from apogee_schedule.core.scheduler import Scheduler
from apogee_schedule.core.stats import ScheduleStats
from apogee_schedule.metrics import ScheduleCollector
from apogee_schedule.settings import ScheduleSettings

log = logging.getLogger(__name__)

#: Health service that is SERVING while the process runs, active or standby (liveness).
PROCESS_HEALTH: Final = "apogee.schedule.Process"


class ScheduleApp(LeaderApp[ScheduleSettings, Scheduler]):
    """One replica of the schedule service: ``port = await app.start()``, ``await app.stop()``.

    ``stats`` holds the counters (deliveries, lateness, ...) of this process; ``active`` says
    whether this replica leads (exported as the gauge ``apogee_schedule_leader``)."""

    name = "schedule"
    title = "the schedule service"
    process_health = PROCESS_HEALTH
    leader_help = (
        "1 while this replica is the active one (holds the leadership and delivers), 0 on a "
        "standby."
    )

    def __init__(
        self,
        settings: ScheduleSettings,
        clock: Clock = SYSTEM_CLOCK,
        leadership: Leadership | None = None,
    ) -> None:
        super().__init__(settings, clock, leadership)
        self.stats = ScheduleStats()

    @property
    def scheduler(self) -> Scheduler | None:
        """The scheduler while this replica leads."""
        return self.work

    def _new_work(self) -> Scheduler:
        return Scheduler(
            self.settings, self.clock, self.stats, tracer=tracing.service_tracer("apogee.schedule")
        )

    def _log_active(self, work: Scheduler) -> None:
        log.info(
            "active: delivering delayed and timer messages of %d brokers (lead %d ms)",
            len(work.workers),
            self.settings.lead_ms,
        )

    def _collectors(self) -> list[Collector]:
        return [ScheduleCollector(self.stats)]

    def _log_stopped(self) -> None:
        snap = self.stats.snapshot()
        log.info(
            "schedule service stopped: delivered %d, parked %d, dropped %d",
            snap.delivered,
            snap.parked,
            snap.dropped,
        )
