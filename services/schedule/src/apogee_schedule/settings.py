"""The schedule service's settings: defaults < config file < ``APOGEE_SCHEDULE_*`` < flags.

A config file holds the fields at top level or under a ``[schedule]`` table::

    [schedule]
    namesrv = "ns-0.apogee-ns:9876;ns-1.apogee-ns:9876"
    lock_file = "/var/run/apogee/schedule.lock"
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apogee.common.configdoc import render_class
from apogee.common.errors import InvalidArgumentError
from apogee.common.logs import check_log_level
from apogee.common.settings import check_address, doc, load, parse_nameservers

#: (field, least, most): the range each numeric setting must fall in.
_RANGES: tuple[tuple[str, float, float], ...] = (
    ("lock_poll_s", 0.01, 60.0),
    ("lead_ms", 50, 600_000),
    ("scan_hold_ms", 1, 15_000),
    ("max_batch", 1, 8192),
    ("progress_interval_s", 0.01, 3600.0),
    ("broker_refresh_s", 0.05, 3600.0),
    ("rpc_timeout_s", 0.1, 300.0),
    ("shutdown_grace_s", 0.0, 300.0),
)


@dataclass(frozen=True, slots=True)
class ScheduleSettings:
    namesrv: str = doc(
        "127.0.0.1:9876",
        "Nameservers the brokers are found through, `host:port` separated by `;`. Every one is "
        "asked; the brokers any of them knows are served.",
    )
    listen: str = doc(
        "0.0.0.0:9700",
        "host:port of the gRPC server, which serves only grpc.health.v1: the overall status is "
        "SERVING while this replica is the active one, NOT_SERVING while it is a standby; "
        "the service `apogee.schedule.Process` is SERVING while the process runs (for "
        "liveness probes). Port 0 picks a free port.",
    )
    lock_file: Path = doc(
        Path("./schedule.lock"),
        "File whose lock (flock) makes one replica the active one; the others wait as standbys "
        "and take over when it is released (the active replica stops or dies). Replicas "
        "sharing a broker cluster must share this file (the same machine or shared storage).",
    )
    lock_poll_s: float = doc(
        1.0, "How often, in seconds, a standby tries to take the lock; the takeover delay."
    )
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
    broker_refresh_s: float = doc(
        10.0, "How often, in seconds, the broker list is read again from the nameservers."
    )
    rpc_timeout_s: float = doc(
        5.0, "Deadline in seconds of one call to a broker or nameserver (a scan adds its hold)."
    )
    shutdown_grace_s: float = doc(
        5.0,
        "On SIGTERM, how long in seconds deliveries in flight and the final progress commit "
        "may take before they are cut.",
    )
    log_level: str = doc("INFO", "Log level: DEBUG, INFO, WARNING, ERROR or CRITICAL.")

    def __post_init__(self) -> None:
        nameservers = parse_nameservers(self.namesrv)
        if not nameservers:
            raise InvalidArgumentError(field="namesrv", rule="must name at least one host:port")
        check_address("listen", self.listen, allow_port_zero=True)
        if not str(self.lock_file).strip() or self.lock_file == Path("."):
            raise InvalidArgumentError(field="lock_file", rule="must be a file path")
        for name, least, most in _RANGES:
            value = getattr(self, name)
            if not least <= value <= most:
                raise InvalidArgumentError(
                    field=name, rule=f"must be between {least:g} and {most:g}, got {value}"
                )
        object.__setattr__(self, "log_level", check_log_level(self.log_level))

    @property
    def nameservers(self) -> list[str]:
        """The nameserver addresses of ``namesrv``, in order, without duplicates."""
        return parse_nameservers(self.namesrv)

    @property
    def log_level_number(self) -> int:
        return logging.getLevelNamesMapping()[self.log_level]


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
