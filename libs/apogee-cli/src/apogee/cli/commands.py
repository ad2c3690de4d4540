"""The ``apogee`` commands that talk to a running cluster: topic, send, message.

A topic's type (``--type``, RocketMQ 5's topic message type) says which messages it accepts:
NORMAL (plain ones), FIFO (with a message group: ordered sends), DELAY (with a delay level or a
delivery time), TRANSACTION (transactional), or MIXED, every type: what a topic is unless
created with another. ``topic list`` and ``topic describe`` show it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Final, TextIO

from apogee.cli.common import (
    UsageError,
    admin_client,
    namesrv,
    not_utf8,
    parse_time,
    run_async,
    text_arg,
    time_text,
)
from apogee.cli.read import add_read_command
from apogee.client.admin import MessageType, Perm, TopicConfig
from apogee.client.message import (
    DEFAULT_DELAY_LEVELS,
    MAX_DELAY_LEVEL,
    Message,
    StoredMessage,
)
from apogee.client.producer.producer import Producer
from apogee.common.topics import MESSAGE_TYPE_NAMES

_PERMS = {"rw": Perm.READ | Perm.WRITE, "r": Perm.READ, "w": Perm.WRITE}
#: where bytes that are not text go instead
_USE_BODY_FILE: Final = "send bytes as they are with --body-file PATH (- for standard input)"


def _message_text(text: str) -> str:
    """An argparse ``type`` for a tag, key or property: UTF-8 text, as :func:`text_arg`."""
    problem = not_utf8(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(
            f"{problem}; tags, keys and properties are text: binary data belongs in the body "
            "(--body-file)"
        )
    return text


def _message_type(text: str) -> MessageType:
    """An argparse ``type`` for ``--type``: a topic message type, in any case."""
    if text.upper() in MESSAGE_TYPE_NAMES:
        return MessageType(text.upper())
    raise argparse.ArgumentTypeError(
        f"{text!r}: must be one of {', '.join(MESSAGE_TYPE_NAMES)} (any case)"
    )


def add_commands(sub: Any) -> None:
    topic = sub.add_parser("topic", help="manage topics").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    for action, text, type_default in (
        ("create", "create a topic", "MIXED, every type"),
        ("update", "change queues, permissions or type", "the topic's type, unchanged"),
    ):
        t = topic.add_parser(action, help=text)
        t.add_argument("name")
        t.add_argument("--queues", type=int, default=8, help="read and write queues per broker")
        t.add_argument("--perm", choices=sorted(_PERMS), default="rw")
        t.add_argument(
            "--type",
            dest="message_type",
            type=_message_type,
            default=None,
            metavar="|".join(MESSAGE_TYPE_NAMES),
            help="the messages it accepts: NORMAL plain ones, FIFO ones with a message group "
            "(ordered sends), DELAY delayed and timer ones, TRANSACTION transactional ones, "
            f"MIXED every type (any case; default: {type_default})",
        )
        t.add_argument(
            "--broker", action="append", default=None, help="only this broker (repeatable)"
        )
        t.set_defaults(run=cmd_topic_put)
    t_del = topic.add_parser("delete", help="delete a topic from every broker")
    t_del.add_argument("name")
    t_del.set_defaults(run=cmd_topic_delete)
    t_list = topic.add_parser(
        "list", help="topics of the cluster, one name per line (--long: with their types)"
    )
    t_list.add_argument(
        "-l", "--long", action="store_true", help="a NAME and TYPE table instead of names"
    )
    t_list.set_defaults(run=cmd_topic_list)
    t_desc = topic.add_parser("describe", help="type, queues and offsets on each broker")
    t_desc.add_argument("name")
    t_desc.set_defaults(run=cmd_topic_describe)

    send = sub.add_parser(
        "send",
        help="send BODY, a file, or each line of standard input, printing one message id per line",
        description="Sends BODY (text, sent as UTF-8), the bytes of --body-file as one message, "
        "or else each line of standard input as one message (its bytes as they are, without "
        "the newline), and prints one message id per line. A delay (--delay-level, "
        "--deliver-in or --deliver-at, one of them) applies to every message sent.",
    )
    send.add_argument("topic")
    send.add_argument("body", nargs="?")
    send.add_argument(
        "--body-file",
        metavar="PATH",
        help="send the bytes of PATH as they are, as one message (- for standard input)",
    )
    send.add_argument("--tag", default="", type=_message_text)
    send.add_argument("--key", action="append", default=[], type=_message_text)
    send.add_argument("--property", action="append", default=[], metavar="K=V", type=_message_text)
    when = send.add_mutually_exclusive_group()
    when.add_argument(
        "--delay-level",
        type=int,
        metavar="N",
        help=f"deliver after delay level N, 1-{MAX_DELAY_LEVEL} (the brokers' delay table, by "
        f"default {' '.join(DEFAULT_DELAY_LEVELS)})",
    )
    when.add_argument(
        "--deliver-in",
        type=float,
        metavar="SECONDS",
        help="deliver SECONDS (a decimal number, at least 0) after each message is sent",
    )
    when.add_argument(
        "--deliver-at",
        metavar="TIME",
        help="deliver at TIME, ISO 8601 with a UTC offset or Z (2026-11-21T18:30:00+01:00, "
        "2026-11-21T17:30:00Z); a time without one is refused rather than guessed",
    )
    send.set_defaults(run=cmd_send)

    message = sub.add_parser("message", help="look messages up").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    m_get = message.add_parser("get", help="a message by its id")
    m_get.add_argument("id", type=text_arg)
    m_get.set_defaults(run=cmd_message_get)
    m_query = message.add_parser(
        "query", help="messages of a topic stored in a time window, with a key or all of them"
    )
    m_query.add_argument("--topic", required=True)
    m_query.add_argument(
        "--key",
        default="",
        type=text_arg,
        help="only messages with this key (default: every message)",
    )
    m_query.add_argument("--begin", default="0", help="ISO 8601 time or epoch ms (default: 0)")
    m_query.add_argument("--end", default="0", help="ISO 8601 time or epoch ms (default: now)")
    m_query.add_argument(
        "--max", type=int, default=32, help="at most this many, the newest (1 to 1024)"
    )
    m_query.set_defaults(run=cmd_message_query)
    add_read_command(message)


def cmd_topic_put(args: argparse.Namespace, out: TextIO) -> int:

    async def go() -> None:
        async with admin_client(args) as admin:
            updates = await admin.create_or_update_topic(
                args.name,
                queues=args.queues,
                perm=_PERMS[args.perm],
                brokers=args.broker,
                message_type=args.message_type,
            )
        for u in updates:
            verb = "created" if u.created else "updated"
            print(f"{verb} {u.topic.name} on {u.broker_name}: {_config_text(u.topic)}", file=out)

    run_async(go)
    return 0


def cmd_topic_delete(args: argparse.Namespace, out: TextIO) -> int:

    async def go() -> None:
        async with admin_client(args) as admin:
            brokers = await admin.delete_topic(args.name)
        for b in brokers:
            print(f"deleted {args.name} on {b}", file=out)

    run_async(go)
    return 0


def cmd_topic_list(args: argparse.Namespace, out: TextIO) -> int:

    async def go() -> None:
        async with admin_client(args) as admin:
            if not args.long:  # one name per line, as scripts read it
                for name in await admin.list_topics():
                    print(name, file=out)
                return
            listed = await admin.list_topic_configs()
        rows = [(t.name, _types_text(t.message_types)) for t in listed]
        width = max((len(name) for name, _ in rows), default=0)
        width = max(width, len("NAME"))
        print(f"{'NAME':<{width}}  TYPE", file=out)
        for name, types in rows:
            print(f"{name:<{width}}  {types}", file=out)

    run_async(go)
    return 0


def cmd_topic_describe(args: argparse.Namespace, out: TextIO) -> int:

    async def go() -> None:
        async with admin_client(args) as admin:
            status = await admin.describe_topic(args.name)
        found = {b.topic.message_type for b in status.brokers}
        types = _types_text(tuple(t for t in MessageType if t in found))
        print(f"topic {status.name}: {status.messages} messages, type {types}", file=out)
        for b in status.brokers:
            print(f"  {b.broker_name} ({b.address}): {_config_text(b.topic)}", file=out)
            for q in b.queues:
                last = time_text(q.last_store_timestamp_ms)
                print(
                    f"    queue {q.queue_id:<4} offsets {q.min_offset}..{q.max_offset} "
                    f"({q.messages} messages), last stored {last}",
                    file=out,
                )

    run_async(go)
    return 0


def _lines(stream: BinaryIO) -> Iterator[bytes]:
    """The lines of ``stream`` as the bytes they are, each without its newline."""
    for line in stream:
        yield line[:-1] if line.endswith(b"\n") else line


def _bodies(args: argparse.Namespace) -> tuple[bytes | None, Iterable[bytes]]:
    """The one body to send (BODY or --body-file), or None and the lines of standard input."""
    if args.body is not None:
        if args.body_file is not None:
            raise UsageError("give BODY or --body-file, not both")
        problem = not_utf8(args.body)
        if problem is not None:
            raise UsageError(f"BODY {problem}; {_USE_BODY_FILE}")
        return args.body.encode(), ()
    if args.body_file == "-":
        return sys.stdin.buffer.read(), ()
    if args.body_file is not None:
        try:
            return Path(args.body_file).read_bytes(), ()
        except OSError as exc:
            raise UsageError(
                f"--body-file {args.body_file!r}: cannot be read ({exc.strerror or exc})"
            ) from None
    return None, _lines(sys.stdin.buffer)


def cmd_send(args: argparse.Namespace, out: TextIO) -> int:

    props: dict[str, str] = {}
    for item in args.property:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--property {item!r}: use name=value")
        props[name] = value
    when = _delivery(args)
    body, lines = _bodies(args)

    def message(body: bytes) -> Message:
        level, at = when()
        return Message(
            args.topic,
            body,
            tags=args.tag,
            keys=tuple(args.key),
            properties=props,
            delay_level=level,
            deliver_at=at,
        )

    async def go() -> None:
        async with Producer(namesrv(args)) as producer:
            if body is not None:
                result = await producer.send(message(body))
                print(result.message_id, file=out)
                return
            # lines from standard input: sent concurrently (batched by the producer), ids
            # printed in input order
            pending = [producer.send_nowait(message(line)) for line in lines]
            for fut in pending:
                print((await fut).message_id, file=out)

    run_async(go)
    return 0


def _delivery(args: argparse.Namespace) -> Callable[[], tuple[int, datetime | float | None]]:
    """The delay level and delivery time of each message (the time of ``--deliver-in`` is
    counted from when that message is made)."""
    if args.delay_level is not None:
        level: int = args.delay_level
        if not 1 <= level <= MAX_DELAY_LEVEL:
            raise UsageError(f"--delay-level {level}: must be from 1 to {MAX_DELAY_LEVEL}")
        return lambda: (level, None)
    if args.deliver_in is not None:
        seconds: float = args.deliver_in
        if not math.isfinite(seconds) or seconds < 0:
            raise UsageError(f"--deliver-in {seconds}: must be a number of seconds, at least 0")
        return lambda: (0, time.time() + seconds)
    if args.deliver_at is not None:
        at = parse_deliver_at(args.deliver_at)
        return lambda: (0, at)
    return lambda: (0, None)


def parse_deliver_at(text: str) -> datetime:
    """An ISO 8601 time with a UTC offset (or Z): a time without one is refused, not guessed."""
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"--deliver-at {text!r}: use ISO 8601 with a UTC offset, e.g. 2026-11-21T18:30:00+01:00"
        ) from None
    if at.tzinfo is None:
        raise UsageError(
            f"--deliver-at {text!r}: add a UTC offset (+01:00) or Z; a time without one is "
            "ambiguous"
        )
    return at


def cmd_message_get(args: argparse.Namespace, out: TextIO) -> int:

    async def go() -> None:
        async with admin_client(args) as admin:
            found = await admin.get_messages(args.id)
        if len(found) > 1:
            print(
                f"{len(found)} messages are stored with id {args.id} (a retried send can be "
                "stored twice: sends are at-least-once), newest first:",
                file=out,
            )
            print("", file=out)
        for m in found:
            _print_message(m, out)

    run_async(go)
    return 0


def cmd_message_query(args: argparse.Namespace, out: TextIO) -> int:

    async def go() -> None:
        async with admin_client(args) as admin:
            begin, end = parse_time(args.begin, "--begin"), parse_time(args.end, "--end")
            more = False
            if args.key:
                found = await admin.query_messages(args.topic, args.key, begin, end, args.max)
            else:
                window = await admin.messages_between(args.topic, begin, end, args.max)
                found, more = window.messages, window.more
        if not found:
            which = f"with key {args.key}" if args.key else "stored"
            print(f"no message of {args.topic} {which} in that window", file=out)
        for m in found:
            _print_message(m, out)
        if more:
            print(
                f"(the window holds more than {args.max} messages; these are the newest: "
                "narrow --begin/--end, or raise --max up to 1024)",
                file=out,
            )

    run_async(go)
    return 0


def _print_message(m: StoredMessage, out: TextIO) -> None:
    print(f"id:          {m.unique_id}", file=out)
    print(f"topic:       {m.topic} (queue {m.queue_id}, offset {m.queue_offset})", file=out)
    print(f"broker:      {m.broker_name} (physical offset {m.phys_offset})", file=out)
    print(f"tags:        {m.tags or '-'}", file=out)
    print(f"keys:        {' '.join(m.keys) or '-'}", file=out)
    print(f"stored:      {time_text(m.store_timestamp_ms)}", file=out)
    print(f"born:        {time_text(m.born_timestamp_ms)} from {m.born_host or '-'}", file=out)
    for name, value in sorted(m.properties.items()):
        print(f"property:    {name}={value}", file=out)
    if m.body_error:
        print(
            f"body:        ({len(m.body)} stored bytes that cannot be read: {m.body_error})",
            file=out,
        )
    else:
        body = m.body.decode("utf-8", errors="replace")
        print(f"body:        {body if len(body) <= 2000 else body[:2000] + ' ...'}", file=out)
    print("", file=out)


def _config_text(t: TopicConfig) -> str:
    return (
        f"{t.write_queues} write / {t.read_queues} read queues, perm {_perm_text(t.perm)}, "
        f"type {t.message_type.value}"
    )


def _types_text(types: tuple[MessageType, ...]) -> str:
    """A topic's type; the types of its brokers when an update reached only some of them."""
    return "/".join(t.value for t in types) + (" (brokers differ)" if len(types) > 1 else "")


def _perm_text(perm: int) -> str:
    text = ("r" if perm & Perm.READ else "") + ("w" if perm & Perm.WRITE else "")
    return text or "none"
