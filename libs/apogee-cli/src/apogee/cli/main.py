"""The ``apogee`` command.

    apogee cluster up [--data DIR] [--brokers N] [--nameservers N] [--flush sync|async]
                      [--no-console] [--monitoring [--scrape-interval S] [--prometheus-port PORT]]
    apogee cluster status | down [--data DIR]
    apogee top [--metrics HOST:PORT]... [--interval S] [--once]
    apogee topic create|update NAME [--queues N] [--perm rw|r|w] [--broker NAME]...
    apogee topic delete NAME | list | describe NAME
    apogee send TOPIC [--tag T] [--key K]... [--property k=v]...
                [--delay-level N | --deliver-in S | --deliver-at TIME] [BODY]
    apogee message get ID
    apogee message query --topic T [--key K] [--begin TIME] [--end TIME] [--max N]
    apogee consume TOPIC --group G [--tag EXPR] [--count N] [--timeout S] [--from earliest|latest]
    apogee group list | describe GROUP
    apogee group reset-offset GROUP --topic T (--to earliest|latest|TIME | --timestamp MS)
    apogee dlq list --group G [--filter key=K] [--since TIME|SECONDS] [--limit N]
    apogee dlq redrive --group G [--filter key=K] [--since TIME|SECONDS] [--rate N/s] [--dry-run]
    apogee txn list [--group G] [--topic T] [--max N]
    apogee txn resolve ID (--commit | --rollback)

Nameservers come from ``--namesrv`` or ``APOGEE_NAMESRV`` (``host:port;host:port``), else from the
local cluster's state (``--data``, default ``$APOGEE_HOME/local``). Errors print one line naming
what went wrong and exit with status 1 (2 for a usage error); never a traceback, unless
``APOGEE_DEBUG`` is set and the error is not one the command expected.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from apogee.cli import (
    commands,
    consume,
    dlq,
    groups,
    local_cluster,
    prometheus,
    top,
    txn,
    webconsole,
)
from apogee.cli.common import UsageError, data_dir, run_async, time_text
from apogee.client.admin import AdminClient, LastRecovery
from apogee.common.errors import ApogeeError


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse cannot take `send TOPIC --tag T BODY` (a positional after options) by itself
    if args.command == "send" and args.body is None and len(extra) == 1 and extra[0][:1] != "-":
        args.body, extra = extra[0], []
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        result: int = args.run(args, sys.stdout)
        return result
    except BrokenPipeError:  # `apogee ... | head`: the reader has gone, which is fine
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return 0
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        print(f"apogee: error: {exc}", file=sys.stderr)
        return 2
    except (ApogeeError, local_cluster.ClusterError) as exc:
        print(f"apogee: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: still one line, the traceback only when asked for
        if os.environ.get("APOGEE_DEBUG"):
            traceback.print_exc()
        print(
            f"apogee: unexpected error ({type(exc).__name__}: {exc}); "
            "set APOGEE_DEBUG=1 for the traceback",
            file=sys.stderr,
        )
        return 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="apogee", description="Apogee message queue command line")
    p.add_argument("--namesrv", help="nameservers, host:port;host:port (or APOGEE_NAMESRV)")
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="the local cluster's folder (default $APOGEE_HOME/local, ~/.apogee/local)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cluster = sub.add_parser("cluster", help="run a local cluster").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    c_up = cluster.add_parser("up", help="start nameservers and brokers (harmless if running)")
    c_up.add_argument("--brokers", type=int, default=1)
    c_up.add_argument("--nameservers", type=int, default=1)
    c_up.add_argument("--flush", choices=["async", "sync"], default="async")
    c_up.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for health")
    c_up.add_argument(
        "--no-console",
        action="store_true",
        help="do not start the web console (a running one is left alone)",
    )
    c_up.add_argument(
        "--monitoring",
        action="store_true",
        help="run Prometheus too, scraping every member (needs Debian's prometheus package)",
    )
    c_up.add_argument(
        "--scrape-interval",
        type=float,
        default=prometheus.DEFAULT_SCRAPE_INTERVAL_S,
        metavar="SECONDS",
        help="with --monitoring: seconds between scrapes "
        f"(default {prometheus.DEFAULT_SCRAPE_INTERVAL_S:g})",
    )
    c_up.add_argument(
        "--prometheus-port",
        type=int,
        default=local_cluster.PROMETHEUS_PORT,
        metavar="PORT",
        help=f"with --monitoring: Prometheus's port, or the next free one "
        f"(default {local_cluster.PROMETHEUS_PORT})",
    )
    c_up.set_defaults(run=cmd_cluster_up)
    cluster.add_parser("status", help="health of each member").set_defaults(run=cmd_cluster_status)
    cluster.add_parser("down", help="stop the cluster, keep its data").set_defaults(
        run=cmd_cluster_down
    )

    commands.add_commands(sub)
    consume.add_consume_command(sub)
    groups.add_commands(sub)
    dlq.add_commands(sub)
    txn.add_commands(sub)
    top.add_command(sub)
    return p


def cmd_cluster_up(args: argparse.Namespace, out: TextIO) -> int:
    if args.brokers < 1 or args.nameservers < 1:
        raise UsageError("--brokers and --nameservers must be at least 1")
    if not args.scrape_interval >= 0.001:  # NaN too
        raise UsageError(f"--scrape-interval {args.scrape_interval}: must be at least 0.001 s")
    if not 0 < args.prometheus_port < 65536:
        raise UsageError(f"--prometheus-port {args.prometheus_port}: must be from 1 to 65535")
    state = local_cluster.up(
        data_dir(args),
        brokers=args.brokers,
        nameservers=args.nameservers,
        flush_mode=args.flush,
        timeout=args.timeout,
        console=not args.no_console,
        monitoring=args.monitoring,
        scrape_interval_s=args.scrape_interval,
        prometheus_port=args.prometheus_port,
    )
    print(f"cluster up (data in {state.data_dir})", file=out)
    for p in state.all():
        print(f"  {p.role:<11} {p.name:<14} {p.address:<18} pid {p.pid:<8} log {p.log}", file=out)
        if p.metrics:
            print(f"  {'':11} metrics http://{p.metrics}/metrics", file=out)
        if p.role == local_cluster.PROMETHEUS:
            print(f"  {'':11} prometheus http://{p.address}", file=out)
    print(f"namesrv: {state.namesrv}", file=out)
    for p in state.console:
        print(f"console: {webconsole.url(p.address, p.env)}", file=out)
    if not state.console and not args.no_console and not webconsole.available():
        print("console: not started (apogee_console is not installed)", file=out)
    print(f'try: export APOGEE_NAMESRV="{state.namesrv}"', file=out)
    return 0


def cmd_cluster_status(args: argparse.Namespace, out: TextIO) -> int:
    state = local_cluster.ClusterState.load(data_dir(args).resolve())
    if state is None:
        print(f"no local cluster recorded in {data_dir(args)}", file=out)
        return 1
    bad = 0
    recoveries = _last_recoveries(state.namesrv)
    for p, alive, healthy in local_cluster.status(state):
        word = "SERVING" if healthy else ("NOT SERVING" if alive else "STOPPED")
        bad += not healthy
        print(f"{p.role:<11} {p.name:<14} {p.address:<18} pid {p.pid:<8} {word}", file=out)
        if p.role == "broker" and healthy:
            print(f"{'':11} {recoveries.get(p.name, 'last recovery: not known')}", file=out)
        if p.metrics:
            print(f"{'':11} metrics http://{p.metrics}/metrics", file=out)
        if p.role == local_cluster.PROMETHEUS:
            print(f"{'':11} prometheus http://{p.address}", file=out)
        if p.role == local_cluster.CONSOLE:
            print(f"{'':11} console {webconsole.url(p.address, p.env)}", file=out)
    return 1 if bad else 0


def _last_recoveries(namesrv: str) -> dict[str, str]:
    """Each live broker's last recovery as a line, by broker name ({} when nobody answers:
    the health lines say why)."""

    async def ask() -> list[LastRecovery]:
        async with AdminClient(namesrv, timeout=5.0) as admin:
            return await admin.last_recoveries()

    try:
        found: list[LastRecovery] = run_async(ask)
    except ApogeeError:
        return {}
    return {
        r.broker_name: (
            f"last recovery {time_text(r.finished_ms, 'seconds')}, after "
            f"{'a clean stop' if r.clean else 'a crash'}: {r.records_checked} records in "
            f"{r.files_checked} files checked, {r.bytes_truncated} bytes truncated, "
            f"{len(r.files_quarantined)} files quarantined, {r.entries_redispatched} entries "
            f"re-dispatched, {r.seconds:.3f} s"
        )
        for r in found
    }


def cmd_cluster_down(args: argparse.Namespace, out: TextIO) -> int:
    stopped = local_cluster.down(data_dir(args))
    if not stopped:
        print(f"no local cluster recorded in {data_dir(args)}", file=out)
        return 0
    for p, how in stopped:
        print(f"{p.role:<11} {p.name:<14} {how}", file=out)
    print(f"data kept in {data_dir(args).resolve()}", file=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
