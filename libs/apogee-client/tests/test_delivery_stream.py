"""DeliveryStream against a real broker in this process: records pushed within credits, grants
and commits riding on the stream, an ended subscription's records dropped, a queue's error
for that queue only, and the stream opened again (nothing skipped) after the broker restarts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.client._rpc import ChannelPool, PullAnswer
from apogee.client.consumer.delivery import DeliveryStream, Subscription
from apogee.common.errors import ApogeeError
from apogee.store import Message
from apogee.testkit.broker import decode_records
from apogee.testkit.cluster import InProcessCluster, eventually
from apogee.v1 import consumer_pb2
from apogee_broker.app import BrokerApp

pytestmark = pytest.mark.integration

TOPIC = "Deliveries"


class Received:
    """What a subscription got: queue offsets of its records, statuses and errors."""

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self.statuses: list[int] = []
        self.errors: list[ApogeeError] = []
        self.changed = asyncio.Event()

    def batch(self, s: Subscription, answer: PullAnswer) -> None:
        resp = answer.response
        self.statuses.append(resp.status)
        if resp.status == consumer_pb2.PULL_FOUND:
            msgs = decode_records(answer.records[answer.start : answer.end])
            self.offsets += [m.queue_offset for m in msgs]
        self.changed.set()

    def error(self, s: Subscription, err: ApogeeError) -> None:
        self.errors.append(err)
        self.changed.set()

    async def until(self, count: int, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.offsets) < count:
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(tmp_path, nameservers=1, brokers=("b1",)) as c:
        await c.create_topic(TOPIC, queues=2)
        yield c


@pytest.fixture
async def pool() -> AsyncIterator[ChannelPool]:
    p = ChannelPool()
    yield p
    await p.close()


async def append(app: BrokerApp, n: int, queue_id: int = 0) -> None:
    store = app.store
    assert store is not None
    store.append([Message(TOPIC, f"m{i}".encode(), queue_id=queue_id) for i in range(n)])
    assert await asyncio.to_thread(store.wait_dispatched, 5.0)


def subscribe(
    stream: DeliveryStream, got: Received, queue_id: int = 0, offset: int = 0, credit: int = 100
) -> Subscription:
    return stream.subscribe(TOPIC, queue_id, offset, "*", credit, 0, got.batch, got.error)


async def test_records_are_pushed_within_credit_and_commits_ride_along(
    cluster: InProcessCluster, pool: ChannelPool
) -> None:
    app = cluster.brokers["b1"]
    stream = DeliveryStream(pool, app.address, "g", "c1")
    got = Received()
    await append(app, 5)
    sub = subscribe(stream, got, credit=3)
    await got.until(3)
    assert got.offsets == [0, 1, 2]
    assert sub.credit_messages == 0
    await append(app, 2)
    with pytest.raises(TimeoutError):
        await got.until(4, timeout=0.3)  # no credit left
    stream.grant(sub, 10)
    stream.commit(TOPIC, 0, 3)
    await got.until(7)
    assert got.offsets == list(range(7))
    assert sub.offset == 7
    assert app.offsets is not None
    assert app.offsets.committed("g", TOPIC, 0) == 3
    await stream.close()


async def test_an_ended_subscription_gets_nothing_more(
    cluster: InProcessCluster, pool: ChannelPool
) -> None:
    app = cluster.brokers["b1"]
    stream = DeliveryStream(pool, app.address, "g", "c1")
    old, new = Received(), Received()
    sub = subscribe(stream, old)
    await append(app, 2)
    await old.until(2)
    stream.unsubscribe(sub)
    subscribe(stream, new, offset=1)  # the same queue again, from another offset
    await append(app, 1)
    await new.until(2)
    assert new.offsets == [1, 2]
    assert old.offsets == [0, 1]
    await stream.close()


async def test_a_failed_queue_is_told_alone(cluster: InProcessCluster, pool: ChannelPool) -> None:
    app = cluster.brokers["b1"]
    stream = DeliveryStream(pool, app.address, "g", "c1")
    bad, good = Received(), Received()
    stream.subscribe(TOPIC, 7, 0, "*", 10, 0, bad.batch, bad.error)  # no queue 7
    subscribe(stream, good, queue_id=1)
    await append(app, 1, queue_id=1)
    await good.until(1)

    async def told() -> bool:
        return bool(bad.errors)

    await eventually(told, 5.0, "the bad queue's error")
    assert bad.errors[0].kind.name == "INVALID_QUEUE_ID"
    await stream.close()


async def test_the_stream_is_opened_again_after_a_broker_restart(
    cluster: InProcessCluster, pool: ChannelPool
) -> None:
    app = cluster.brokers["b1"]
    port = app.port
    stream = DeliveryStream(pool, app.address, "g", "c1")
    got = Received()
    subscribe(stream, got, credit=1000)
    await append(app, 3)
    await got.until(3)
    await cluster.stop_broker("b1")
    app = await cluster.start_broker("b1", listen=f"127.0.0.1:{port}")
    await append(app, 2)
    await got.until(5, timeout=10.0)
    assert got.offsets == [0, 1, 2, 3, 4]
    assert stream.opened >= 2
    await stream.close()


async def test_a_stream_without_subscriptions_is_not_opened_again(
    cluster: InProcessCluster, pool: ChannelPool
) -> None:
    app = cluster.brokers["b1"]
    stream = DeliveryStream(pool, app.address, "g", "c1")
    got = Received()
    sub = subscribe(stream, got)
    await append(app, 1)
    await got.until(1)
    stream.unsubscribe(sub)
    await cluster.stop_broker("b1")  # gone for good: nothing is left to deliver from it

    async def ended() -> bool:
        return not stream.running

    await eventually(ended, 5.0, "the stream's task to end")
    await stream.close()
