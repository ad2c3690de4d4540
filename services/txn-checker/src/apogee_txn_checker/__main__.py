"""``python -m apogee_txn_checker``: check undecided transactions until SIGTERM or SIGINT.

Settings (defaults < ``--config FILE`` < ``APOGEE_TXN_CHECKER_*`` < the flags below), logs,
traces and the exit status are :func:`apogee.service.process.run_service`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from apogee.service.leader_app import leader_parser
from apogee.service.process import run_service
from apogee_txn_checker.app import TxnCheckerApp
from apogee_txn_checker.settings import load_settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = leader_parser(
        "apogee-txn-checker",
        "Apogee transaction checker: asks producers, through the brokers, what became of "
        "transactions left undecided. Settings: defaults < --config file < "
        "APOGEE_TXN_CHECKER_* environment < these flags.",
        listen="127.0.0.1:9701",
    )
    return run_service(
        parser, load_settings, TxnCheckerApp, "txn-checker", argv, tracing_name="apogee-txn-checker"
    )


if __name__ == "__main__":
    sys.exit(main())
