"""``apogee consume``: print the messages of a topic as a consumer of a group."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any, TextIO

from apogee.cli.common import UsageError, namesrv, parse_time, run_async, text_arg
from apogee.client.consumer.pull import PullConsumer
from apogee.client.consumer.records import ReceivedMessage
from apogee.common.errors import CorruptRecordError


def add_consume_command(sub: Any) -> None:
    c = sub.add_parser(
        "consume",
        help="print messages of a topic as a member of a consumer group, one per line",
        description="Prints one line per message: id, broker/queue, offset, tag, keys, body "
        "(tab-separated; newlines in the body shown as \\n). Offsets of the printed messages "
        "are committed for the group.",
    )
    c.add_argument("topic")
    c.add_argument("--group", required=True)
    c.add_argument(
        "--tag", default="*", type=text_arg, help="tag expression, e.g. 'A || B' (default: *)"
    )
    c.add_argument(
        "--sql",
        default="",
        type=text_arg,
        help="only messages whose properties meet this SQL92 condition, filtered at the broker, "
        "e.g. \"color = 'red' AND size > 3\" (comparisons, BETWEEN, IN, IS NULL, AND/OR/NOT; "
        "TAGS and KEYS are properties too)",
    )
    c.add_argument("--count", type=int, default=0, help="stop after N messages")
    c.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        help="stop after S seconds without a new message (default: run until interrupted)",
    )
    c.add_argument(
        "--from",
        dest="start",
        metavar="earliest|latest|TIME",
        default="latest",
        help="where a group without committed offsets starts: earliest, latest, or the first "
        "message stored at or after TIME (ISO 8601, naive means UTC, or epoch ms; found by "
        "each broker, as `apogee message read --since` does) (default: latest)",
    )
    c.add_argument(
        "--broadcast", action="store_true", help="broadcasting: offsets kept in a local file"
    )
    c.set_defaults(run=cmd_consume)


def format_message(m: ReceivedMessage) -> str:
    """One line: a UTF-8 body as text (backslash, newline and tab escaped), any other body as a
    Python bytes literal (``b'\\xff\\xfe'``; its backslashes are not doubled, so the two never
    look alike)."""
    try:
        body = m.body.decode("utf-8")
    except UnicodeDecodeError:
        body = repr(m.body)
    else:
        body = body.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    keys = ",".join(m.keys)
    return "\t".join(
        (m.unique_id, f"{m.broker_name}/{m.queue_id}", str(m.queue_offset), m.tags, keys, body)
    )


def print_message(m: ReceivedMessage, out: TextIO) -> None:
    """Print ``m`` as :func:`format_message` does; a record that cannot be decoded is reported
    on stderr (where it is, its id and why) and passed over, never where a reader stops."""
    try:
        line = format_message(m)
    except CorruptRecordError as err:
        print(
            f"apogee: skipped {m.broker_name}/{m.queue_id} offset {m.queue_offset} "
            f"(id {m.unique_id}): {err}",
            file=sys.stderr,
        )
    else:
        print(line, file=out)


def cmd_consume(args: argparse.Namespace, out: TextIO) -> int:
    if args.count < 0 or args.timeout < 0:
        raise UsageError("--count and --timeout must not be negative")

    if args.start in ("earliest", "latest"):
        start: dict[str, Any] = {"consume_from": args.start}
    else:
        start = {
            "consume_from": "timestamp",
            "consume_timestamp_ms": parse_time(args.start, "--from"),
        }

    async def go() -> int:
        consumer = PullConsumer(
            namesrv(args),
            args.group,
            mode="broadcasting" if args.broadcast else "clustering",
            **start,
        )
        consumer.subscribe(args.topic, args.tag, sql=args.sql)
        printed = 0
        async with consumer:
            await consumer.start()
            last = time.monotonic()
            while not args.count or printed < args.count:
                wait = 1.0
                if args.timeout:
                    wait = args.timeout - (time.monotonic() - last)
                    if wait <= 0:
                        break
                room = (args.count - printed) if args.count else 1024
                batch = await consumer.poll(timeout=min(wait, 1.0), max_messages=room)
                if batch:
                    last = time.monotonic()
                for m in batch:
                    print_message(m, out)
                    printed += 1
                if batch:
                    out.flush()
            await consumer.commit()
        if args.count and printed < args.count:
            print(
                f"apogee: received {printed} of {args.count} messages before the timeout",
                file=sys.stderr,
            )
            return 1
        return 0

    try:
        result: int = run_async(go)
    except KeyboardInterrupt:
        return 130
    except asyncio.CancelledError:
        return 130
    return result
