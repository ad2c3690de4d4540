"""``python -m apogee_txn_checker``: check undecided transactions until SIGTERM or SIGINT.

Settings come from defaults, ``--config FILE`` (TOML), ``APOGEE_TXN_CHECKER_*`` environment
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
from apogee_txn_checker.app import TxnCheckerApp
from apogee_txn_checker.settings import TxnCheckerSettings, load_settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = service_parser(
        "apogee-txn-checker",
        "Apogee transaction checker: asks producers, through the brokers, what became of "
        "transactions left undecided. Settings: defaults < --config file < "
        "APOGEE_TXN_CHECKER_* environment < these flags.",
        lambda p: add_leader_flags(p, listen="127.0.0.1:9701"),
    )
    return run_service(parser, load_settings, _new_app, "txn-checker", argv)


def _new_app(settings: TxnCheckerSettings) -> TxnCheckerApp:
    tracing.configure("apogee-txn-checker")  # once logging is set up: it logs what it did
    return TxnCheckerApp(settings)


if __name__ == "__main__":
    sys.exit(main())
