"""``python -m apogee_broker``: run one broker until SIGTERM or SIGINT.

Settings come from defaults, ``--config FILE`` (TOML), ``APOGEE_BROKER_*`` environment variables
and the flags below, each winning over the one before. Logs go to stdout, one line per record.
Exit status: 0 after a graceful stop, 2 for bad settings, 1 when the broker cannot start.
Traces are exported when the OTEL_* environment asks for it (docs/tracing.md). With
``replication`` set the process is one replica of a group (docs/replication.md): it serves as
the broker while it leads, and copies the leader otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from apogee.common import tracing
from apogee.common.errors import ApogeeError
from apogee.common.logs import configure_logging
from apogee.rpc.server import run_until_signal
from apogee_broker.app import BrokerApp
from apogee_broker.replication.node import ReplicaNode
from apogee_broker.settings import BrokerSettings, load_settings

log = logging.getLogger("apogee_broker")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="apogee-broker", description="Run an Apogee broker.")
    p.add_argument("--config", type=Path, help="TOML settings file ([broker] table or top level)")
    p.add_argument("--listen", help="host:port to bind (port 0: any free port)")
    p.add_argument("--data-dir", type=Path, help="directory of the store and topics.json")
    p.add_argument("--name", help="broker name")
    p.add_argument("--namesrv", help="nameservers, host:port separated by ';'")
    p.add_argument("--advertised-address", help="host:port clients reach this broker at")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = load_settings(
            args.config,
            listen=args.listen,
            data_dir=args.data_dir,
            broker_name=args.name,
            namesrv=args.namesrv,
            advertised_address=args.advertised_address,
            log_level=args.log_level,
        )
    except ApogeeError as err:
        print(f"apogee-broker: bad settings: {err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    tracing.configure("apogee-broker")
    try:
        _run(settings)
    except (ApogeeError, OSError, RuntimeError) as err:  # RuntimeError: gRPC cannot bind
        log.error("broker %s cannot start: %s", settings.broker_name, err)
        return 1
    return 0


def _run(settings: BrokerSettings) -> None:
    app: BrokerApp | ReplicaNode = (
        ReplicaNode(settings) if settings.replicated else BrokerApp(settings)
    )

    async def start() -> None:
        await app.start()

    async def serve() -> None:
        await run_until_signal(start, app.stop)

    try:
        import uvloop  # noqa: PLC0415 - optional: images may run without it
    except ImportError:
        asyncio.run(serve())
    else:
        uvloop.run(serve())


if __name__ == "__main__":
    sys.exit(main())
