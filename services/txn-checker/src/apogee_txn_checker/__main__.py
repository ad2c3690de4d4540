"""``python -m apogee_txn_checker``: check undecided transactions until SIGTERM or SIGINT.

Settings come from defaults, ``--config FILE`` (TOML), ``APOGEE_TXN_CHECKER_*`` environment
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
from apogee_txn_checker.app import TxnCheckerApp
from apogee_txn_checker.settings import TxnCheckerSettings, load_settings


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="apogee-txn-checker",
        description="Apogee transaction checker: asks producers, through the brokers, what "
        "became of transactions left undecided. Settings: defaults < --config file < "
        "APOGEE_TXN_CHECKER_* environment < these flags.",
    )
    parser.add_argument("--config", type=Path, metavar="PATH", help="a TOML file of settings")
    parser.add_argument("--namesrv", help="nameservers, host:port separated by ';'")
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="host:port of the health service (default 0.0.0.0:9701)",
    )
    parser.add_argument(
        "--lock-file", type=Path, metavar="PATH", help="the lock that makes one replica active"
    )
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings: TxnCheckerSettings = load_settings(
            args.config,
            namesrv=args.namesrv,
            listen=args.listen,
            lock_file=args.lock_file,
            log_level=args.log_level,
        )
    except InvalidArgumentError as err:
        print(f"apogee-txn-checker: {err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level_number)
    app = TxnCheckerApp(settings)
    return serve_process("txn-checker", app.start, app.stop)


if __name__ == "__main__":
    sys.exit(main())
