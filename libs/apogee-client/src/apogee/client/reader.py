"""Read a queue by offset and by time, with no consumer group: :class:`QueueReader`.

A consumer group tracks where it is; a reader is told where to read. It answers a queue's
earliest and max offsets and the first offset stored at or after a time, and reads a queue
(one broker's queue of a topic) from one offset up to another::

    async with QueueReader("127.0.0.1:9876") as reader:
        for queue in await reader.queues("Orders"):
            bounds = await reader.offsets(queue)
            async for m in reader.read(queue, bounds.min_offset, bounds.max_offset):
                print(m.queue_offset, m.body)

Offsets are the queue's own (0, 1, 2, ... per queue), as in every ``ReceivedMessage``. A range
is half open: ``read(queue, a, b)`` yields the messages at offsets ``a <= offset < b`` that
match the tag expression, in queue order. The reader commits nothing and joins no group, so it
never moves a group's offsets; the command line's ``apogee consume`` without ``--group`` and
``apogee message read`` read through it.

Errors: :class:`~apogee.common.errors.OffsetDeletedError` when a read starts below what
retention kept (unless ``skip_deleted`` is set, which moves on from the earliest kept offset
with a warning), :class:`~apogee.common.errors.InvalidArgumentError` naming the field for a bad
range, and the broker's own errors (unknown topic, a queue id out of range) as they come.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Final

from apogee.client._rpc import ChannelPool, NameServerClient, parse_addresses, rpc
from apogee.client.consumer.config import default_client_id
from apogee.client.consumer.rebalance import ReadRoute, fetch_route
from apogee.client.consumer.records import ReceivedMessage, decode_records
from apogee.client.message import check_text
from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import InvalidArgumentError, OffsetDeletedError
from apogee.rpc.security import ClientSecurity
from apogee.v1 import consumer_pb2

log = logging.getLogger(__name__)

#: The group name a reader's pulls carry; the broker commits nothing for it.
READER_GROUP: Final = "APOGEE_QUEUE_READER"
#: The most messages one pull asks for.
MAX_BATCH: Final = 1024


@dataclass(frozen=True, slots=True)
class QueueBounds:
    """A queue's offsets: the earliest kept by retention, and one past its last message."""

    min_offset: int
    max_offset: int

    @property
    def messages(self) -> int:
        return self.max_offset - self.min_offset


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """One pull's worth of a queue: the messages, where the next read starts, and the
    queue's bounds as the broker saw them."""

    messages: list[ReceivedMessage]
    next_offset: int
    min_offset: int
    max_offset: int


def _check_offset(field: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(
            field=field, rule=f"must be an offset (an int >= 0), got {value!r}"
        )
    return value


async def get_queue_offsets(
    pool: ChannelPool,
    address: str,
    queue: MessageQueue,
    timestamp_ms: int | None,
    timeout: float,
) -> consumer_pb2.GetQueueOffsetsResponse:
    """The broker's ``GetQueueOffsets`` for ``queue`` (consumers starting at a time use it too)."""
    request = consumer_pb2.GetQueueOffsetsRequest(topic=queue.topic, queue_id=queue.queue_id)
    if timestamp_ms is not None:
        request.timestamp_ms = timestamp_ms
    return await rpc(
        f"broker {queue.broker_name} ({address})",
        pool.consumer(address).GetQueueOffsets(request, timeout=timeout),
    )


class QueueReader:
    """Reads queues by offset and time; use as ``async with QueueReader(namesrv) as reader``.

    ``batch_size`` messages are pulled at a time (at most 1,024, and the broker's own cap);
    ``verify_crc`` checks every record's CRC-32 as consumers do."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        *,
        timeout: float = 3.0,
        batch_size: int = 256,
        verify_crc: bool = True,
        security: ClientSecurity | None = None,
    ) -> None:
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise InvalidArgumentError(
                field="timeout", rule=f"must be a number above 0, got {timeout!r}"
            )
        if (
            not isinstance(batch_size, int)
            or isinstance(batch_size, bool)
            or not 1 <= batch_size <= MAX_BATCH
        ):
            raise InvalidArgumentError(
                field="batch_size", rule=f"must be between 1 and {MAX_BATCH}, got {batch_size!r}"
            )
        self.timeout = float(timeout)
        self.batch_size = batch_size
        self.verify_crc = verify_crc
        self.client_id = default_client_id()
        self._pool = ChannelPool(security)
        self._namesrv = NameServerClient(parse_addresses(namesrv), self._pool, self.timeout)
        self._routes: dict[str, ReadRoute] = {}

    async def __aenter__(self) -> QueueReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._pool.close()

    # -- where ---------------------------------------------------------------------------------

    async def queues(self, topic: str) -> list[MessageQueue]:
        """The topic's readable queues, sorted by broker name and queue id (a fresh route)."""
        route = self._routes[topic] = await fetch_route(self._namesrv, topic)
        return list(route.queues)

    async def _address(self, queue: MessageQueue) -> str:
        if not isinstance(queue, MessageQueue):
            raise InvalidArgumentError(
                field="queue", rule=f"must be a MessageQueue (from queues()), got {queue!r}"
            )
        route = self._routes.get(queue.topic)
        if route is None or queue.broker_name not in route.addresses:
            route = self._routes[queue.topic] = await fetch_route(self._namesrv, queue.topic)
        address = route.addresses.get(queue.broker_name)
        if address is None:
            raise InvalidArgumentError(
                field="queue",
                rule=f"broker {queue.broker_name!r} has no readable queue of topic "
                f"{queue.topic!r} (brokers: {', '.join(sorted(route.addresses)) or 'none'})",
            )
        return address

    async def _offsets(
        self, queue: MessageQueue, timestamp_ms: int | None
    ) -> consumer_pb2.GetQueueOffsetsResponse:
        address = await self._address(queue)
        return await get_queue_offsets(self._pool, address, queue, timestamp_ms, self.timeout)

    async def offsets(self, queue: MessageQueue) -> QueueBounds:
        """The queue's earliest kept offset and its max (one past its last message)."""
        resp = await self._offsets(queue, None)
        return QueueBounds(resp.min_offset, resp.max_offset)

    async def offset_for_timestamp(self, queue: MessageQueue, timestamp_ms: int) -> int:
        """The first offset whose message was stored at or after ``timestamp_ms`` (epoch ms);
        the max offset when every message is older."""
        _check_offset("timestamp_ms", timestamp_ms)
        return (await self._offsets(queue, timestamp_ms)).timestamp_offset

    # -- reading -------------------------------------------------------------------------------

    async def read_batch(
        self,
        queue: MessageQueue,
        offset: int,
        max_messages: int | None = None,
        *,
        tag_expression: str = "*",
        sql: str = "",
    ) -> ReadBatch:
        """One pull from ``offset``: up to ``max_messages`` messages (the reader's batch size
        by default), those matching ``tag_expression`` and the SQL92 condition ``sql`` (if
        any; filtered at the broker). An empty batch whose ``next_offset`` is past ``offset``
        skipped messages the filter did not match; one at the max offset means nothing more
        is there."""
        _check_offset("offset", offset)
        count = self.batch_size if max_messages is None else max_messages
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_BATCH:
            raise InvalidArgumentError(
                field="max_messages", rule=f"must be between 1 and {MAX_BATCH}, got {count!r}"
            )
        check_text("tag_expression", tag_expression)
        check_text("sql", sql)
        address = await self._address(queue)
        request = consumer_pb2.PullRequest(
            group=READER_GROUP,
            topic=queue.topic,
            queue_id=queue.queue_id,
            offset=offset,
            max_messages=count,
            tag_expression=tag_expression,
            sql_expression=sql,
            client_id=self.client_id,
        )
        what = f"broker {queue.broker_name} ({address})"
        answer = await self._pool.pull(address, request, self.timeout, what)
        resp = answer.response
        if resp.status == consumer_pb2.PULL_OFFSET_TOO_SMALL:
            raise OffsetDeletedError(
                what=f"offset of {queue.topic}/{queue.broker_name}/{queue.queue_id}",
                offset=offset,
                earliest=resp.next_offset,
            )
        if resp.status == consumer_pb2.PULL_OFFSET_OVERFLOW:
            raise InvalidArgumentError(
                field="offset",
                rule=f"{offset} is past the max offset {resp.max_offset} of "
                f"{queue.topic}/{queue.broker_name}/{queue.queue_id}",
            )
        messages: list[ReceivedMessage] = []
        if resp.status == consumer_pb2.PULL_FOUND:
            messages = decode_records(
                answer.records,
                resp.broker_name or queue.broker_name,
                queue.topic,
                queue.queue_id,
                offset,
                self.verify_crc,
                start=answer.start,
                end=answer.end,
            )
        next_offset = resp.next_offset if resp.next_offset > offset or messages else offset
        return ReadBatch(messages, next_offset, resp.min_offset, resp.max_offset)

    async def read(
        self,
        queue: MessageQueue,
        start: int,
        end: int | None = None,
        *,
        tag_expression: str = "*",
        sql: str = "",
        skip_deleted: bool = False,
    ) -> AsyncIterator[ReceivedMessage]:
        """The messages at offsets ``start <= offset < end`` in queue order; ``end=None`` reads
        up to the max offset as it is when the read starts. A start below what retention kept
        raises :class:`OffsetDeletedError`, or with ``skip_deleted`` logs a warning and reads
        from the earliest kept offset."""
        _check_offset("start", start)
        if end is None:
            end = (await self.offsets(queue)).max_offset
            if start > end:
                raise InvalidArgumentError(
                    field="start",
                    rule=f"{start} is past the max offset {end} of "
                    f"{queue.topic}/{queue.broker_name}/{queue.queue_id}",
                )
        _check_offset("end", end)
        if end < start:
            raise InvalidArgumentError(field="end", rule=f"{end} is before start {start}")
        offset = start
        while offset < end:
            try:
                batch = await self.read_batch(
                    queue,
                    offset,
                    min(self.batch_size, end - offset),
                    tag_expression=tag_expression,
                    sql=sql,
                )
            except OffsetDeletedError as err:
                if not skip_deleted:
                    raise
                earliest = int(err.details["earliest"])
                log.warning("%s; reading on from %d", err, earliest)
                offset = max(earliest, offset + 1)
                continue
            for m in batch.messages:
                if m.queue_offset >= end:
                    return
                yield m
            if batch.next_offset <= offset:
                return  # nothing more is there now
            offset = batch.next_offset
