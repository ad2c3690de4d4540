"""``python -m apogee_nameserver``: settings from flags, file and environment; run until SIGTERM."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from apogee.common.errors import InvalidArgumentError
from apogee.common.logs import configure_logging
from apogee.rpc.server import serve_process
from apogee_nameserver.app import NameServerApp
from apogee_nameserver.settings import NameServerSettings, load_settings


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="apogee-nameserver",
        description="Apogee nameserver: the route registry brokers register with. Settings: "
        "defaults < --config file < APOGEE_NAMESERVER_* environment < these flags.",
    )
    parser.add_argument("--config", type=Path, metavar="PATH", help="a TOML file of settings")
    parser.add_argument(
        "--listen", metavar="HOST:PORT", help="host:port to serve gRPC on (default 0.0.0.0:9876)"
    )
    parser.add_argument(
        "--broker-expiry-s", help="drop brokers silent for longer than this (default 120)"
    )
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings: NameServerSettings = load_settings(
            args.config,
            listen=args.listen,
            broker_expiry_s=args.broker_expiry_s,
            log_level=args.log_level,
        )
    except InvalidArgumentError as err:
        print(f"apogee-nameserver: {err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level_number)
    app = NameServerApp(settings)
    return serve_process("nameserver", app.start, app.stop)


if __name__ == "__main__":
    sys.exit(main())
