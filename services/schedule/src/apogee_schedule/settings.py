"""The schedule service's settings: defaults < config file < ``APOGEE_SCHEDULE_*`` < flags.

A config file holds the fields at top level or under a ``[schedule]`` table::

    [schedule]
    namesrv = "ns-0.apogee-ns:9876;ns-1.apogee-ns:9876"
    lock_file = "/var/run/apogee/schedule.lock"

What every leader-elected service's settings share (their descriptions, the checks) is
:mod:`apogee.service.leader_settings`'s; in Kubernetes, replicas share a Lease instead of a lock
file (``APOGEE_SCHEDULE_LEADERSHIP=lease``; docs/deployment.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from apogee.common.configdoc import render_class
from apogee.common.settings import SecuritySettings, doc, load, metrics_listen_doc
from apogee.service.leader_settings import (
    BROKER_REFRESH_DOC,
    LEADERSHIP_DOC,
    LEASE_DURATION_DOC,
    LEASE_IDENTITY_DOC,
    LEASE_NAMESPACE_DOC,
    LEASE_RENEW_DEADLINE_DOC,
    LEASE_RETRY_PERIOD_DOC,
    LOCK_FILE_DOC,
    LOCK_POLL_DOC,
    LOG_LEVEL_DOC,
    LeaderServiceSettings,
    LeadershipKind,
    Ranges,
    lease_name_doc,
    listen_doc,
    namesrv_doc,
)


@dataclass(frozen=True, slots=True)
class ScheduleSettings(LeaderServiceSettings, SecuritySettings):
    namesrv: str = doc("127.0.0.1:9876", namesrv_doc("the brokers any of them knows are served."))
    listen: str = doc("127.0.0.1:9700", listen_doc("apogee.schedule.Process"))
    metrics_listen: str = doc("127.0.0.1:9710", metrics_listen_doc(9700))
    leadership: LeadershipKind = doc(LeadershipKind.FILE, LEADERSHIP_DOC)
    lock_file: Path = doc(Path("./schedule.lock"), LOCK_FILE_DOC)
    lock_poll_s: float = doc(1.0, LOCK_POLL_DOC)
    lease_namespace: str = doc("", LEASE_NAMESPACE_DOC)
    lease_name: str = doc("apogee-schedule", lease_name_doc("schedule"))
    lease_identity: str = doc("", LEASE_IDENTITY_DOC)
    lease_duration_s: int = doc(15, LEASE_DURATION_DOC)
    lease_renew_deadline_s: float = doc(10.0, LEASE_RENEW_DEADLINE_DOC)
    lease_retry_period_s: float = doc(2.0, LEASE_RETRY_PERIOD_DOC)
    lead_ms: int = doc(
        2000,
        "How far ahead, in ms, delay-level queues are read: entries due within this window are "
        "held in memory and delivered at their exact time.",
    )
    scan_hold_ms: int = doc(
        500,
        "How long, in ms, a scan that finds nothing waits at the broker for a new entry (long "
        "polling). Also bounds how late a delay-level entry is noticed within its lead.",
    )
    max_batch: int = doc(512, "Most entries delivered or parked by one Resolve call.")
    progress_interval_s: float = doc(
        1.0,
        "How often, in seconds, progress (per queue, the first entry not yet resolved) is "
        "committed to each broker; also at stop. After a crash, what was resolved since is "
        "delivered again (at-least-once).",
    )
    broker_refresh_s: float = doc(10.0, BROKER_REFRESH_DOC)
    rpc_timeout_s: float = doc(
        5.0, "Deadline in seconds of one call to a broker or nameserver (a scan adds its hold)."
    )
    shutdown_grace_s: float = doc(
        5.0,
        "On SIGTERM, how long in seconds deliveries in flight and the final progress commit "
        "may take before they are cut.",
    )
    log_level: str = doc("INFO", LOG_LEVEL_DOC)

    #: (field, least, most): the range each of this service's own numeric settings must fall in.
    RANGES: ClassVar[Ranges] = (
        ("lead_ms", 50, 600_000),
        ("scan_hold_ms", 1, 15_000),
        ("max_batch", 1, 8192),
        ("progress_interval_s", 0.01, 3600.0),
    )


def load_settings(
    config_file: Path | None = None, env: Mapping[str, str] | None = None, **overrides: Any
) -> ScheduleSettings:
    """Defaults, then ``config_file``, then ``env`` (the process environment when None), then
    ``overrides`` (command-line flags; None means not given)."""
    return load(
        ScheduleSettings, "schedule", config_file, os.environ if env is None else env, **overrides
    )


def config_reference() -> str:
    """This service's section of docs/configuration.md."""
    return render_class(
        ScheduleSettings,
        "Schedule service (`apogee_schedule.settings.ScheduleSettings`)",
        "Delivers delayed and timer messages when they are due (see docs/schedule.md). In a "
        "config file, under `[schedule]`; in the environment, `APOGEE_SCHEDULE_<SETTING>` (for "
        "example `APOGEE_SCHEDULE_LEAD_MS=3000`); a few also as flags (`--namesrv`, `--listen`, "
        "`--lock-file`).",
    )
