"""Helpers for tests that run a broker in-process: Apogee's own, and users'.

::

    async with running_broker(small_settings(tmp_path / "broker")) as broker:
        channel = grpc.aio.insecure_channel(broker.address)

:func:`decode_records` turns a pull's ``records`` into messages, checked as a client checks them;
:func:`pull` makes one pull on ``Consumer.PullStream``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc.aio

from apogee.codec import HEAD, StoredMessage, decode
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import CorruptRecordError
from apogee.common.settings import load
from apogee.rpc.mux import MuxClient
from apogee.v1 import consumer_pb2
from apogee_broker.app import BrokerApp
from apogee_broker.settings import BrokerSettings

KiB = 1 << 10
MiB = 1 << 20


def small_settings(data_dir: Path, **overrides: Any) -> BrokerSettings:
    """Settings for a broker under ``data_dir`` on free ports of 127.0.0.1 (gRPC and
    metrics), registering nowhere, with a store shrunk so that tests roll its files quickly
    (1 MiB CommitLog files, 256 KiB messages at most). ``overrides`` may be strings, as in a
    config file."""
    values: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "namesrv": "",
        "data_dir": data_dir,
        "commitlog_file_size": MiB,
        "max_message_size": 256 * KiB,
        "consume_queue_entries_per_file": 1024,
        "index_slots": 997,
        "index_entries_per_file": 4096,
        "shutdown_grace_s": 2.0,
        "register_timeout_s": 2.0,
    }
    values.update(overrides)
    return load(BrokerSettings, "broker", None, None, **values)


@contextlib.asynccontextmanager
async def running_broker(
    settings: BrokerSettings, clock: Clock = SYSTEM_CLOCK
) -> AsyncIterator[BrokerApp]:
    """A started :class:`BrokerApp`, stopped on exit (even when the body fails)."""
    app = BrokerApp(settings, clock)
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


def decode_records(records: bytes) -> list[StoredMessage]:
    """The messages of a pull's ``records`` (whole CommitLog records back to back), each
    checked (magic, size, CRC); raises :class:`~apogee.common.errors.CorruptRecordError`."""
    out: list[StoredMessage] = []
    pos = 0
    while pos < len(records):
        where = f"record at byte {pos}"
        if len(records) - pos < HEAD.size or HEAD.unpack_from(records, pos)[0] <= 0:
            raise CorruptRecordError(where=where, detail="no record header here")
        size = HEAD.unpack_from(records, pos)[0]
        out.append(decode(records, where, True, pos, size))
        pos += size
    return out


PULL_STREAM = "/apogee.v1.Consumer/PullStream"


def pull_stream(
    channel: grpc.aio.Channel, what: str = "broker"
) -> MuxClient[consumer_pb2.PullResponse]:
    """A client of the broker's ``Consumer.PullStream`` (``await pulls.call(request bytes,
    timeout, unary)``; close it with ``await pulls.close()``)."""
    return MuxClient(channel, PULL_STREAM, consumer_pb2.PullStreamResponse.FromString, what)


async def pull(
    channel: grpc.aio.Channel, request: consumer_pb2.PullRequest, timeout: float = 5.0
) -> consumer_pb2.PullResponse:
    """One pull on a stream of its own; raises the broker's error as an ``ApogeeError``."""
    pulls = pull_stream(channel)
    try:
        return await pulls.call(request.SerializeToString(), timeout, _no_unary)
    finally:
        await pulls.close()


async def _no_unary() -> consumer_pb2.PullResponse:
    raise AssertionError("the broker serves Consumer.PullStream")
