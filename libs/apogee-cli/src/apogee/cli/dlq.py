"""The ``apogee dlq`` commands: list a consumer group's dead letters, and redrive them.

    apogee dlq list --group G [--filter key=K]... [--since TIME|SECONDS] [--limit N]
    apogee dlq redrive --group G [--filter key=K]... [--since TIME|SECONDS] [--rate N/s] [--dry-run]

``list`` prints one tab-separated line per dead letter (id, time it was dead-lettered, original
topic, attempts, tag, keys, reason, start of the body) and a summary line. ``redrive`` prints one
line per matching message (old id, new id, topic; or what it would send with ``--dry-run``) and a
summary; it exits with status 1 when a send failed.
"""

from __future__ import annotations

import argparse
import math
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from apogee.cli.common import UsageError, admin_client, run_async, time_text
from apogee.client.dlq import MAX_LIST, DeadLetter, DeadLetterFilter, parse_filters
from apogee.common.errors import InvalidArgumentError

DEFAULT_LIMIT = 100
DEFAULT_RATE = 100.0


def add_commands(sub: Any) -> None:
    d = sub.add_parser(
        "dlq", help="dead letters of a consumer group: list, redrive"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    d_list = d.add_parser(
        "list",
        help="print a group's dead letters",
        description="Prints the messages of %DLQ%GROUP on every broker, oldest first, one "
        "tab-separated line each: id, time dead-lettered, original topic, attempts, tag, keys, "
        "last failure, start of the body. Nothing is consumed.",
    )
    _common(d_list)
    d_list.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIMIT,
        help=f"print at most N (default {DEFAULT_LIMIT})",
    )
    d_list.set_defaults(run=cmd_dlq_list)
    d_redrive = d.add_parser(
        "redrive",
        help="send a group's dead letters to their original topics again",
        description="Sends each matching message of %DLQ%GROUP again to its original topic "
        "(body, tag, keys and properties kept; its old id in property ORIGIN_MSG_ID), at most "
        "--rate per second. The dead letters stay: running it twice sends them twice.",
    )
    _common(d_redrive)
    d_redrive.add_argument(
        "--rate",
        default=f"{DEFAULT_RATE:g}/s",
        metavar="N/s",
        help=f"messages per second at most (default {DEFAULT_RATE:g}/s)",
    )
    d_redrive.add_argument(
        "--dry-run", action="store_true", help="print what would be sent, send nothing"
    )
    d_redrive.set_defaults(run=cmd_dlq_redrive)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group", required=True, help="the consumer group")
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="key=K",
        help="only messages with key K (tag=T: with tag T; topic=T: from original topic T); "
        "may be repeated, all must match",
    )
    p.add_argument(
        "--since",
        metavar="TIME|SECONDS",
        help="only messages dead-lettered at or after TIME (ISO 8601, naive means UTC) or "
        "SECONDS ago",
    )


def parse_since(text: str | None, now_ms: int) -> int:
    """Epoch ms from ``--since``: an ISO 8601 time, or a number of seconds before now."""
    if text is None:
        return 0
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds) or seconds < 0:
            raise UsageError(f"--since {text!r}: a number of seconds ago must be 0 or more")
        return max(0, now_ms - int(seconds * 1000))
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"--since {text!r}: use an ISO 8601 time (2026-11-21T10:00:00) or seconds ago (3600)"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return max(0, int(dt.timestamp() * 1000))


def parse_rate(text: str) -> float:
    """Messages per second from ``--rate``: ``N`` or ``N/s``."""
    number = text.strip().removesuffix("/s")
    try:
        rate = float(number)
    except ValueError:
        raise UsageError(f"--rate {text!r}: use messages per second, e.g. 50/s") from None
    if not math.isfinite(rate) or rate <= 0:
        raise UsageError(f"--rate {text!r}: must be above 0 messages per second")
    return rate


def _filter(args: argparse.Namespace) -> DeadLetterFilter:
    since = parse_since(args.since, int(time.time() * 1000))
    try:
        return parse_filters(args.filter, since)
    except InvalidArgumentError as err:
        raise UsageError(f"--{err}") from None


def format_letter(d: DeadLetter) -> str:
    reason = d.reason.replace("\t", " ") or "-"
    return "\t".join(
        (
            d.unique_id,
            time_text(d.store_timestamp_ms),
            d.origin_topic or "-",
            str(d.attempts),
            d.tags or "-",
            ",".join(d.keys) or "-",
            reason,
            d.body_preview,
        )
    )


def cmd_dlq_list(args: argparse.Namespace, out: TextIO) -> int:
    if not 1 <= args.limit <= MAX_LIST:
        raise UsageError(f"--limit must be from 1 to {MAX_LIST}, got {args.limit}")
    flt = _filter(args)

    async def go() -> list[DeadLetter]:
        async with admin_client(args) as admin:
            return await admin.list_dead_letters(
                args.group,
                key=flt.key,
                tag=flt.tag,
                topic=flt.topic,
                since_ms=flt.since_ms,
                limit=args.limit,
            )

    letters: list[DeadLetter] = run_async(go)
    for d in letters:
        print(format_letter(d), file=out)
    more = " (the limit; there may be more)" if len(letters) >= args.limit else ""
    which = " matching" if args.filter or args.since else ""
    print(f"{len(letters)}{which} dead letters of group {args.group}{more}", file=out)
    return 0


def cmd_dlq_redrive(args: argparse.Namespace, out: TextIO) -> int:
    rate = parse_rate(args.rate)
    flt = _filter(args)

    async def go() -> Any:
        async with admin_client(args) as admin:
            return await admin.redrive_dead_letters(
                args.group,
                key=flt.key,
                tag=flt.tag,
                topic=flt.topic,
                since_ms=flt.since_ms,
                rate=rate,
                dry_run=args.dry_run,
            )

    result = run_async(go)
    for item in result.items:
        if result.dry_run:
            print(f"{item.old_id}\twould go to\t{item.origin_topic or '-'}", file=out)
        elif item.error:
            print(f"{item.old_id}\tFAILED\t{item.origin_topic or '-'}\t{item.error}", file=out)
        else:
            print(f"{item.old_id}\t{item.new_id}\t{item.origin_topic}", file=out)
    if result.dry_run:
        print(
            f"dry run: {result.matched} dead letters of group {args.group} match; nothing sent",
            file=out,
        )
        return 0
    print(
        f"redrove {result.sent} of {result.matched} matching dead letters of group "
        f"{args.group}; {result.failed} failed",
        file=out,
    )
    return 1 if result.failed else 0
