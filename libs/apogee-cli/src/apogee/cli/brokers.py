"""The ``apogee broker`` commands: a broker's replica group, and a controlled switch of its leader.

    apogee broker describe [NAME]
    apogee broker elect NAME [--to REPLICA_ID]

``describe`` prints the group of broker NAME (without a name: of every live broker, one after
the other): its leader and epoch, the acks and minimum in-sync replicas sends wait for, the
high watermark, then one row per replica (id, address, role, in sync, lag in bytes and in
seconds, whether it may lead). A follower that does not answer is shown ``unreachable`` with
what the leader knows of it; a lone broker (not a replica group) says ``replication: none``.
It exits 1 when a broker named, or one of the cluster's, does not answer.

``elect`` hands the leadership of NAME's group to the in-sync follower ``--to`` names (by
default the most caught-up one) and prints the new leader and epoch.

:func:`group_summary` is the one line ``apogee cluster status`` prints under each broker that
is a replica group.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from apogee.cli.common import admin_client, run_async
from apogee.client.admin import ReplicaGroupStatus, ReplicaStatus
from apogee.client.admin_info import BrokerAnswer


def add_commands(sub: Any) -> None:
    broker = sub.add_parser(
        "broker", help="brokers' replica groups: who leads, each replica's lag, switch leaders"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    b_desc = broker.add_parser(
        "describe",
        help="a broker's replica group: leader, epoch, and each replica's lag",
        description="Prints broker NAME's replica group (without NAME: every live broker's): "
        "leader, epoch, acks, min in-sync replicas, high watermark, and one row per replica. "
        "A lone broker says `replication: none`.",
    )
    b_desc.add_argument("name", nargs="?", help="the broker name (default: every broker)")
    b_desc.set_defaults(run=cmd_broker_describe)
    b_elect = broker.add_parser(
        "elect",
        help="hand a replica group's leadership to an in-sync follower",
        description="A controlled switch: the leader of broker NAME's replica group holds new "
        "writes, lets the chosen in-sync follower catch up and hands it leadership at a new "
        "epoch. Prints the new leader and epoch.",
    )
    b_elect.add_argument("name", help="the broker name")
    b_elect.add_argument(
        "--to",
        default="",
        metavar="REPLICA_ID",
        help="the in-sync follower to lead (default: the most caught-up one)",
    )
    b_elect.set_defaults(run=cmd_broker_elect)


def cmd_broker_describe(args: argparse.Namespace, out: TextIO) -> int:
    async def go() -> int:
        async with admin_client(args) as admin:
            if args.name is not None:
                print_group(await admin.describe_broker(args.name), out)
                return 0
            found = await admin.replica_groups()
        if not found:
            print("no live broker is registered with the nameservers", file=out)
            return 1
        return print_answers(found, out)

    result: int = run_async(go)
    return result


def print_answers(found: list[BrokerAnswer[ReplicaGroupStatus]], out: TextIO) -> int:
    """Every broker's group, a blank line between two; 1 when one did not answer."""
    bad = 0
    for i, answer in enumerate(found):
        if i:
            print(file=out)
        if answer.value is None:
            bad = 1
            b = answer.broker
            print(
                f"broker {b.broker_name} at {b.address}: did not answer: {answer.error}", file=out
            )
        else:
            print_group(answer.value, out)
    return bad


def print_group(status: ReplicaGroupStatus, out: TextIO) -> None:
    print(f"broker {status.broker_name} (cluster {status.cluster})", file=out)
    if not status.replicated:
        print(f"  address:         {status.leader_address}", file=out)
        print("  replication:     none (a lone broker, not a replica group)", file=out)
        print(f"  log end:         {status.log_end}", file=out)
        return
    leader = (
        f"{status.leader_id} at {status.leader_address}"
        if status.leader_id
        else "none answers (the group is electing one, or its leader is unreachable)"
    )
    print(f"  leader:          {leader}", file=out)
    print(f"  epoch:           {status.epoch}", file=out)
    print(f"  acks:            {status.acks}", file=out)
    print(f"  min in-sync:     {status.min_insync_replicas}", file=out)
    print(f"  high watermark:  {status.high_watermark}", file=out)
    print(f"  in sync:         {status.in_sync_count}/{len(status.replicas)}", file=out)
    headers = ["ID", "ADDRESS", "ROLE", "IN SYNC", "LAG BYTES", "LAG SECONDS", "ELIGIBLE"]
    rows = [_row(r) for r in status.replicas]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    for line in (headers, *rows):
        text = "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
        print(f"  {text}".rstrip(), file=out)
    for r in status.replicas:
        if r.error is not None:
            print(f"  replica {r.replica_id} did not answer: {r.error}", file=out)


def _row(r: ReplicaStatus) -> list[str]:
    return [
        r.replica_id or "-",
        r.address,
        r.role if r.reachable else "unreachable",
        _yes(r.in_sync),
        str(r.lag_bytes),
        f"{r.lag_seconds:.1f}",
        _yes(r.eligible),
    ]


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def group_summary(status: ReplicaGroupStatus) -> str | None:
    """``replicas: 2/3 in sync, leader <id> epoch <n>`` for a replica group; None for a lone
    broker."""
    if not status.replicated:
        return None
    leader = status.leader_id or "none"
    return (
        f"replicas: {status.in_sync_count}/{len(status.replicas)} in sync, "
        f"leader {leader} epoch {status.epoch}"
    )


def cmd_broker_elect(args: argparse.Namespace, out: TextIO) -> int:
    async def go() -> None:
        async with admin_client(args) as admin:
            done = await admin.elect(args.name, args.to)
        print(
            f"broker {args.name}: replica {done.leader_id} at {done.leader_address} leads now, "
            f"epoch {done.epoch}",
            file=out,
        )

    run_async(go)
    return 0
