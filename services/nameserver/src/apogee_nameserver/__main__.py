"""``python -m apogee_nameserver``: settings from flags, file and environment; run until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from apogee.common.errors import InvalidArgumentError
from apogee.common.logs import configure_logging
from apogee.rpc.server import run_until_signal
from apogee_nameserver.app import NameServerApp
from apogee_nameserver.settings import NameServerSettings, load_settings

log = logging.getLogger("apogee_nameserver")


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


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up
    except ImportError:
        return None
    return uvloop.new_event_loop


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

    async def start() -> None:
        await app.start()

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(run_until_signal(start, app.stop))
    except OSError as err:
        log.error("nameserver could not start: %s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
