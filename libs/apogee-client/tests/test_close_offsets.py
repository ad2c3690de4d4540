"""A consumer that closes (or gives a queue up) never takes its group's committed offset back:
a commit that was waiting to ride on the delivery stream is not written once the queue is
released, the queue's last offset goes out on the stream too (after every commit that rode on it
before), a closing stream writes what it still holds before it ends, and a push consumer that
closes cleanly leaves exactly what it finished committed, with no lower commit on the way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from apogee.client._rpc import ChannelPool
from apogee.client.consumer.config import ConsumerConfig
from apogee.client.consumer.delivery import DeliveryStream
from apogee.client.consumer.fetcher import FetchRequest
from apogee.client.consumer.offset_store import RemoteOffsetStore
from apogee.client.consumer.push import PushConsumer
from apogee.client.consumer.records import ReceivedMessage
from apogee.client.consumer.stream_source import StreamSource
from apogee.client.producer.routes import MessageQueue
from apogee.store import Message
from apogee.testkit.cluster import InProcessCluster, eventually
from apogee.v1 import consumer_pb2
from apogee_broker.app import BrokerApp

pytestmark = pytest.mark.integration

TOPIC = "Closing"
GROUP = "g-closing"
WAIT = 10.0  # bound of every wait in these tests
MQ = MessageQueue(TOPIC, "b1", 0)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(tmp_path, nameservers=1, brokers=("b1",)) as c:
        await c.create_topic(TOPIC, queues=1)
        yield c


@pytest.fixture
async def pool() -> AsyncIterator[ChannelPool]:
    p = ChannelPool()
    yield p
    await p.close()


def broker(cluster: InProcessCluster) -> BrokerApp:
    return cluster.brokers["b1"]


async def append(app: BrokerApp, n: int) -> None:
    store = app.store
    assert store is not None
    store.append([Message(TOPIC, f"m{i}".encode(), queue_id=0) for i in range(n)])
    assert await asyncio.to_thread(store.wait_dispatched, WAIT)


def committed(app: BrokerApp) -> int | None:
    assert app.offsets is not None
    return app.offsets.committed(GROUP, TOPIC, 0)


def record_commits(app: BrokerApp, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every offset of the group's queue the broker applies from now on, in order, however it
    came (CommitOffsets, the delivery stream, a pull)."""
    offsets = app.offsets
    assert offsets is not None
    applied: list[int] = []
    commit, commit_many = offsets.commit, offsets.commit_many

    def one(group: str, topic: str, queue_id: int, offset: int, field: str = "offset") -> None:
        commit(group, topic, queue_id, offset, field)
        if (group, topic, queue_id) == (GROUP, TOPIC, 0):
            applied.append(offset)

    def many(group: str, items: Sequence[tuple[str, int, int]], field: str = "offsets") -> None:
        commit_many(group, items, field)
        if group == GROUP:
            applied.extend(o for t, q, o in items if (t, q) == (TOPIC, 0))

    monkeypatch.setattr(offsets, "commit", one)
    monkeypatch.setattr(offsets, "commit_many", many)
    return applied


async def read_all(source: StreamSource, address: str, n: int) -> None:
    """Fetch the queue from 0 until ``n`` records came, committing 0 along the way."""
    got = 0
    async with asyncio.timeout(WAIT):
        while got < n:
            answer = await source.fetch(FetchRequest(MQ, address, got, 32, "*", 0))
            got = answer.response.next_offset


async def test_a_released_queue_does_not_write_the_commit_that_was_waiting_for_the_stream(
    cluster: InProcessCluster, pool: ChannelPool
) -> None:
    app = broker(cluster)
    await append(app, 10)
    cfg = ConsumerConfig.create(cluster.namesrv, GROUP, {"long_poll_timeout": 0.05})
    source = StreamSource(cfg, pool)
    await read_all(source, app.address, 10)
    # the next fetch asks while the listener still has the last two: 8 waits for the
    # stream's next write (a grant, a subscription)
    quiet = await source.fetch(FetchRequest(MQ, app.address, 10, 32, "*", 8))
    assert quiet.response.status == consumer_pb2.PULL_NO_NEW_MESSAGE
    # the listener finishes them and the committer commits 10 (periodically, or releasing)
    store = RemoteOffsetStore(GROUP, "c1", pool, {"b1": app.address}.get, timeout=WAIT)
    store.update(MQ, 10)
    await store.persist(MQ)
    assert committed(app) == 10
    source.released(MQ)  # the queue is taken away
    # subscribing it again on the same stream: once it answers, the broker has read every
    # request written before, the release's included; and an exclusive subscription (a
    # clustering consumer's) starts no earlier than the group's committed offset
    again = await source.fetch(FetchRequest(MQ, app.address, 0, 32, "*", None))
    assert (again.response.status, again.response.next_offset) == (
        consumer_pb2.PULL_NO_MATCHED_MESSAGE,
        10,
    )
    assert committed(app) == 10  # not 8
    await source.close()


async def test_a_released_queues_last_offset_goes_out_on_its_stream_after_what_rode_before(
    cluster: InProcessCluster, pool: ChannelPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = broker(cluster)
    await append(app, 10)
    applied = record_commits(app, monkeypatch)
    cfg = ConsumerConfig.create(cluster.namesrv, GROUP, {"long_poll_timeout": 0.05})
    source = StreamSource(cfg, pool)
    await read_all(source, app.address, 10)
    source.released(MQ)
    source.commit_released(MQ, app.address, 10)
    await source.close()  # writes what it holds, then ends the stream
    assert committed(app) == 10
    assert applied[-1] == 10


async def test_a_closing_stream_writes_what_it_holds_first(
    cluster: InProcessCluster, pool: ChannelPool
) -> None:
    app = broker(cluster)
    await append(app, 3)
    stream = DeliveryStream(pool, app.address, GROUP, "c1")
    stream.subscribe(TOPIC, 0, 0, "*", 100, 0, lambda s, a: None, lambda s, e: None)
    async with asyncio.timeout(WAIT):
        await stream.connected.wait()
    stream.commit(TOPIC, 0, 3)
    await stream.close(timeout=WAIT)
    assert committed(app) == 3


async def test_a_push_consumer_closing_cleanly_never_commits_below_what_it_finished(
    cluster: InProcessCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defect seen in e2e/test_prometheus.py: the offset committed at close went back by
    the messages of the last batch."""
    app = broker(cluster)
    assert app.delivery is not None
    n = 5
    done: list[int] = []
    finished = asyncio.Event()

    async def listener(msgs: list[ReceivedMessage]) -> None:
        done.extend(m.queue_offset for m in msgs)
        finished.set()

    consumer = PushConsumer(
        cluster.namesrv,
        GROUP,
        listener,
        consume_from="earliest",
        offset_persist_interval=0.2,
        rebalance_interval=60.0,
        long_poll_timeout=30.0,  # a fetch waits with the commit it carries
    )
    async with consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        assert consumer.assignment() == [MQ]
        for i in range(n):  # one at a time: each fetch carries the offset before its message
            finished.clear()
            await append(app, 1)
            async with asyncio.timeout(WAIT):
                while len(done) <= i:
                    await finished.wait()
                    finished.clear()

        async def all_committed() -> bool:
            return committed(app) == n

        await eventually(all_committed, WAIT, f"offset {n} committed")  # the lag reads 0
        applied = record_commits(app, monkeypatch)
    assert done == list(range(n))

    async def stream_ended() -> bool:  # every request of the stream was read
        assert app.delivery is not None
        return app.delivery.sessions == 0

    await eventually(stream_ended, WAIT, "the consumer's delivery stream ended at the broker")
    assert committed(app) == n
    assert applied, "the close committed nothing"
    assert min(applied) == n, f"commits applied while closing: {applied}"
