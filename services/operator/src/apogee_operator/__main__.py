"""``python -m apogee_operator``: reconcile Topic and ConsumerGroup resources until SIGTERM.

Settings come from defaults, ``--config FILE`` (TOML), ``APOGEE_OPERATOR_*`` environment
variables and the flags below, each winning over the one before. Logs go to stdout, one line
per record. Exit status: 0 after a graceful stop, 2 for bad settings, 1 when the service cannot
start (the health port is taken, the Lease cannot be used).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from apogee.rpc.leader_app import add_leader_flags
from apogee.rpc.process import run_service, service_parser
from apogee_operator.app import OperatorApp
from apogee_operator.settings import load_settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = service_parser(
        "apogee-operator",
        "Apogee operator: keeps the brokers in line with the apogee.io Topic and ConsumerGroup "
        "resources. Settings: defaults < --config file < APOGEE_OPERATOR_* environment < these "
        "flags.",
        lambda p: add_leader_flags(p, listen="127.0.0.1:9702"),
    )
    return run_service(parser, load_settings, OperatorApp, "operator", argv)


if __name__ == "__main__":
    sys.exit(main())
