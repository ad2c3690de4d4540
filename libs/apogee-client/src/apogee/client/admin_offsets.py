"""Offsets of a topic's queues, as :class:`~apogee.client.admin.AdminClient` reads and moves them.

- :func:`reset` moves a consumer group's offsets of a topic on every broker that has it (to the
  earliest kept, the end, or a time), and the group's connected consumers continue from there;
- :func:`commit` sets a group's offsets to the ones given, queue by queue, as a consumer
  commits them (what a stream that keeps its own progress, such as Spark's, reports);
- :func:`offsets_for_time` finds, in each queue, the first message stored at or after a time.

Each speaks to the brokers at once; a broker that fails is named in the error raised, after the
others have done their part (:func:`raise_partial`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from apogee.client._rpc import ChannelPool, rpc
from apogee.client.admin_info import BrokerInfo, drop_not_found, on_each
from apogee.client.groups import ResetOffset
from apogee.client.producer.routes import MessageQueue
from apogee.client.reader import get_queue_offsets
from apogee.common.clock import check_epoch_ms
from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    UnavailableError,
    UnknownTopicError,
)
from apogee.common.topics import validate_topic
from apogee.v1 import consumer_pb2

__all__ = [
    "QueueOffset",
    "check_offsets",
    "check_timestamp",
    "commit",
    "offsets_for_time",
    "raise_partial",
    "reset",
    "reset_request",
]


@dataclass(frozen=True, slots=True)
class QueueOffset:
    """An offset of one queue of a topic on one broker: where a time falls in it
    (:meth:`AdminClient.offsets_for_time`), or what was committed for a group
    (:meth:`AdminClient.commit_offsets`)."""

    broker_name: str
    topic: str
    queue_id: int
    offset: int


def check_timestamp(timestamp_ms: object) -> int:
    return check_epoch_ms("timestamp_ms", timestamp_ms)


def raise_partial(
    errors: Sequence[ApogeeError], what: str, done: str, done_on: Iterable[str]
) -> None:
    """Raise for ``errors`` of an operation that succeeded on the brokers ``done_on`` only:
    the first error that is not retriable as it is, else an :class:`UnavailableError` naming
    them all, and where it was ``done`` (running the operation again is safe)."""
    if not errors:
        return
    fatal = next((e for e in errors if not e.retriable), None)
    if fatal is not None:
        raise fatal
    raise UnavailableError(
        what=what,
        detail="; ".join(str(e) for e in errors)
        + f" ({done}: {', '.join(sorted(done_on)) or 'no broker'}; run it again)",
    )


# -- reset ------------------------------------------------------------------------------------


def reset_request(
    group: str, topic: str, earliest: bool, latest: bool, timestamp_ms: int | None
) -> consumer_pb2.ResetOffsetsRequest:
    """The request of a reset to exactly one of the three targets (checked)."""
    chosen = [earliest is True, latest is True, timestamp_ms is not None]
    if sum(chosen) != 1:
        raise InvalidArgumentError(
            field="to",
            rule="give exactly one of earliest=True, latest=True or timestamp_ms=<epoch ms>",
        )
    request = consumer_pb2.ResetOffsetsRequest(group=group, topic=topic)
    if earliest:
        request.earliest = True
    elif latest:
        request.latest = True
    else:
        request.timestamp_ms = check_timestamp(timestamp_ms)
    return request


async def reset(
    pool: ChannelPool,
    targets: Sequence[BrokerInfo],
    request: consumer_pb2.ResetOffsetsRequest,
    timeout: float,
) -> list[ResetOffset]:
    """``request`` on every broker of ``targets``; where each queue's offset went, sorted by
    broker and queue."""
    group, topic = request.group, request.topic

    async def one(b: BrokerInfo) -> list[ResetOffset]:
        resp = await rpc(
            b.where, pool.consumer_admin(b.address).ResetOffsets(request, timeout=timeout)
        )
        return [
            ResetOffset(b.broker_name, o.topic or topic, o.queue_id, o.offset) for o in resp.offsets
        ]

    outcomes = drop_not_found(await on_each(targets, one))
    errors = [o for o in outcomes if isinstance(o, ApogeeError)]
    done = sorted(
        (r for o in outcomes if not isinstance(o, ApogeeError) for r in o),
        key=lambda r: (r.broker_name, r.queue_id),
    )
    raise_partial(
        errors,
        f"resetting the offsets of group {group!r} on topic {topic!r}",
        "reset on",
        {r.broker_name for r in done},
    )
    if not done:
        raise UnknownTopicError(topic=topic, detail="is not on any live broker")
    return done


# -- commit -----------------------------------------------------------------------------------


def check_offsets(offsets: object) -> dict[str, list[tuple[MessageQueue, int]]]:
    """``offsets`` (queue -> offset) checked, by broker name."""
    if not isinstance(offsets, Mapping):
        raise InvalidArgumentError(
            field="offsets", rule=f"must map MessageQueue to offset, got {type(offsets).__name__}"
        )
    by_broker: dict[str, list[tuple[MessageQueue, int]]] = {}
    for mq, offset in offsets.items():
        if not isinstance(mq, MessageQueue):
            raise InvalidArgumentError(
                field="offsets", rule=f"keys must be MessageQueue, got {mq!r}"
            )
        validate_topic(mq.topic)
        if not isinstance(mq.queue_id, int) or mq.queue_id < 0:
            raise InvalidArgumentError(
                field="offsets", rule=f"{mq}: the queue id must be an int >= 0"
            )
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise InvalidArgumentError(
                field="offsets", rule=f"{mq}: the offset must be an int >= 0, got {offset!r}"
            )
        by_broker.setdefault(mq.broker_name, []).append((mq, offset))
    return by_broker


async def commit(
    pool: ChannelPool,
    live: Sequence[BrokerInfo],
    group: str,
    by_broker: Mapping[str, Sequence[tuple[MessageQueue, int]]],
    client_id: str,
    timeout: float,
) -> list[QueueOffset]:
    """Commit ``group``'s offsets on the brokers that hold the queues; what was committed,
    sorted by broker, topic and queue. Brokers that are not live or fail are named in the
    error raised once the others have committed."""
    by_name = {b.broker_name: b for b in live}
    targets = [by_name[name] for name in sorted(by_broker) if name in by_name]
    errors: list[ApogeeError] = [
        UnavailableError(
            what=f"broker {name!r}",
            detail="it is not registered with the nameservers "
            f"(live: {', '.join(sorted(by_name))})",
        )
        for name in sorted(by_broker)
        if name not in by_name
    ]

    async def one(b: BrokerInfo) -> list[QueueOffset]:
        entries = by_broker[b.broker_name]
        request = consumer_pb2.CommitOffsetsRequest(
            group=group,
            client_id=client_id,
            offsets=[
                consumer_pb2.QueueOffset(topic=mq.topic, queue_id=mq.queue_id, offset=offset)
                for mq, offset in entries
            ],
        )
        await rpc(b.where, pool.consumer(b.address).CommitOffsets(request, timeout=timeout))
        return [QueueOffset(b.broker_name, mq.topic, mq.queue_id, o) for mq, o in entries]

    done: list[QueueOffset] = []
    for outcome in await on_each(targets, one):
        if isinstance(outcome, ApogeeError):
            errors.append(outcome)
        else:
            done += outcome
    raise_partial(
        errors,
        f"committing the offsets of group {group!r}",
        "committed on",
        {o.broker_name for o in done},
    )
    return sorted(done, key=lambda o: (o.broker_name, o.topic, o.queue_id))


# -- offsets for a time -------------------------------------------------------------------------


async def offsets_for_time(
    pool: ChannelPool,
    topic: str,
    queues: Sequence[tuple[str, str, int]],
    timestamp_ms: int,
    timeout: float,
) -> list[QueueOffset]:
    """For each ``(broker name, address, queue id)`` of ``topic``, the first offset stored at
    or after ``timestamp_ms`` (the max offset when every message is older), all at once."""

    async def one(broker: str, address: str, queue_id: int) -> QueueOffset:
        resp = await get_queue_offsets(
            pool, address, MessageQueue(topic, broker, queue_id), timestamp_ms, timeout
        )
        return QueueOffset(broker, topic, queue_id, int(resp.timestamp_offset))

    found: list[QueueOffset] = []
    for outcome in await asyncio.gather(*(one(*q) for q in queues), return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome
        found.append(outcome)
    return sorted(found, key=lambda o: (o.broker_name, o.queue_id))
