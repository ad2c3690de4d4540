"""``python -m apogee_schedule``: deliver delayed and timer messages until SIGTERM or SIGINT.

Settings (defaults < ``--config FILE`` < ``APOGEE_SCHEDULE_*`` < the flags below), logs,
traces and the exit status are :func:`apogee.service.process.run_service`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from apogee.service.leader_app import leader_parser
from apogee.service.process import run_service
from apogee_schedule.app import ScheduleApp
from apogee_schedule.settings import load_settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = leader_parser(
        "apogee-schedule",
        "Apogee schedule service: delivers delayed and timer messages when they are due. "
        "Settings: defaults < --config file < APOGEE_SCHEDULE_* environment < these flags.",
        listen="127.0.0.1:9700",
    )
    return run_service(
        parser, load_settings, ScheduleApp, "schedule service", argv, tracing_name="apogee-schedule"
    )


if __name__ == "__main__":
    sys.exit(main())
