"""``python -m apogee_nameserver``: settings from flags, file and environment; run until SIGTERM."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from apogee.service.process import run_service, service_parser
from apogee_nameserver.app import NameServerApp
from apogee_nameserver.settings import load_settings


def _add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen", metavar="HOST:PORT", help="host:port to serve gRPC on (default 127.0.0.1:9876)"
    )
    parser.add_argument(
        "--broker-expiry-s", help="drop brokers silent for longer than this (default 120)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = service_parser(
        "apogee-nameserver",
        "Apogee nameserver: the route registry brokers register with. Settings: defaults < "
        "--config file < APOGEE_NAMESERVER_* environment < these flags.",
        _add_flags,
    )
    return run_service(parser, load_settings, NameServerApp, "nameserver", argv)


if __name__ == "__main__":
    sys.exit(main())
