"""GetQueueOffsets' core: a queue's bounds and the offset for a time, and what it refuses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from apogee.common.errors import (
    InvalidArgumentError,
    InvalidQueueIdError,
    PermissionDeniedError,
    UnknownTopicError,
)
from apogee.store import Message, MessageStore, StoreConfig
from apogee.testkit.store import dispatched
from apogee_broker.core.consume.queues import queue_offsets
from apogee_broker.core.topics import TopicConfig, TopicManager

pytestmark = pytest.mark.unit


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    config = StoreConfig(commitlog_file_size=1 << 20, max_message_size=64 * 1024)
    with MessageStore.open(tmp_path / "store", config, start_retention=False) as s:
        yield s


@pytest.fixture
def topics(tmp_path: Path) -> TopicManager:
    tm = TopicManager(tmp_path, broker_name="b1")
    tm.load()
    tm.put(TopicConfig("T", 2, 2))
    tm.put(TopicConfig("WriteOnly", 1, 1, perm=2))
    return tm


async def test_bounds_and_the_offset_for_a_time(store: MessageStore, topics: TopicManager) -> None:
    results = [store.append(Message("T", f"m{i}".encode(), queue_id=0))[0] for i in range(4)]
    dispatched(store)
    found = await queue_offsets(store, topics, "T", 0)
    assert (found.min_offset, found.max_offset, found.timestamp_offset) == (0, 4, None)
    stamp = results[2].store_timestamp
    at = await queue_offsets(store, topics, "T", 0, stamp)
    expected = next(i for i, r in enumerate(results) if r.store_timestamp >= stamp)
    assert at.timestamp_offset == expected
    assert (await queue_offsets(store, topics, "T", 0, stamp + 60_000)).timestamp_offset == 4
    empty = await queue_offsets(store, topics, "T", 1, 0)
    assert (empty.min_offset, empty.max_offset, empty.timestamp_offset) == (0, 0, 0)


async def test_refusals_name_the_field_and_rule(store: MessageStore, topics: TopicManager) -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"^timestamp_ms: must be epoch milliseconds \(not negative\), got -1$",
    ):
        await queue_offsets(store, topics, "T", 0, -1)
    with pytest.raises(InvalidQueueIdError, match=r"^queue_id 2: must be between 0 and 1"):
        await queue_offsets(store, topics, "T", 2)
    with pytest.raises(PermissionDeniedError, match="read permission R is missing"):
        await queue_offsets(store, topics, "WriteOnly", 0)
    with pytest.raises(UnknownTopicError, match="topic 'Nope'"):
        await queue_offsets(store, topics, "Nope", 0)
