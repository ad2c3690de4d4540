"""What the ``apogee`` commands share: their errors, where the nameservers are, running async
code, times, text arguments."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from apogee.cli.local_state import ClusterState, default_data_dir
from apogee.client.admin import AdminClient
from apogee.client.message import not_text_rule
from apogee.common.clock import EPOCH_MS_RULE, MAX_EPOCH_MS


class UsageError(Exception):
    """A problem with the command line itself: the usage, then one line, exit status 2."""


class CommandError(Exception):
    """A failure the command expected (a local cluster that would not start, a command that is
    not installed): one line, exit status 1. Commands other distributions add raise their own
    kinds of it."""


#: The latest time a command takes or shows as a date: 9999-12-31T23:59:59.999Z, in ms.
MAX_TIME_MS: Final = MAX_EPOCH_MS


def data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data) if args.data is not None else default_data_dir()


def namesrv(args: argparse.Namespace) -> str:
    """The nameservers to use: --namesrv, APOGEE_NAMESRV, then the local cluster's."""
    if args.namesrv:
        return str(args.namesrv)
    env = os.environ.get("APOGEE_NAMESRV")
    if env:
        return env
    state = ClusterState.load(data_dir(args).resolve())
    if state is None or not state.nameservers:
        raise UsageError(
            "no nameserver: pass --namesrv host:port, set APOGEE_NAMESRV, "
            "or start a local cluster with `apogee cluster up`"
        )
    return state.namesrv


def admin_client(args: argparse.Namespace) -> AdminClient:
    """An admin client for the nameservers of :func:`namesrv`."""
    return AdminClient(namesrv(args))


def time_text(ms: int, timespec: str = "milliseconds") -> str:
    """A time in ms since the epoch as ISO 8601 in UTC; ``-`` for none (0)."""
    if ms <= 0:
        return "-"
    if ms > MAX_TIME_MS:
        return f"{ms} ms (after 9999-12-31)"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec=timespec)


def run_async(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    async def runner() -> Any:
        return await coro_fn()

    return asyncio.run(runner())


def parse_time(text: str, what: str = "time") -> int:
    """Milliseconds since the epoch from ISO 8601 (naive means UTC) or a number of ms, from
    1970 to 9999; ``what`` names the argument in the error."""
    if text.isdigit():
        return check_time_ms(int(text), what, text)
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"{what} {text!r}: use ISO 8601 (2026-11-21T10:00:00) or ms") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return check_time_ms(int(dt.timestamp() * 1000), what, text)


def not_utf8(text: str) -> str | None:
    """Why ``text`` from the command line is not UTF-8 text, naming its first bad byte; None
    when it is. (Python hands on each byte of ``argv`` that is not UTF-8 as a lone surrogate,
    ``errors="surrogateescape"``, which cannot be sent as text.)"""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        error = exc
    else:
        return None
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no byte stands for (not from a POSIX argv)
        return f"{text!r} {not_text_rule(error)}"
    pos = len(text[: error.start].encode())
    return f"{raw!r} must be UTF-8 text, and byte 0x{raw[pos]:02x} at position {pos} is not"


def text_arg(text: str) -> str:
    """An argparse ``type`` for text the command sends (a tag expression, a key): refused as
    a usage error naming the option when it is not UTF-8 (see :func:`not_utf8`)."""
    problem = not_utf8(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def check_time_ms(ms: int, what: str, text: object) -> int:
    """``ms``, if it is a time from 1970-01-01 to 9999-12-31 UTC; else the usage error."""
    if not 0 <= ms <= MAX_TIME_MS:
        raise UsageError(f"{what} {text!r}: {EPOCH_MS_RULE}")
    return ms
