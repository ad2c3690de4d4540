"""The ``apogee txn`` commands: transactions no one has decided yet, and an operator's decision.

    apogee txn list [--group G] [--topic T] [--max N]
    apogee txn resolve ID (--commit | --rollback)

``list`` prints, oldest first, each pending transaction with its broker, producer group, topic,
age, the checks it has had and whether it is still checked (``checking``) or ran out of checks
and waits in ``TRANS_CHECK_MAX_TIME_TOPIC`` (``gave up``). ``resolve`` ends one by its id.
"""

from __future__ import annotations

import argparse
import getpass
import time
from typing import Any, TextIO

from apogee.cli.common import UsageError, admin_client, run_async
from apogee.client.txn_admin import MAX_PENDING, PendingTransaction


def add_commands(sub: Any) -> None:
    txn = sub.add_parser(
        "txn", help="transactions: list the undecided ones, decide one by hand"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    t_list = txn.add_parser(
        "list", help="pending transactions on every broker, oldest first (age, checks, group)"
    )
    t_list.add_argument("--group", default="", help="only this producer group's")
    t_list.add_argument("--topic", default="", help="only those of this topic")
    t_list.add_argument(
        "--max", type=int, default=100, help=f"at most this many (1 to {MAX_PENDING})"
    )
    t_list.set_defaults(run=cmd_txn_list)
    t_res = txn.add_parser(
        "resolve",
        help="end a pending transaction by hand",
        description="Commit (the message is stored once, for consumers) or roll back (it is "
        "dropped) the pending transaction ID, wherever it is pending, even after it ran out "
        "of checks.",
    )
    t_res.add_argument("id", help="the transaction id (the message id)")
    decision = t_res.add_mutually_exclusive_group(required=True)
    decision.add_argument("--commit", action="store_true")
    decision.add_argument("--rollback", action="store_true")
    t_res.set_defaults(run=cmd_txn_resolve)


def age_text(seconds: float) -> str:
    """``42s``, ``7m05s``, ``3h12m``, ``2d04h``."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def cmd_txn_list(args: argparse.Namespace, out: TextIO) -> int:
    if not 1 <= args.max <= MAX_PENDING:
        raise UsageError(f"--max must be from 1 to {MAX_PENDING}, got {args.max}")

    async def go() -> None:
        async with admin_client(args) as admin:
            pending = await admin.list_pending_transactions(args.group, args.topic, args.max)
        if not pending:
            print("no pending transaction", file=out)
            return
        print_pending(pending, time.time(), out)

    run_async(go)
    return 0


def print_pending(pending: list[PendingTransaction], now_s: float, out: TextIO) -> None:
    headers = ["ID", "BROKER", "GROUP", "TOPIC", "AGE", "CHECKS", "STATE", "KEYS"]
    rows = [
        [
            p.transaction_id,
            p.broker_name,
            p.producer_group,
            p.topic,
            age_text(now_s - p.first_stored_ms / 1000),
            str(p.check_times),
            "checking" if p.checking else "gave up",
            p.keys or "-",
        ]
        for p in pending
    ]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    for line in (headers, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip(), file=out)


def cmd_txn_resolve(args: argparse.Namespace, out: TextIO) -> int:
    async def go() -> None:
        async with admin_client(args) as admin:
            done = await admin.resolve_transaction(
                args.id, commit=args.commit, operator=f"apogee txn resolve ({_who()})"
            )
        where = f": {done.topic} queue {done.queue_id} offset {done.queue_offset}"
        print(
            f"{done.outcome} {done.transaction_id} on {done.broker_name}"
            + (where if done.topic else ""),
            file=out,
        )

    run_async(go)
    return 0


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown user"
