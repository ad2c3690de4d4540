"""``apogee message read``: print a topic's queues between two offsets, or from a time, through
the SDK's :class:`~apogee.client.reader.QueueReader` (no group, nothing committed)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from apogee.cli.common import UsageError, namesrv, parse_time, run_async, text_arg
from apogee.cli.consume import print_message
from apogee.client.producer.routes import MessageQueue
from apogee.client.reader import QueueReader


def add_read_command(message: Any) -> None:
    """``message read``, under the ``message`` command's sub-commands."""
    r = message.add_parser(
        "read",
        help="messages of a topic's queues between two offsets or from a time",
        description="Prints one line per message, as `apogee consume` does, queue after queue "
        "(sorted by broker and queue id). Reads with no consumer group: nothing is committed.",
    )
    r.add_argument("topic")
    r.add_argument(
        "--queue",
        metavar="BROKER/ID",
        help="one queue, e.g. broker-a/3 (default: every readable queue of the topic)",
    )
    start = r.add_mutually_exclusive_group()
    start.add_argument(
        "--from", dest="start", type=int, metavar="OFFSET", help="first offset (default: earliest)"
    )
    start.add_argument(
        "--since",
        metavar="TIME",
        help="start at the first message stored at or after TIME (ISO 8601, naive means UTC, "
        "or epoch ms)",
    )
    r.add_argument("--to", dest="end", type=int, metavar="OFFSET", help="stop before this offset")
    r.add_argument(
        "--tag", default="*", type=text_arg, help="tag expression, e.g. 'A || B' (default: *)"
    )
    r.add_argument(
        "--sql",
        default="",
        type=text_arg,
        help="only messages whose properties meet this SQL92 condition (as consume --sql)",
    )
    r.add_argument("--count", type=int, default=0, help="stop after N messages in all")
    r.set_defaults(run=cmd_message_read)


def _queue(text: str, topic: str) -> MessageQueue:
    broker, sep, qid = text.rpartition("/")
    if not sep or not broker or not qid.isdigit():
        raise UsageError(f"--queue {text!r}: use BROKER/ID, e.g. broker-a/0")
    return MessageQueue(topic, broker, int(qid))


def cmd_message_read(args: argparse.Namespace, out: TextIO) -> int:
    for flag, value in (("--from", args.start), ("--to", args.end), ("--count", args.count)):
        if value is not None and value < 0:
            raise UsageError(f"{flag} must not be negative")
    if args.start is not None and args.end is not None and args.end < args.start:
        raise UsageError(f"--to {args.end} is before --from {args.start}")
    since = parse_time(args.since, "--since") if args.since is not None else None

    async def go() -> int:
        printed = 0
        async with QueueReader(namesrv(args)) as reader:
            queues = await reader.queues(args.topic)
            if args.queue is not None:
                queues = [_queue(args.queue, args.topic)]
            for q in queues:
                if since is not None:
                    start = await reader.offset_for_timestamp(q, since)
                elif args.start is not None:
                    start = args.start
                else:
                    start = (await reader.offsets(q)).min_offset
                end = args.end
                if end is not None and end < start:
                    continue  # the range is empty on this queue
                async for m in reader.read(q, start, end, tag_expression=args.tag, sql=args.sql):
                    print_message(m, out)
                    printed += 1
                    if args.count and printed >= args.count:
                        return 0
        return 0

    result: int = run_async(go)
    return result
