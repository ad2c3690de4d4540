"""Commits of one queue reach their broker (or the offset file) in the order they were made: a
commit to a broker (or a write of the file) waits for the one before it, even when the persist
that made that one was cancelled (as stopping the periodic commit does); a consumer that stops
rebalancing lets a queue's release that is under way finish and commit."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection
from pathlib import Path
from typing import Any, cast

import pytest

from apogee.client._rpc import ChannelPool
from apogee.client.consumer.config import ConsumerConfig, ConsumerOptions
from apogee.client.consumer.offset_store import OFFSETS_FILE, LocalOffsetStore, RemoteOffsetStore
from apogee.client.consumer.rebalance import ReadRoute, Rebalancer
from apogee.client.producer.routes import MessageQueue
from apogee.v1 import consumer_pb2

pytestmark = pytest.mark.unit

WAIT = 5.0  # bound of every wait in these tests
Q0 = MessageQueue("Orders", "broker-a", 0)
Q1 = MessageQueue("Orders", "broker-a", 1)


class Broker:
    """A stand-in for a broker's CommitOffsets: each call waits until the test answers it."""

    def __init__(self) -> None:
        self.requests: list[consumer_pb2.CommitOffsetsRequest] = []
        self.answers: list[asyncio.Future[consumer_pb2.CommitOffsetsResponse]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.arrived = asyncio.Event()

    def consumer(self, address: str) -> Broker:
        return self

    async def CommitOffsets(
        self, request: consumer_pb2.CommitOffsetsRequest, timeout: float
    ) -> consumer_pb2.CommitOffsetsResponse:
        self.requests.append(request)
        answer: asyncio.Future[consumer_pb2.CommitOffsetsResponse]
        answer = asyncio.get_running_loop().create_future()
        self.answers.append(answer)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.arrived.set()
        try:
            return await answer
        finally:
            self.in_flight -= 1

    async def until_asked(self, n: int) -> None:
        async with asyncio.timeout(WAIT):
            while len(self.requests) < n:
                self.arrived.clear()
                await self.arrived.wait()

    def answer(self, i: int) -> None:
        self.answers[i].set_result(consumer_pb2.CommitOffsetsResponse())

    def offsets(self, i: int) -> dict[int, int]:
        return {o.queue_id: o.offset for o in self.requests[i].offsets}


async def test_a_commit_to_a_broker_waits_for_the_one_before_even_when_that_was_cancelled() -> None:
    broker = Broker()
    store = RemoteOffsetStore(
        "g", "c1", cast(ChannelPool, broker), lambda _: "127.0.0.1:1", timeout=5.0
    )
    store.update(Q0, 248)
    store.update(Q1, 10)
    periodic = asyncio.create_task(store.persist_all([Q0, Q1]))
    await broker.until_asked(1)
    store.update(Q0, 250)  # the last messages are done meanwhile
    periodic.cancel()  # the consumer closes: its periodic commit stops
    with pytest.raises(asyncio.CancelledError):
        await periodic
    final = asyncio.create_task(store.persist(Q0))  # the release commits the queue's offset
    # the broker may apply the first commit at any time until it answers: sending the second
    # before that could let 248 land after 250
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await asyncio.shield(broker.until_asked(2))
    assert broker.most_in_flight == 1
    broker.answer(0)
    await broker.until_asked(2)
    assert broker.offsets(1) == {0: 250}  # what is held when it goes out
    broker.answer(1)
    async with asyncio.timeout(WAIT):
        await final
    assert broker.most_in_flight == 1


async def test_a_cancelled_write_of_the_offset_file_is_not_overtaken(tmp_path: Path) -> None:
    path = tmp_path / OFFSETS_FILE
    store = LocalOffsetStore(path)
    written: list[int] = []
    writing = threading.Event()
    go_on = threading.Event()
    real_write = store._write_blocking

    def write(offsets: dict[MessageQueue, int]) -> None:
        if not written:  # the first write is slow (a busy disk)
            writing.set()
            assert go_on.wait(WAIT)
        real_write(offsets)
        written.append(offsets[Q0])

    store._write_blocking = write  # type: ignore[method-assign]
    store.update(Q0, 248)
    first = asyncio.create_task(store.persist_all([Q0]))
    assert await asyncio.to_thread(writing.wait, WAIT)
    store.update(Q0, 250)
    first.cancel()  # the thread goes on writing 248
    with pytest.raises(asyncio.CancelledError):
        await first
    second = asyncio.create_task(store.persist(Q0))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await asyncio.shield(second)
    assert written == []  # the second waits for the first write
    go_on.set()
    async with asyncio.timeout(WAIT):
        await second
    assert written == [248, 250]
    assert await LocalOffsetStore(path).load(Q0) == 250


class Directory:
    def __init__(self, route: ReadRoute, members: list[str]) -> None:
        self.route_ = route
        self.group = members

    async def route(self, topic: str) -> ReadRoute:
        return self.route_

    async def members(self, route: ReadRoute) -> list[str]:
        return self.group


class SlowOwner:
    """Owned queues whose release waits until the test lets it commit."""

    def __init__(self) -> None:
        self.queues: dict[MessageQueue, str] = {}
        self.releasing = asyncio.Event()
        self.go_on = asyncio.Event()
        self.committed: list[MessageQueue] = []

    def owned(self) -> Collection[MessageQueue]:
        return list(self.queues)

    def take(self, mq: MessageQueue, address: str) -> None:
        self.queues[mq] = address

    async def release(self, mq: MessageQueue) -> None:
        del self.queues[mq]
        self.releasing.set()
        await self.go_on.wait()
        self.committed.append(mq)


async def test_stopping_lets_a_release_under_way_commit() -> None:
    queues = (Q0, Q1)
    route = ReadRoute("Orders", queues, {"broker-a": "127.0.0.1:1"})
    directory = Directory(route, ["me"])
    owner = SlowOwner()
    cfg = ConsumerConfig.create(
        "127.0.0.1:9876",
        "g",
        cast(ConsumerOptions, {"client_id": "me", "rebalance_interval": 60.0}),
    )
    subscriptions: dict[str, Any] = {"Orders": ("*", None)}
    r = Rebalancer(cfg, directory, owner, subscriptions, lock=asyncio.Lock())
    await r.rebalance()
    assert set(owner.queues) == set(queues)
    r.start()
    directory.group = ["me", "other"]  # a member joins: one queue goes
    r.wake()
    async with asyncio.timeout(WAIT):
        await owner.releasing.wait()
    stopping = asyncio.create_task(r.stop())  # the consumer closes meanwhile
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await asyncio.shield(stopping)
    owner.go_on.set()
    async with asyncio.timeout(WAIT):
        await stopping
    assert owner.committed == [Q1]  # committed, not cut short
    assert owner.queues == {Q0: "127.0.0.1:1"}
    await r.rebalance()  # stopped: nothing changes any more
    assert owner.queues == {Q0: "127.0.0.1:1"}


class AnsweringBroker(Broker):
    """A stand-in that answers each commit at once."""

    async def CommitOffsets(
        self, request: consumer_pb2.CommitOffsetsRequest, timeout: float
    ) -> consumer_pb2.CommitOffsetsResponse:
        self.requests.append(request)
        return consumer_pb2.CommitOffsetsResponse()


async def test_a_persist_sends_only_the_offsets_that_moved_and_all_once_a_minute() -> None:
    """Regression: each consumer committed every queue it owned every 5 s, moved or not; a
    thousand idle consumers sent a broker 200 commits a second."""
    broker = AnsweringBroker()
    now = [0.0]
    store = RemoteOffsetStore(
        "g", "c1", cast(ChannelPool, broker), lambda _: "127.0.0.1:1", 5.0, clock=lambda: now[0]
    )
    store.update(Q0, 10)
    store.update(Q1, 20)
    await store.persist_all([Q0, Q1])
    assert broker.offsets(0) == {0: 10, 1: 20}
    now[0] = 5.0
    await store.persist_all([Q0, Q1])  # nothing moved: nothing sent
    assert len(broker.requests) == 1
    store.update(Q1, 21)
    now[0] = 10.0
    await store.persist_all([Q0, Q1])
    assert broker.offsets(1) == {1: 21}
    now[0] = 61.0  # a minute since everything went: everything again
    await store.persist_all([Q0, Q1])
    assert broker.offsets(2) == {0: 10, 1: 21}
    now[0] = 66.0
    await store.persist_all([Q0, Q1])
    assert len(broker.requests) == 3
    store.remove(Q0)  # released: a queue owned again later is sent again
    store.update(Q0, 10)
    await store.persist_all([Q0, Q1])
    assert broker.offsets(3) == {0: 10}
