"""Finding stored messages: by unique id; within a time range by key (through the IndexFile) or
all of them (through the ConsumeQueues' store times).

Lookups read the store's files, so they run on a worker thread and never hold up the event loop
that serves sends. Also what DescribeTopic reports per queue.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Final

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import InvalidArgumentError, NotFoundError
from apogee.store import GetStatus, MessageStore, StoredMessage
from apogee_broker.core.topics import TopicConfig, TopicManager

#: QueryMessages answers at most this many messages; 0 asks for the default.
MAX_QUERY_MESSAGES: Final = 1024
DEFAULT_QUERY_MESSAGES: Final = 64
#: How long a lookup waits for the index to cover what was appended before it.
DISPATCH_WAIT_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class QueueState:
    queue_id: int
    min_offset: int
    max_offset: int
    #: store time of the newest message, 0 when the queue is empty
    last_store_timestamp_ms: int


class MessageLookup:
    def __init__(
        self,
        store: MessageStore,
        topics: TopicManager,
        *,
        broker_name: str,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.topics = topics
        self.broker_name = broker_name
        self.clock = clock

    async def by_unique_id(self, unique_id: str) -> StoredMessage:
        """The message with ``unique_id`` (the newest, should it repeat), or
        :class:`NotFoundError`."""
        return (await self.all_by_unique_id(unique_id))[0]

    async def all_by_unique_id(self, unique_id: str) -> list[StoredMessage]:
        """Every message stored with ``unique_id``, newest first (at least one), or
        :class:`NotFoundError`."""
        if not unique_id:
            raise InvalidArgumentError(field="unique_id", rule="must not be empty")
        found = await asyncio.to_thread(self._all_by_unique_id, unique_id)
        if not found:
            raise NotFoundError(
                what=f"message {unique_id!r}",
                detail=f"broker {self.broker_name} stores no message with this unique id "
                "(it may be on another broker, or removed by retention)",
            )
        return found

    async def query(
        self, topic: str, key: str, begin_ms: int, end_ms: int, max_messages: int
    ) -> tuple[list[StoredMessage], bool]:
        """Messages of ``topic`` stored within ``[begin_ms, end_ms]`` (``end_ms`` 0: now) with
        ``key`` (through the index), or every one when ``key`` is empty (through the queues'
        store times); newest first, at most ``max_messages`` (0: the default of 64). Also
        whether a lookup without key left messages of the window out."""
        self.topics.require(topic)
        if " " in key:
            raise InvalidArgumentError(field="key", rule=f"{key!r}: a key has no spaces")
        end = end_ms or self.clock.time_ms()
        if begin_ms < 0:
            raise InvalidArgumentError(
                field="begin_ms", rule=f"must not be negative, got {begin_ms}"
            )
        if end_ms < 0:
            raise InvalidArgumentError(field="end_ms", rule=f"must not be negative, got {end_ms}")
        if begin_ms > end:
            raise InvalidArgumentError(field="begin_ms", rule=f"{begin_ms} is after end_ms {end}")
        if max_messages > MAX_QUERY_MESSAGES:
            raise InvalidArgumentError(
                field="max_messages", rule=f"at most {MAX_QUERY_MESSAGES}, got {max_messages}"
            )
        count = max_messages or DEFAULT_QUERY_MESSAGES
        if key:
            return await asyncio.to_thread(self._by_key, topic, key, begin_ms, end, count), False
        return await asyncio.to_thread(self._by_time, topic, begin_ms, end, count)

    # Lookups first let the index catch up with what was appended before them (bounded), so a
    # message is found right after its send was acknowledged.

    def _all_by_unique_id(self, unique_id: str) -> list[StoredMessage]:
        self.store.wait_dispatched(DISPATCH_WAIT_S)
        return self.store.all_by_unique_id(unique_id)

    def _by_key(
        self, topic: str, key: str, begin_ms: int, end_ms: int, count: int
    ) -> list[StoredMessage]:
        self.store.wait_dispatched(DISPATCH_WAIT_S)
        return self.store.by_key(topic, key, begin_ms, end_ms, count)

    def _by_time(
        self, topic: str, begin_ms: int, end_ms: int, count: int
    ) -> tuple[list[StoredMessage], bool]:
        self.store.wait_dispatched(DISPATCH_WAIT_S)
        return self.store.by_time(topic, begin_ms, end_ms, count)

    async def queues(self, topic: TopicConfig) -> list[QueueState]:
        """Offsets and the newest store time of each queue of ``topic``."""
        return await asyncio.to_thread(self._queues, topic)

    def _queues(self, topic: TopicConfig) -> list[QueueState]:
        self.store.wait_dispatched(DISPATCH_WAIT_S)
        out: list[QueueState] = []
        for q in range(topic.queue_count):
            lo = self.store.min_offset(topic.name, q)
            hi = self.store.max_offset(topic.name, q)
            last = 0
            if hi > lo:
                got = self.store.get(topic.name, q, hi - 1, 1)
                if got.status is GetStatus.FOUND and got.messages:
                    last = got.messages[0].store_timestamp
            out.append(QueueState(q, lo, hi, last))
        return out
