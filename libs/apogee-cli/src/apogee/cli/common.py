"""What the ``apogee`` commands share: where the nameservers are, running async code, times."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from apogee.cli import local_cluster
from apogee.client.admin import AdminClient


class UsageError(Exception):
    """A problem with the command line itself."""


def data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data) if args.data is not None else local_cluster.default_data_dir()


def namesrv(args: argparse.Namespace) -> str:
    """The nameservers to use: --namesrv, APOGEE_NAMESRV, then the local cluster's."""
    if args.namesrv:
        return str(args.namesrv)
    env = os.environ.get("APOGEE_NAMESRV")
    if env:
        return env
    state = local_cluster.ClusterState.load(data_dir(args).resolve())
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
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec=timespec)


def run_async(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    async def runner() -> Any:
        return await coro_fn()

    return asyncio.run(runner())


def parse_time(text: str) -> int:
    """Milliseconds since the epoch from ISO 8601 (naive means UTC) or a number of ms."""
    if text.isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"time {text!r}: use ISO 8601 (2026-11-21T10:00:00) or ms") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)
