"""The ``apogee group`` commands: list consumer groups, describe one (members, offsets, lag),
reset a group's offsets of a topic.

Lag that cannot be known (nothing committed yet) is printed as ``unknown``, never as a number.
A group that official RocketMQ 5 clients consume by POP is described as the RocketMQ dashboard
shows it: ``consumption: POP``, the official clients connected to each broker (client id,
language, version, type, host), and per queue the messages in flight and still invisible.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, TextIO

from apogee.cli.common import (
    admin_client,
    check_time_ms,
    parse_time,
    run_async,
    time_text,
)
from apogee.client.admin import GroupDescription
from apogee.client.groups import POP, check_group_name
from apogee.common.errors import NotFoundError

UNKNOWN = "unknown"


def add_commands(sub: Any) -> None:
    group = sub.add_parser("group", help="consumer groups: members, offsets, lag").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    group.add_parser("list", help="groups the brokers know").set_defaults(run=cmd_group_list)
    g_desc = group.add_parser(
        "describe",
        help="members (or official clients), and offsets, lag and messages in flight per queue",
    )
    g_desc.add_argument("group")
    g_desc.set_defaults(run=cmd_group_describe)
    g_reset = group.add_parser(
        "reset-offset",
        help="move a group's offsets of a topic (its running consumers follow)",
        description="Move GROUP's committed offsets of every queue of TOPIC on every broker: "
        "to the earliest message kept, to the end (skip everything), or to the first message "
        "stored at or after a time.",
    )
    g_reset.add_argument("group")
    g_reset.add_argument("--topic", required=True)
    to = g_reset.add_mutually_exclusive_group(required=True)
    to.add_argument(
        "--to",
        metavar="earliest|latest|TIME",
        help="earliest, latest, or an ISO 8601 time (naive means UTC)",
    )
    to.add_argument("--timestamp", type=int, metavar="MS", help="epoch milliseconds")
    g_reset.set_defaults(run=cmd_group_reset_offset)


def cmd_group_list(args: argparse.Namespace, out: TextIO) -> int:
    async def go() -> None:
        async with admin_client(args) as admin:
            groups = await admin.list_groups()
        if not groups:
            print("no consumer group is known to the brokers", file=out)
            return
        rows = [
            [g.group, str(g.members), g.mode, ",".join(g.topics) or "-", ",".join(g.brokers)]
            for g in groups
        ]
        _print_table(["GROUP", "MEMBERS", "MODE", "TOPICS", "BROKERS"], rows, out)

    run_async(go)
    return 0


def cmd_group_describe(args: argparse.Namespace, out: TextIO) -> int:
    async def go() -> None:
        async with admin_client(args) as admin:
            description = await admin.describe_group(args.group)
        print_description(description, out)

    run_async(go)
    return 0


def print_description(d: GroupDescription, out: TextIO) -> None:
    lag = d.lag_messages
    known = [q.lag_messages for q in d.queues if q.lag_messages is not None]
    if lag is not None:
        lag_text = f"{lag} messages"
    elif known:
        unknown = len(d.queues) - len(known)
        lag_text = f"at least {sum(known)} messages ({unknown} of the queues {UNKNOWN})"
    else:
        lag_text = UNKNOWN
    pop = d.consumption == POP
    who = (
        f"{len({c.client_id for c in d.clients})} official clients"
        if pop and not d.members
        else f"{len(d.members)} members"
    )
    in_flight = f", {d.in_flight} in flight ({d.invisible} invisible)" if pop else ""
    print(f"group {d.group}: {who}, {len(d.queues)} queues, lag {lag_text}{in_flight}", file=out)
    if d.consumption:
        print(f"consumption: {d.consumption}", file=out)
    print("", file=out)
    if d.members:
        _print_members(d, out)
    elif not pop:
        print("no member online", file=out)
    if d.clients:
        if d.members:
            print("", file=out)
        print("official clients:", file=out)
        rows = [
            [
                c.client_id,
                c.language or "-",
                c.version or "-",
                c.client_type or "-",
                c.host or "-",
                c.broker_name,
            ]
            for c in d.clients
        ]
        _print_table(["CLIENT ID", "LANGUAGE", "VERSION", "TYPE", "HOST", "BROKER"], rows, out)
    elif pop:
        print("no official client connected", file=out)
    print("", file=out)
    if d.queues:
        _print_queues(d, pop or any(q.in_flight for q in d.queues), out)
    elif pop:
        print("no queue has a message received by this group", file=out)
    else:
        print("no queue has an offset of this group", file=out)
    if d.warnings:
        print("", file=out)
        for w in d.warnings:
            print(f"warning: {w}", file=out)


def _print_members(d: GroupDescription, out: TextIO) -> None:
    rows = [
        [
            m.client_id,
            m.host or "-",
            m.mode,
            " ".join(
                f"{s.topic}({s.tag_expression or '*'}"
                + (f" WHERE {s.sql_expression})" if s.sql_expression else ")")
                for s in m.subscriptions
            )
            or "-",
            time_text(m.last_heartbeat_ms, "seconds"),
        ]
        for m in d.members
    ]
    _print_table(["CLIENT ID", "HOST", "MODE", "SUBSCRIPTIONS", "LAST HEARTBEAT"], rows, out)


def _print_queues(d: GroupDescription, in_flight: bool, out: TextIO) -> None:
    """One row per queue; the IN FLIGHT and INVISIBLE columns when ``in_flight``."""
    headers = ["TOPIC", "BROKER", "QUEUE", "BROKER OFFSET", "CONSUMER OFFSET", "LAG", "LAG (S)"]
    if in_flight:
        headers += ["IN FLIGHT", "INVISIBLE"]
    rows = []
    for q in d.queues:
        row = [
            q.topic,
            q.broker_name,
            str(q.queue_id),
            str(q.broker_offset),
            "none" if q.consumer_offset is None else str(q.consumer_offset),
            UNKNOWN if q.lag_messages is None else str(q.lag_messages),
            UNKNOWN if q.lag_seconds is None else f"{q.lag_seconds:.1f}",
        ]
        if in_flight:
            row += [str(q.in_flight), str(q.invisible)]
        rows.append([*row, q.locked_by or "-"])
    _print_table([*headers, "LOCKED BY"], rows, out)


def cmd_group_reset_offset(args: argparse.Namespace, out: TextIO) -> int:
    earliest = latest = False
    timestamp_ms: int | None = None
    if args.timestamp is not None:
        timestamp_ms = check_time_ms(args.timestamp, "--timestamp", args.timestamp)
    elif args.to == "earliest":
        earliest = True
    elif args.to == "latest":
        latest = True
    else:
        timestamp_ms = parse_time(args.to, "--to")

    check_group_name(args.group)

    async def go() -> None:
        async with admin_client(args) as admin:
            if args.group not in {g.group for g in await admin.list_groups()}:
                raise NotFoundError(
                    what=f"group {args.group!r}",
                    detail="no broker knows it (no member has started, no offset is committed); "
                    "check the name",
                )
            reset = await admin.reset_offsets(
                args.group,
                args.topic,
                earliest=earliest,
                latest=latest,
                timestamp_ms=timestamp_ms,
            )
        target = (
            "the earliest message"
            if earliest
            else "the end"
            if latest
            else time_text(timestamp_ms or 0, "seconds")
        )
        print(
            f"reset group {args.group} on topic {args.topic} to {target}: "
            f"{len(reset)} queues on {len({r.broker_name for r in reset})} brokers",
            file=out,
        )
        _print_table(
            ["BROKER", "QUEUE", "OFFSET"],
            [[r.broker_name, str(r.queue_id), str(r.offset)] for r in reset],
            out,
        )

    run_async(go)
    return 0


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    for line in (headers, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip(), file=out)
