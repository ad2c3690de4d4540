"""``apogee cluster up | status | down``: the local cluster's subcommands of the ``apogee`` command.

    apogee cluster up [--data DIR] [--brokers N] [--nameservers N] [--flush sync|async]
                      [--no-console] [--monitoring [--scrape-interval S] [--prometheus-port PORT]]
    apogee cluster status | down [--data DIR]

``status`` prints each member's health, and under each broker its last recovery, for a broker
that is a replica group its replicas (``replicas: 3/3 in sync, leader <id> epoch <n>``, see
:func:`apogee.cli.brokers.group_summary`) and its endpoint for official RocketMQ 5 clients
(``apache.rocketmq.v2``, served on the broker's gRPC address: ``RocketMQ 5 clients:
endpoints=127.0.0.1:10911``).

``up`` on a cluster recorded before prints, above the endpoints, each member it started again
(``restarted broker-a on 127.0.0.1:10911 (it was not running)``) or added (``started console
on ...``).

``apogee-cli`` (the admin commands, over the SDK alone) does not know them: this distribution
plugs them in through the ``apogee.cli`` entry point group (``cluster =
"apogee.local.commands:register"``), and the command calls :func:`register` with its
subcommands. A :class:`~apogee.local.cluster.ClusterError` is a
:class:`~apogee.cli.common.CommandError`: one line, exit status 1.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from apogee.cli.brokers import group_summary
from apogee.cli.common import UsageError, data_dir, run_async, time_text
from apogee.cli.local_state import BROKER, CONSOLE, PROMETHEUS, ClusterState
from apogee.client.admin import AdminClient, BrokerAnswer, LastRecovery, ReplicaGroupStatus
from apogee.common.errors import ApogeeError
from apogee.local import cluster as local_cluster
from apogee.local import prometheus, webconsole


def register(sub: Any) -> None:
    """Add ``cluster`` and its actions to the ``apogee`` command's subcommands ``sub``."""
    cluster = sub.add_parser("cluster", help="run a local cluster").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    c_up = cluster.add_parser("up", help="start nameservers and brokers (harmless if running)")
    c_up.add_argument("--brokers", type=int, default=1)
    c_up.add_argument("--nameservers", type=int, default=1)
    c_up.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="make each broker a replica group of this many processes, with automatic "
        "failover (docs/replication.md; default 1: lone brokers)",
    )
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
        default=None,
        metavar="PORT",
        help=f"with --monitoring: Prometheus's port, or the next free one (default: the one it "
        f"had, else {local_cluster.PROMETHEUS_PORT})",
    )
    c_up.set_defaults(run=cmd_cluster_up)
    cluster.add_parser("status", help="health of each member").set_defaults(run=cmd_cluster_status)
    cluster.add_parser("down", help="stop the cluster, keep its data").set_defaults(
        run=cmd_cluster_down
    )


def cmd_cluster_up(args: argparse.Namespace, out: TextIO) -> int:
    if args.brokers < 1 or args.nameservers < 1:
        raise UsageError("--brokers and --nameservers must be at least 1")
    if not 1 <= args.replicas <= 9:
        raise UsageError(f"--replicas {args.replicas}: must be from 1 to 9")
    if not args.scrape_interval >= 0.001:  # NaN too
        raise UsageError(f"--scrape-interval {args.scrape_interval}: must be at least 0.001 s")
    if args.prometheus_port is not None and not 0 < args.prometheus_port < 65536:
        raise UsageError(f"--prometheus-port {args.prometheus_port}: must be from 1 to 65535")
    before = ClusterState.load(data_dir(args).resolve())
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
        replicas=args.replicas,
    )
    # the members this `up` started in a cluster recorded before: what was not running
    had = {p.name: p.pid for p in before.all()} if before else {}
    for p in state.all() if had else []:
        if p.name not in had:
            print(f"started {p.name} on {p.address}", file=out)
        elif p.pid != had[p.name]:
            print(f"restarted {p.name} on {p.address} (it was not running)", file=out)
    print(f"cluster up (data in {state.data_dir})", file=out)
    for p in state.all():
        print(f"  {p.role:<11} {p.name:<14} {p.address:<18} pid {p.pid:<8} log {p.log}", file=out)
        if p.metrics:
            print(f"  {'':11} metrics http://{p.metrics}/metrics", file=out)
        if p.role == PROMETHEUS:
            print(f"  {'':11} prometheus http://{p.address}", file=out)
    print(f"namesrv: {state.namesrv}", file=out)
    for p in state.console:
        print(f"console: {webconsole.url(p.address, p.env)}", file=out)
    if not state.console and not args.no_console and not webconsole.available():
        print("console: not started (apogee_console is not installed)", file=out)
    print(f'try: export APOGEE_NAMESRV="{state.namesrv}"', file=out)
    return 0


def cmd_cluster_status(args: argparse.Namespace, out: TextIO) -> int:
    state = ClusterState.load(data_dir(args).resolve())
    if state is None:
        print(f"no local cluster recorded in {data_dir(args)}", file=out)
        return 1
    bad = 0
    recoveries = _last_recoveries(state.namesrv)
    groups = _replica_lines(state.namesrv)
    for p, alive, healthy in local_cluster.status(state):
        word = "SERVING" if healthy else ("NOT SERVING" if alive else "STOPPED")
        bad += not healthy
        print(f"{p.role:<11} {p.name:<14} {p.address:<18} pid {p.pid:<8} {word}", file=out)
        group = groups.get(p.broker_name) if p.role == BROKER else None
        # a replica group's members share its name; its leader serves it (clients included)
        serves = group is None or group[0] == p.address
        if p.role == BROKER and healthy:
            if serves:
                recovery = recoveries.get(p.broker_name, "last recovery: not known")
                print(f"{'':11} {recovery}", file=out)
            if group is not None:
                role = "leads" if serves else "follows"
                print(f"{'':11} {role} {p.broker_name}; {group[1]}", file=out)
        if p.role == BROKER:  # the same port serves apache.rocketmq.v2
            endpoint = p.address if group is None else group[0]
            print(f"{'':11} RocketMQ 5 clients: endpoints={endpoint}", file=out)
        if p.metrics:
            print(f"{'':11} metrics http://{p.metrics}/metrics", file=out)
        if p.role == PROMETHEUS:
            print(f"{'':11} prometheus http://{p.address}", file=out)
        if p.role == CONSOLE:
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


def _replica_lines(namesrv: str) -> dict[str, tuple[str, str]]:
    """For each live broker that is a replica group, its leader's address and its replicas in
    one line, by broker name (lone brokers, and brokers that do not answer, have none)."""

    async def ask() -> list[BrokerAnswer[ReplicaGroupStatus]]:
        async with AdminClient(namesrv, timeout=5.0) as admin:
            return await admin.replica_groups()

    try:
        found: list[BrokerAnswer[ReplicaGroupStatus]] = run_async(ask)
    except ApogeeError:
        return {}
    out: dict[str, tuple[str, str]] = {}
    for a in found:
        line = group_summary(a.value) if a.value is not None else None
        if a.value is not None and line is not None:
            out[a.broker.broker_name] = (a.value.leader_address, line)
    return out


def cmd_cluster_down(args: argparse.Namespace, out: TextIO) -> int:
    stopped = local_cluster.down(data_dir(args))
    if not stopped:
        print(f"no local cluster recorded in {data_dir(args)}", file=out)
        return 0
    for p, how in stopped:
        print(f"{p.role:<11} {p.name:<14} {how}", file=out)
    print(f"data kept in {data_dir(args).resolve()}", file=out)
    return 0
