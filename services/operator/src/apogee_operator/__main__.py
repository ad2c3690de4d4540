"""``python -m apogee_operator``: reconcile Topic and ConsumerGroup resources until SIGTERM.

Settings come from defaults, ``--config FILE`` (TOML), ``APOGEE_OPERATOR_*`` environment
variables and the flags below, each winning over the one before. Logs go to stdout, one line
per record. Exit status: 0 after a graceful stop, 2 for bad settings, 1 when the service cannot
start (the health port is taken, the Lease cannot be used).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from apogee.service.leader_app import leader_parser
from apogee.service.process import run_service
from apogee_operator.app import OperatorApp
from apogee_operator.settings import load_settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = leader_parser(
        "apogee-operator",
        "Apogee operator: keeps the brokers in line with the apogee.io Topic and ConsumerGroup "
        "resources. Settings: defaults < --config file < APOGEE_OPERATOR_* environment < these "
        "flags.",
        listen="127.0.0.1:9702",
    )
    return run_service(parser, load_settings, OperatorApp, "operator", argv)


if __name__ == "__main__":
    sys.exit(main())
