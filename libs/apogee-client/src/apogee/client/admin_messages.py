"""Message lookups of :class:`~apogee.client.admin.AdminClient`, over every live broker.

- :func:`first_by_id` asks every broker at once for a unique id and takes the first hit;
- :func:`all_by_id` gathers every copy stored under the id (a retried send may be stored twice);
- :func:`query` asks every broker for a topic's messages by key, or by time alone, and merges
  their answers newest first.

A broker that answers NOT_FOUND does not have it; one that does not answer is named in the
error when no other has it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from apogee.client._rpc import ChannelPool, rpc
from apogee.client.admin_info import BrokerInfo, all_or_first_error, drop_not_found, on_each
from apogee.client.message import StoredMessage, check_text
from apogee.common.clock import check_epoch_ms
from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from apogee.common.topics import validate_topic
from apogee.v1 import broker_pb2

__all__ = [
    "MAX_QUERY_MESSAGES",
    "MessageWindow",
    "all_by_id",
    "check_query",
    "check_unique_id",
    "first_by_id",
    "query",
]

#: A broker answers at most this many messages to one query.
MAX_QUERY_MESSAGES: Final = 1024


@dataclass(frozen=True, slots=True)
class MessageWindow:
    """What :meth:`AdminClient.messages_between` found: the newest messages of the window,
    newest first, and whether it holds more than were answered."""

    messages: list[StoredMessage]
    more: bool


def check_unique_id(unique_id: object) -> None:
    if not isinstance(unique_id, str) or not unique_id.strip():
        raise InvalidArgumentError(field="unique_id", rule="must be a non-empty string")
    check_text("unique_id", unique_id)


async def _by_id(
    pool: ChannelPool, b: BrokerInfo, unique_id: str, timeout: float
) -> list[StoredMessage]:
    """What broker ``b`` stores with ``unique_id``, newest first (NOT_FOUND when nothing)."""
    resp = await rpc(
        b.where,
        pool.broker(b.address).GetMessage(
            broker_pb2.GetMessageRequest(unique_id=unique_id), timeout=timeout
        ),
    )
    return [StoredMessage.from_pb(m, b.broker_name) for m in (resp.message, *resp.more)]


async def first_by_id(
    pool: ChannelPool, targets: Sequence[BrokerInfo], unique_id: str, timeout: float
) -> StoredMessage:
    """The message with ``unique_id`` from whichever broker of ``targets`` answers first."""
    unreachable: list[str] = []
    tasks = [asyncio.ensure_future(_by_id(pool, b, unique_id, timeout)) for b in targets]
    try:
        for done in asyncio.as_completed(tasks):
            try:
                return (await done)[0]
            except ApogeeError as err:
                if err.kind.code != "NOT_FOUND":
                    unreachable.append(f"{err}")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    raise _id_not_found(unique_id, unreachable)


async def all_by_id(
    pool: ChannelPool, targets: Sequence[BrokerInfo], unique_id: str, timeout: float
) -> list[StoredMessage]:
    """Every message stored with ``unique_id`` on the brokers of ``targets``, newest first."""
    answers = await asyncio.gather(
        *(_by_id(pool, b, unique_id, timeout) for b in targets), return_exceptions=True
    )
    found: list[StoredMessage] = []
    unreachable: list[str] = []
    for a in answers:
        if isinstance(a, ApogeeError):
            if a.kind.code != "NOT_FOUND":
                unreachable.append(f"{a}")
        elif isinstance(a, BaseException):
            raise a
        else:
            found.extend(a)
    if not found:
        raise _id_not_found(unique_id, unreachable)
    return sorted(found, key=lambda m: m.store_timestamp_ms, reverse=True)


def _id_not_found(unique_id: str, unreachable: list[str]) -> ApogeeError:
    """No broker that answered has ``unique_id``: unavailable when some did not answer."""
    if unreachable:
        return UnavailableError(
            what=f"message {unique_id}",
            detail="not found on the brokers that answered; " + "; ".join(unreachable),
        )
    return NotFoundError(what=f"message {unique_id}", detail="no live broker has it")


def check_query(topic: str, begin_ms: int, end_ms: int, max_messages: int) -> None:
    validate_topic(topic)
    if not isinstance(max_messages, int) or not 1 <= max_messages <= MAX_QUERY_MESSAGES:
        raise InvalidArgumentError(
            field="max_messages",
            rule=f"must be an integer from 1 to {MAX_QUERY_MESSAGES}, got {max_messages!r}",
        )
    check_epoch_ms("begin_ms", begin_ms)
    check_epoch_ms("end_ms", end_ms)
    if end_ms and end_ms < begin_ms:
        raise InvalidArgumentError(
            field="end_ms",
            rule=f"must not be before begin_ms (the range {begin_ms}..{end_ms} is reversed)",
        )


async def query(
    pool: ChannelPool,
    targets: Sequence[BrokerInfo],
    request: broker_pb2.QueryMessagesRequest,
    timeout: float,
) -> tuple[list[StoredMessage], bool]:
    """``request`` (checked by :func:`check_query`) on every broker of ``targets``: the
    newest ``max_messages`` of their answers, newest first, and whether there were more."""

    async def one(b: BrokerInfo) -> tuple[list[StoredMessage], bool]:
        resp = await rpc(b.where, pool.broker(b.address).QueryMessages(request, timeout=timeout))
        return [StoredMessage.from_pb(m, b.broker_name) for m in resp.messages], resp.more

    outcomes = await on_each(targets, one)
    found = all_or_first_error(drop_not_found(outcomes))
    merged = [m for per_broker, _ in found for m in per_broker]
    merged.sort(key=lambda m: (m.store_timestamp_ms, m.phys_offset), reverse=True)
    max_messages = request.max_messages
    more = any(m for _, m in found) or len(merged) > max_messages
    return merged[:max_messages], more
