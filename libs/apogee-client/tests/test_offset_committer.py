"""The offset committer: each queue's offset is the smallest one still in flight, and every
owned queue's offset is committed in one bulk when the injected clock says it is time."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence

import pytest

from apogee.client.consumer.committer import OffsetCommitter
from apogee.client.consumer.process_queue import ProcessQueue
from apogee.client.consumer.queue_state import QueueState
from apogee.client.consumer.records import ReceivedMessage, decode_records
from apogee.client.producer.routes import MessageQueue
from apogee.codec import encode_record
from apogee.common.clock import SYSTEM_CLOCK, ManualClock

pytestmark = pytest.mark.unit

A = MessageQueue("T", "b1", 0)
B = MessageQueue("T", "b2", 3)


class RecordingStore:
    """An offset store that keeps offsets in memory and records every persist call."""

    def __init__(self) -> None:
        self.table: dict[MessageQueue, int] = {}
        self.persists: list[dict[MessageQueue, int]] = []
        self.persisted = asyncio.Event()

    async def load(self, mq: MessageQueue) -> int | None:
        return self.table.get(mq)

    def update(self, mq: MessageQueue, offset: int, increase_only: bool = True) -> None:
        held = self.table.get(mq)
        if increase_only and held is not None and held >= offset:
            return
        self.table[mq] = offset

    def read(self, mq: MessageQueue) -> int | None:
        return self.table.get(mq)

    async def persist_all(self, mqs: Collection[MessageQueue]) -> None:
        offsets = {mq: self.table[mq] for mq in mqs if mq in self.table}
        if offsets:
            self.persists.append(offsets)
            self.persisted.set()

    async def persist(self, mq: MessageQueue) -> None:
        await self.persist_all((mq,))

    def remove(self, mq: MessageQueue) -> None:
        self.table.pop(mq, None)


def fetched(mq: MessageQueue, offsets: Sequence[int]) -> list[ReceivedMessage]:
    buf = b"".join(encode_record(mq.topic, mq.queue_id, o, b"body") for o in offsets)
    return decode_records(buf, mq.broker_name, mq.topic, mq.queue_id, offsets[0])


def owned_queue(
    mq: MessageQueue, offsets: Sequence[int]
) -> tuple[QueueState, list[ReceivedMessage]]:
    qs = QueueState(mq, "127.0.0.1:1", ProcessQueue())
    msgs = fetched(mq, offsets)
    qs.pq.add(msgs)
    return qs, msgs


def committer_for(
    store: RecordingStore,
    queues: Collection[MessageQueue],
    clock: ManualClock,
    *,
    piggyback: bool = True,
    interval: float = 5.0,
) -> OffsetCommitter:
    return OffsetCommitter(
        store, lambda: queues, group="g", interval=interval, clock=clock, piggyback=piggyback
    )


async def test_commits_the_smallest_in_flight_offset_of_every_queue_in_one_bulk_when_due() -> None:
    clock = ManualClock()
    store = RecordingStore()
    committer = committer_for(store, [A, B], clock)
    qa, a_msgs = owned_queue(A, range(10, 15))
    qb, b_msgs = owned_queue(B, range(0, 3))
    committer.start_at(A, 10)
    committer.start_at(B, 0)
    # finished out of order: 11 is still being consumed, so A's offset stops there
    committer.finished(qa, [a_msgs[0], a_msgs[2], a_msgs[3]])
    committer.finished(qb, b_msgs)

    await committer.tick()
    clock.advance(4.9)
    await committer.tick()
    assert store.persists == []  # not due yet

    clock.advance(0.1)
    await committer.tick()
    assert store.persists == [{A: 11, B: 3}]  # one bulk, every queue

    await committer.tick()
    clock.advance(4.0)
    await committer.tick()
    assert len(store.persists) == 1  # the next one is due 5 s after the last

    committer.finished(qa, [a_msgs[1]])
    clock.advance(1.0)
    await committer.tick()
    assert store.persists[-1] == {A: 14, B: 3}  # 14 is still in flight


async def test_an_offset_moves_back_only_when_a_queue_starts_again() -> None:
    store = RecordingStore()
    committer = committer_for(store, [A], ManualClock())
    committer.start_at(A, 100)
    committer.advance(A, 90)
    assert store.read(A) == 100  # a late, lower offset is ignored
    committer.advance(A, 120)
    assert store.read(A) == 120
    committer.start_at(A, 50)  # an offset reset, or the broker no longer keeps 120
    assert store.read(A) == 50


async def test_a_released_queue_is_committed_once_and_forgotten() -> None:
    store = RecordingStore()
    committer = committer_for(store, [], ManualClock())
    qa, msgs = owned_queue(A, range(5, 8))
    committer.start_at(A, 5)
    committer.finished(qa, msgs[:2])
    await committer.release(A, qa.pq.offset_to_commit())
    assert store.persists == [{A: 7}]
    assert store.read(A) is None

    # finishing messages of a dropped queue counts while its release waits for them, and
    # moves nothing once the release committed: its next owner has it
    qb, b_msgs = owned_queue(B, range(0, 3))
    committer.start_at(B, 0)
    qb.pq.drop()
    committer.finished(qb, b_msgs[:1])
    assert store.read(B) == 1
    qb.let_go = True
    committer.finished(qb, b_msgs[1:])
    assert store.read(B) == 1
    committer.forget(B)  # an offset reset: nothing is committed
    await committer.close()
    assert store.persists == [{A: 7}]


async def test_the_offset_rides_on_fetches_only_when_asked_to() -> None:
    clustering = committer_for(RecordingStore(), [A], ManualClock(), piggyback=True)
    broadcasting = committer_for(RecordingStore(), [A], ManualClock(), piggyback=False)
    assert clustering.piggyback(A) is None  # nothing known yet
    for c in (clustering, broadcasting):
        c.start_at(A, 42)
    assert clustering.piggyback(A) == 42
    assert broadcasting.piggyback(A) is None


async def test_the_background_loop_commits_periodically_until_stopped() -> None:
    store = RecordingStore()
    committer = OffsetCommitter(
        store, lambda: [A], group="g", interval=0.05, clock=SYSTEM_CLOCK, piggyback=True
    )
    committer.start_at(A, 7)
    committer.start()
    try:
        async with asyncio.timeout(5):
            await store.persisted.wait()
    finally:
        await committer.stop()
    assert store.persists[0] == {A: 7}
