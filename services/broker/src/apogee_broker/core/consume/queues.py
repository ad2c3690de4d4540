"""A queue's offsets for readers that go by offset and time rather than by group
(``GetQueueOffsets``): the earliest kept, the max, and the first offset stored at or after a
time.

Errors (as every other read of a queue):

====================  ==================  ==================================================
field                 status              rule
====================  ==================  ==================================================
topic                 NOT_FOUND           the topic is not on this broker
topic                 PERMISSION_DENIED   the topic is not readable here
queue_id              INVALID_ARGUMENT    one of the topic's read queues
timestamp_ms          INVALID_ARGUMENT    epoch milliseconds, not negative
====================  ==================  ==================================================
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from apogee.common.errors import InvalidArgumentError
from apogee.store import MessageStore
from apogee_broker.core.checks import check_read_queue, readable_topic
from apogee_broker.core.topics import TopicManager


@dataclass(frozen=True, slots=True)
class QueueOffsets:
    min_offset: int
    max_offset: int
    #: the first offset stored at or after the asked time; None when no time was asked
    timestamp_offset: int | None


async def queue_offsets(
    store: MessageStore,
    topics: TopicManager,
    topic: str,
    queue_id: int,
    timestamp_ms: int | None = None,
) -> QueueOffsets:
    """The offsets of ``topic``/``queue_id``; the time search reads the CommitLog, so it runs
    off the event loop."""
    config = readable_topic(topics, topic)
    check_read_queue(topics, config, queue_id)
    found: int | None = None
    if timestamp_ms is not None:
        if timestamp_ms < 0:
            raise InvalidArgumentError(
                field="timestamp_ms",
                rule=f"must be epoch milliseconds (not negative), got {timestamp_ms}",
            )
        found = await asyncio.to_thread(store.offset_for_timestamp, topic, queue_id, timestamp_ms)
    return QueueOffsets(store.min_offset(topic, queue_id), store.max_offset(topic, queue_id), found)
