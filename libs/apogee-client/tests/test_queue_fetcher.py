"""The per-queue fetcher over a record source: it asks from where the queue got to, carries the
offset to commit along, hands what arrives to the sink, pauses while the queue is full, follows
the broker's bounds, and wakes the rebalancer when a queue cannot be read any more."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from typing import Any, cast

import pytest

from apogee.client._rpc import PullAnswer
from apogee.client.consumer.committer import OffsetCommitter
from apogee.client.consumer.config import ConsumerConfig, ConsumerOptions
from apogee.client.consumer.fetcher import FetchContext, FetchRequest, QueueFetcher
from apogee.client.consumer.process_queue import ProcessQueue
from apogee.client.consumer.queue_state import QueueState
from apogee.client.consumer.records import ReceivedMessage
from apogee.client.consumer.runtime import check_subscription
from apogee.client.producer.routes import MessageQueue
from apogee.codec import encode_record
from apogee.common.clock import ManualClock
from apogee.common.errors import ApogeeError, UnavailableError, UnknownTopicError
from apogee.v1 import consumer_pb2

pytestmark = pytest.mark.unit

MQ = MessageQueue("T", "b1", 2)
WAIT = 5.0  # bound of every wait in these tests


class Source:
    """A record source answering from a script: each request takes the next answer (an
    exception is raised); with none left, it waits for more."""

    def __init__(self) -> None:
        self.requests: list[FetchRequest] = []
        self.answers: asyncio.Queue[PullAnswer | ApogeeError] = asyncio.Queue()
        self.asked = asyncio.Event()
        self.released_queues: list[MessageQueue] = []

    async def fetch(self, request: FetchRequest) -> PullAnswer:
        self.requests.append(request)
        self.asked.set()
        answer = await self.answers.get()
        if isinstance(answer, ApogeeError):
            raise answer
        return answer

    def released(self, mq: MessageQueue, keep_commit: bool = False) -> None:
        self.released_queues.append(mq)

    async def close(self) -> None:
        pass

    async def next_request(self) -> FetchRequest:
        """The next request made after this call."""
        n = len(self.requests)
        async with asyncio.timeout(WAIT):
            while len(self.requests) <= n:
                self.asked.clear()
                await self.asked.wait()
        return self.requests[n]


class Sink:
    def __init__(self) -> None:
        self.got: list[ReceivedMessage] = []
        self.arrived = asyncio.Event()

    def deliver(self, qs: QueueState, msgs: list[ReceivedMessage]) -> None:
        self.got += msgs
        self.arrived.set()

    def released(self, qs: QueueState) -> None:
        pass


class MemoryStore:
    def __init__(self) -> None:
        self.table: dict[MessageQueue, int] = {}

    async def load(self, mq: MessageQueue) -> int | None:
        return self.table.get(mq)

    def update(self, mq: MessageQueue, offset: int, increase_only: bool = True) -> None:
        held = self.table.get(mq)
        if not (increase_only and held is not None and held >= offset):
            self.table[mq] = offset

    def read(self, mq: MessageQueue) -> int | None:
        return self.table.get(mq)

    async def persist_all(self, mqs: Collection[MessageQueue]) -> None:
        pass

    async def persist(self, mq: MessageQueue) -> None:
        pass

    def remove(self, mq: MessageQueue) -> None:
        self.table.pop(mq, None)


def found(offsets: Sequence[int], next_offset: int | None = None, tags: str = "") -> PullAnswer:
    records = b"".join(encode_record(MQ.topic, MQ.queue_id, o, b"m", tags=tags) for o in offsets)
    return PullAnswer.of(
        consumer_pb2.PullResponse(
            status=consumer_pb2.PULL_FOUND,
            next_offset=next_offset if next_offset is not None else offsets[-1] + 1,
            broker_name=MQ.broker_name,
            records=records,
        )
    )


def status(
    code: consumer_pb2.PullStatus.ValueType, next_offset: int, lo: int = 0, hi: int = 0
) -> PullAnswer:
    return PullAnswer.of(
        consumer_pb2.PullResponse(
            status=code, next_offset=next_offset, min_offset=lo, max_offset=hi
        )
    )


class Rig:
    def __init__(self, start: int = 100, **options: Any) -> None:
        self.cfg = ConsumerConfig.create(
            "127.0.0.1:9876", "g", cast(ConsumerOptions, {"client_id": "me", **options})
        )
        self.source = Source()
        self.sink = Sink()
        self.store = MemoryStore()
        self.committer = OffsetCommitter(
            self.store,
            lambda: [MQ],
            group="g",
            interval=5.0,
            clock=ManualClock(),
            piggyback=True,
        )
        self.lost = asyncio.Event()
        self.qs = QueueState(MQ, "127.0.0.1:1", ProcessQueue())

        async def start_offset(qs: QueueState) -> int:
            return start

        self.ctx = FetchContext(
            cfg=self.cfg,
            source=self.source,
            committer=self.committer,
            sink=self.sink,
            subscriptions={"T": check_subscription("T", "a || b")},
            start_offset=start_offset,
            on_lost=self.lost.set,
        )
        self.fetcher = QueueFetcher(self.ctx, self.qs)

    async def stop(self) -> None:
        self.qs.pq.drop()
        self.qs.gone.set()
        await self.fetcher.stop()
        assert self.source.released_queues == []  # still held: the release commits first
        self.fetcher.let_go()


async def test_fetches_from_where_the_queue_got_to_and_carries_the_offset_to_commit() -> None:
    rig = Rig(start=100)
    rig.fetcher.start()
    try:
        first = await rig.source.next_request()
        assert (first.mq, first.address, first.offset) == (MQ, "127.0.0.1:1", 100)
        assert first.tag_expression == "a || b"
        assert first.max_messages == rig.cfg.pull_batch_size
        assert first.commit_offset == 100

        rig.source.answers.put_nowait(found([100, 101, 102], tags="a"))
        second = await rig.source.next_request()
        assert [m.queue_offset for m in rig.sink.got] == [100, 101, 102]
        assert second.offset == 103
        assert second.commit_offset == 100  # nothing finished yet

        rig.committer.finished(rig.qs, rig.sink.got[:2])
        rig.source.answers.put_nowait(status(consumer_pb2.PULL_NO_NEW_MESSAGE, 103))
        third = await rig.source.next_request()
        assert (third.offset, third.commit_offset) == (103, 102)  # 102 is still in flight
    finally:
        await rig.stop()
    assert rig.source.released_queues == [MQ]


async def test_messages_the_tags_do_not_match_are_skipped_not_handed_over() -> None:
    rig = Rig(start=0)
    rig.fetcher.start()
    try:
        await rig.source.next_request()
        rig.source.answers.put_nowait(found([0, 1], tags="c"))
        nxt = await rig.source.next_request()
    finally:
        await rig.stop()
    assert rig.sink.got == []
    assert (nxt.offset, nxt.commit_offset) == (2, 2)


async def test_fetching_pauses_while_the_queue_is_full_and_goes_on_when_space_is_made() -> None:
    rig = Rig(start=0, max_cached_messages_per_queue=2)
    rig.fetcher.start()
    try:
        await rig.source.next_request()
        rig.source.answers.put_nowait(found([0, 1], tags="a"))
        async with asyncio.timeout(WAIT):
            await rig.sink.arrived.wait()
        # the fetcher ran on from the delivery to its next wait before this test got control
        # back: were it not pausing, it would have asked again already
        assert len(rig.source.requests) == 1  # full: it waits for space

        rig.committer.finished(rig.qs, rig.sink.got[:1])
        rig.qs.space.set()
        nxt = await rig.source.next_request()
        assert (nxt.offset, nxt.commit_offset) == (2, 1)
    finally:
        await rig.stop()


async def test_an_offset_no_longer_kept_continues_at_the_earliest_kept() -> None:
    rig = Rig(start=10)
    rig.fetcher.start()
    try:
        await rig.source.next_request()
        rig.source.answers.put_nowait(status(consumer_pb2.PULL_OFFSET_TOO_SMALL, 50, 50, 80))
        nxt = await rig.source.next_request()
        assert (nxt.offset, nxt.commit_offset) == (50, 50)

        rig.source.answers.put_nowait(status(consumer_pb2.PULL_OFFSET_OVERFLOW, 20, 0, 20))
        nxt = await rig.source.next_request()
        assert (nxt.offset, nxt.commit_offset) == (20, 20)  # moved back: the queue shrank
    finally:
        await rig.stop()


async def test_a_queue_that_cannot_be_read_any_more_wakes_the_rebalancer() -> None:
    rig = Rig(start=0)
    rig.fetcher.start()
    try:
        await rig.source.next_request()
        rig.source.answers.put_nowait(UnavailableError(what="broker b1", detail="restarting"))
        await rig.source.next_request()  # a retriable failure: asked again, no rebalance
        assert not rig.lost.is_set()
        rig.source.answers.put_nowait(UnknownTopicError(topic="T", detail="is not known"))
        async with asyncio.timeout(WAIT):
            await rig.lost.wait()
        nxt = await rig.source.next_request()  # and it keeps asking until released
        assert nxt.offset == 0
    finally:
        await rig.stop()
