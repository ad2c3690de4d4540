"""``python -m apogee_console``: serve the web console and its API until SIGTERM or SIGINT.

Settings come from defaults, ``--config FILE`` (TOML), ``APOGEE_CONSOLE_*`` environment
variables and the flags below, each winning over the one before. Logs go to stdout, one line
per record. Exit status: 0 after a graceful stop, 2 for bad settings, 1 when the console cannot
start (its port is taken, a TLS or users file is not usable).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from apogee.service.process import run_service, service_parser
from apogee_console.server import ConsoleServer
from apogee_console.settings import load_settings


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", metavar="HOST:PORT", help="address of the console (HTTP/HTTPS)")
    p.add_argument("--namesrv", metavar="A;B", help="the nameservers, host:port;host:port")
    p.add_argument(
        "--allowed-hosts",
        metavar="A,B",
        help="host names the console answers to besides the loopback ones, comma-separated",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = service_parser(
        "apogee-console",
        "Apogee console: the web console and REST API over the cluster. Settings: defaults < "
        "--config file < APOGEE_CONSOLE_* environment < these flags.",
        _flags,
    )
    return run_service(parser, load_settings, ConsoleServer, "console", argv)


if __name__ == "__main__":
    sys.exit(main())
