"""``python -m apogee_schedule``: deliver delayed and timer messages until SIGTERM or SIGINT.

Settings come from defaults, ``--config FILE`` (TOML), ``APOGEE_SCHEDULE_*`` environment
variables and the flags below, each winning over the one before. Logs go to stdout, one line
per record. Exit status: 0 after a graceful stop, 2 for bad settings, 1 when the service cannot
start (the health port is taken, the lock file cannot be opened).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from apogee.common.errors import InvalidArgumentError
from apogee.common.logs import configure_logging
from apogee.rpc.server import serve_process
from apogee_schedule.app import ScheduleApp
from apogee_schedule.settings import ScheduleSettings, load_settings


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="apogee-schedule",
        description="Apogee schedule service: delivers delayed and timer messages when they "
        "are due. Settings: defaults < --config file < APOGEE_SCHEDULE_* environment < these "
        "flags.",
    )
    parser.add_argument("--config", type=Path, metavar="PATH", help="a TOML file of settings")
    parser.add_argument("--namesrv", help="nameservers, host:port separated by ';'")
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="host:port of the health service (default 0.0.0.0:9700)",
    )
    parser.add_argument(
        "--lock-file", type=Path, metavar="PATH", help="the lock that makes one replica active"
    )
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings: ScheduleSettings = load_settings(
            args.config,
            namesrv=args.namesrv,
            listen=args.listen,
            lock_file=args.lock_file,
            log_level=args.log_level,
        )
    except InvalidArgumentError as err:
        print(f"apogee-schedule: {err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level_number)
    app = ScheduleApp(settings)
    return serve_process("schedule service", app.start, app.stop)


if __name__ == "__main__":
    sys.exit(main())
