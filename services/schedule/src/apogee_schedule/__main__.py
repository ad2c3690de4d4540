"""``python -m apogee_schedule``: deliver delayed and timer messages until SIGTERM or SIGINT.

Settings come from defaults, ``--config FILE`` (TOML), ``APOGEE_SCHEDULE_*`` environment
variables and the flags below, each winning over the one before. Logs go to stdout, one line
per record. Exit status: 0 after a graceful stop, 2 for bad settings, 1 when the service cannot
start (the health port is taken, the lock file cannot be opened). Traces are exported when the
OTEL_* environment asks for it (docs/tracing.md).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from apogee.common import tracing
from apogee.rpc.leader_app import add_leader_flags
from apogee.rpc.process import run_service, service_parser
from apogee_schedule.app import ScheduleApp
from apogee_schedule.settings import ScheduleSettings, load_settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = service_parser(
        "apogee-schedule",
        "Apogee schedule service: delivers delayed and timer messages when they are due. "
        "Settings: defaults < --config file < APOGEE_SCHEDULE_* environment < these flags.",
        lambda p: add_leader_flags(p, listen="127.0.0.1:9700"),
    )
    return run_service(parser, load_settings, _new_app, "schedule service", argv)


def _new_app(settings: ScheduleSettings) -> ScheduleApp:
    tracing.configure("apogee-schedule")  # once logging is set up: it logs what it did
    return ScheduleApp(settings)


if __name__ == "__main__":
    sys.exit(main())
