"""QueueReader against real nameservers and brokers: offsets, time search, ranges, filters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.client import AdminClient, Message, MessageQueue, Producer, QueueReader, SendResult
from apogee.common.errors import InvalidArgumentError, InvalidQueueIdError, UnknownTopicError
from apogee.testkit.cluster import InProcessCluster

pytestmark = pytest.mark.integration

TOPIC = "ReaderTopic"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(tmp_path) as c:
        async with AdminClient(c.namesrv) as admin:
            await admin.create_or_update_topic(TOPIC, queues=1, brokers=["broker-a"])
        yield c


async def send_all(
    cluster: InProcessCluster, bodies: list[bytes], tag: str = ""
) -> list[SendResult]:
    async with Producer(cluster.namesrv, group="reader-test") as producer:
        return [await producer.send(Message(TOPIC, b, tags=tag)) for b in bodies]


async def test_reads_a_range_and_answers_bounds(cluster: InProcessCluster) -> None:
    sent = await send_all(cluster, [f"m{i}".encode() for i in range(10)])
    assert [r.queue_offset for r in sent] == list(range(10))
    async with QueueReader(cluster.namesrv, batch_size=3) as reader:
        queues = await reader.queues(TOPIC)
        assert queues == [MessageQueue(TOPIC, "broker-a", 0)]
        q = queues[0]
        bounds = await reader.offsets(q)
        assert (bounds.min_offset, bounds.max_offset, bounds.messages) == (0, 10, 10)

        everything = [m async for m in reader.read(q, 0)]
        assert [m.queue_offset for m in everything] == list(range(10))
        assert [m.body for m in everything] == [f"m{i}".encode() for i in range(10)]
        assert {m.unique_id for m in everything} == {r.message_id for r in sent}

        middle = [m async for m in reader.read(q, 3, 7)]
        assert [(m.queue_offset, m.body) for m in middle] == [
            (i, f"m{i}".encode()) for i in range(3, 7)
        ]
        assert [m async for m in reader.read(q, 4, 4)] == []

        batch = await reader.read_batch(q, 8)
        assert [m.queue_offset for m in batch.messages] == [8, 9]
        assert (batch.next_offset, batch.min_offset, batch.max_offset) == (10, 0, 10)
        at_end = await reader.read_batch(q, 10)
        assert (at_end.messages, at_end.next_offset) == ([], 10)


async def test_read_stops_at_the_max_offset_when_asked_for_more(cluster: InProcessCluster) -> None:
    await send_all(cluster, [b"a", b"b"])
    async with QueueReader(cluster.namesrv) as reader:
        q = (await reader.queues(TOPIC))[0]
        assert [m.body for m in [m async for m in reader.read(q, 0, 1_000)]] == [b"a", b"b"]


async def test_tag_expression_filters_on_the_broker(cluster: InProcessCluster) -> None:
    await send_all(cluster, [b"x0", b"x1"], tag="skip")
    await send_all(cluster, [b"k2", b"k3"], tag="keep")
    await send_all(cluster, [b"x4"], tag="skip")
    async with QueueReader(cluster.namesrv) as reader:
        q = (await reader.queues(TOPIC))[0]
        kept = [m async for m in reader.read(q, 0, tag_expression="keep")]
    assert [(m.queue_offset, m.tags, m.body) for m in kept] == [
        (2, "keep", b"k2"),
        (3, "keep", b"k3"),
    ]


async def test_offset_for_timestamp(cluster: InProcessCluster) -> None:
    sent = await send_all(cluster, [f"t{i}".encode() for i in range(6)])
    stamps = [r.store_timestamp_ms for r in sent]
    assert all(s > 0 for s in stamps)
    async with QueueReader(cluster.namesrv) as reader:
        q = (await reader.queues(TOPIC))[0]
        assert await reader.offset_for_timestamp(q, 0) == 0
        assert await reader.offset_for_timestamp(q, stamps[-1] + 60_000) == 6
        for t in sorted(set(stamps)):
            expected = next(i for i, s in enumerate(stamps) if s >= t)
            assert await reader.offset_for_timestamp(q, t) == expected


async def test_bad_input_names_the_field_and_rule(cluster: InProcessCluster) -> None:
    await send_all(cluster, [b"only"])
    async with QueueReader(cluster.namesrv) as reader:
        q = (await reader.queues(TOPIC))[0]
        with pytest.raises(InvalidArgumentError, match=r"^end: 3 is before start 5$"):
            [m async for m in reader.read(q, 5, 3)]
        with pytest.raises(
            InvalidArgumentError, match=r"^start: must be an offset \(an int >= 0\), got -1$"
        ):
            [m async for m in reader.read(q, -1)]
        with pytest.raises(InvalidArgumentError, match=r"^start: 3 is past the max offset 1 of "):
            [m async for m in reader.read(q, 3)]
        with pytest.raises(InvalidArgumentError, match=r"^offset: 7 is past the max offset 1 of "):
            await reader.read_batch(q, 7)
        with pytest.raises(
            InvalidArgumentError, match=r"^max_messages: must be between 1 and 1024"
        ):
            await reader.read_batch(q, 0, 0)
        with pytest.raises(InvalidArgumentError, match=r"^timestamp_ms: must be an offset"):
            await reader.offset_for_timestamp(q, -5)
        with pytest.raises(
            InvalidArgumentError, match=r"^queue: broker 'broker-z' has no readable"
        ):
            await reader.offsets(MessageQueue(TOPIC, "broker-z", 0))
        with pytest.raises(InvalidQueueIdError, match="queue_id 4"):
            await reader.offsets(MessageQueue(TOPIC, "broker-a", 4))
        with pytest.raises(UnknownTopicError):
            await reader.queues("NoSuchTopic")
    with pytest.raises(InvalidArgumentError, match=r"^batch_size: must be between 1 and 1024"):
        QueueReader(cluster.namesrv, batch_size=5000)
