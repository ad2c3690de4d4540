"""DeliverySession on a real store: batches within credits, several queues in one answer,
arrivals waking a waiting session, tag filtering, offsets outside what a queue keeps, errors
per subscription, unsubscribe, commits, and the stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from apogee.common.clock import ManualClock
from apogee.common.errors import (
    InvalidArgumentError,
    InvalidQueueIdError,
    QueueHeldError,
    UnavailableError,
    UnknownTopicError,
)
from apogee.store import GetStatus, Message, MessageStore, StoreConfig
from apogee.testkit.broker import decode_records
from apogee.testkit.store import dispatched
from apogee.testkit.waiting import eventually
from apogee_broker.core.consume.offsets import ConsumerOffsets
from apogee_broker.core.consume.push import Batch, DeliveryHub, DeliverySession, Subscribe
from apogee_broker.core.topics import TopicConfig, TopicManager

pytestmark = pytest.mark.unit

CONFIG = StoreConfig(commitlog_file_size=1 << 20, max_message_size=128 * 1024)
HOUR_S = 3600.0


@pytest.fixture
def clock() -> ManualClock:
    """Starting at the real time: retention compares it with the files' real mtimes."""
    return ManualClock(start_ms=time.time_ns() // 1_000_000)


@pytest.fixture
def store(tmp_path: Path, clock: ManualClock) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "store", CONFIG, clock=clock, start_retention=False) as s:
        yield s


@pytest.fixture
def topics(tmp_path: Path) -> TopicManager:
    tm = TopicManager(tmp_path, broker_name="b1")
    tm.load()
    tm.put(TopicConfig("T", 4, 4))
    tm.put(TopicConfig("U", 2, 2))
    return tm


@pytest.fixture
def offsets(tmp_path: Path, store: MessageStore, topics: TopicManager) -> ConsumerOffsets:
    return ConsumerOffsets(tmp_path, store, topics)


@pytest.fixture
def hub(store: MessageStore, topics: TopicManager, offsets: ConsumerOffsets) -> DeliveryHub:
    return DeliveryHub(store, topics, offsets, pull_max_messages=50, pull_max_bytes=64 * 1024)


@pytest.fixture
async def session(hub: DeliveryHub) -> AsyncIterator[DeliverySession]:
    s = hub.open("g", "c")
    yield s
    hub.close(s)


def send(
    store: MessageStore, n: int, queue_id: int = 0, tag: str | None = None, topic: str = "T"
) -> None:
    store.append(
        [Message(topic, f"{tag}-{i}".encode(), queue_id=queue_id, tags=tag) for i in range(n)]
    )
    dispatched(store)


def watches(store: MessageStore) -> int:
    return sum(len(ws) for ws in store.notifier._watches.values())


async def take(session: DeliverySession, timeout: float = 5.0) -> list[Batch]:
    return await asyncio.wait_for(session.next_batches(), timeout)


async def nothing_within(session: DeliverySession, seconds: float = 0.2) -> None:
    task = asyncio.create_task(session.next_batches())
    done, _ = await asyncio.wait({task}, timeout=seconds)
    assert not done, f"expected nothing, got {task.result()}"
    task.cancel()


def offsets_of(batch: Batch) -> list[int]:
    assert batch.result is not None
    return [m.queue_offset for m in decode_records(batch.result.records)]


async def test_pushes_within_message_credit_and_goes_on_after_a_grant(
    session: DeliverySession, store: MessageStore
) -> None:
    send(store, 10)
    session.subscribe(Subscribe(1, "T", 0, 0, credit_messages=4))
    [b] = await take(session)
    assert (b.sub, b.result and b.result.status) == (1, GetStatus.FOUND)
    assert offsets_of(b) == [0, 1, 2, 3]
    await nothing_within(session)  # credit used up, though 6 more are there
    session.grant(1, 100, 0)
    [b] = await take(session)
    assert offsets_of(b) == [4, 5, 6, 7, 8, 9]
    assert b.result is not None
    assert b.result.next_offset == 10


async def test_an_arrival_without_credit_waits_for_the_grant(
    session: DeliverySession, store: MessageStore
) -> None:
    send(store, 2)
    session.subscribe(Subscribe(1, "T", 0, 0, credit_messages=2))
    [b] = await take(session)
    assert offsets_of(b) == [0, 1]  # caught up and out of credit
    send(store, 1)
    await nothing_within(session)
    session.grant(1, 5, 0)
    [b] = await take(session)
    assert offsets_of(b) == [2]


async def test_byte_credit_bounds_a_batch(session: DeliverySession, store: MessageStore) -> None:
    send(store, 10)
    one = len(store.get_records("T", 0, 0, 1, 1 << 20).records)
    session.subscribe(Subscribe(1, "T", 0, 0, credit_messages=100, credit_bytes=2 * one))
    [b] = await take(session)
    assert offsets_of(b) == [0, 1]
    await nothing_within(session)  # no byte credit left, though 8 more are there
    session.grant(1, 0, one // 2)
    [b] = await take(session)
    assert offsets_of(b) == [2]  # a batch holds at least one whole record
    await nothing_within(session)  # the byte credit went below zero
    session.grant(1, 0, one // 2)
    await nothing_within(session, 0.05)  # back to zero: still none
    session.grant(1, 0, 10 * one)
    [b] = await take(session)
    assert offsets_of(b) == list(range(3, 10))


async def test_queues_ready_together_share_one_answer(
    session: DeliverySession, store: MessageStore
) -> None:
    for q in range(3):
        send(store, 2, queue_id=q)
    for q in range(3):
        session.subscribe(Subscribe(q + 1, "T", q, 0, credit_messages=10))
    got = await take(session)
    assert sorted(b.sub for b in got) == [1, 2, 3]
    assert all(offsets_of(b) == [0, 1] for b in got)


async def test_an_arrival_wakes_a_waiting_session_and_leaves_no_watch(
    session: DeliverySession, store: MessageStore
) -> None:
    session.subscribe(Subscribe(1, "T", 2, 0, credit_messages=10))
    waiting = asyncio.create_task(session.next_batches())
    await eventually(lambda: watches(store) == 1, 5, "the session waiting for an arrival")
    assert not waiting.done()
    await asyncio.to_thread(send, store, 1, 2)  # appended and indexed on another thread
    [b] = await asyncio.wait_for(waiting, 5)
    assert offsets_of(b) == [0]
    assert watches(store) == 1  # caught up: waiting for the next one, with no empty read
    session.end()
    assert watches(store) == 0


async def test_an_sql_filter_delivers_matches_and_a_bad_one_ends_the_subscription(
    session: DeliverySession, store: MessageStore
) -> None:
    store.append([Message("T", f"m{i}".encode(), properties={"n": str(i)}) for i in range(10)])
    dispatched(store)
    session.subscribe(Subscribe(1, "T", 0, 0, credit_messages=100, sql_expression="n >= 7"))
    [found] = await take(session)
    assert offsets_of(found) == [7, 8, 9]
    session.subscribe(Subscribe(2, "T", 0, 0, credit_messages=5, sql_expression="n >="))
    [refused] = await take(session)
    assert refused.result is None
    assert refused.error is not None
    assert str(refused.error).startswith("sql_expression: syntax error at position")


async def test_tag_filter_delivers_matches_and_reports_where_the_scan_got(
    session: DeliverySession, store: MessageStore
) -> None:
    send(store, 3, tag="A")
    send(store, 5, tag="B")
    session.subscribe(Subscribe(1, "T", 0, 0, tag_expression="A", credit_messages=100))
    [found] = await take(session)
    assert offsets_of(found) == [0, 1, 2]
    assert found.result is not None
    assert found.result.next_offset == 8  # past the B messages
    await nothing_within(session)
    send(store, 2, tag="B")
    [progress] = await take(session)  # passed over with no match: said once
    assert progress.result is not None
    assert (progress.result.status, progress.result.next_offset) == (
        GetStatus.NO_MATCHED_MESSAGE,
        10,
    )
    await nothing_within(session)
    send(store, 1, tag="A")
    [found] = await take(session)
    assert offsets_of(found) == [10]


async def test_an_offset_beyond_the_end_continues_from_the_end(
    session: DeliverySession, store: MessageStore
) -> None:
    send(store, 3)
    session.subscribe(Subscribe(1, "T", 0, 10, credit_messages=10))
    [b] = await take(session)
    assert b.result is not None
    assert (b.result.status, b.result.next_offset) == (GetStatus.OFFSET_OVERFLOW, 3)
    send(store, 1)
    [b] = await take(session)
    assert offsets_of(b) == [3]


async def test_retention_moving_the_start_is_reported_and_skipped(
    session: DeliverySession, store: MessageStore, clock: ManualClock
) -> None:
    big = [Message("T", bytes(60_000), queue_id=0) for _ in range(10)]
    while store.commitlog.max_offset <= 2 * CONFIG.commitlog_file_size:
        store.append(big)
    dispatched(store)
    clock.advance(73 * HOUR_S)  # past the 72 h retention
    store.retention.run_once()
    low = store.min_offset("T", 0)
    assert low > 0
    session.subscribe(Subscribe(1, "T", 0, 0, credit_messages=1))
    [b] = await take(session)
    assert b.result is not None
    assert (b.result.status, b.result.next_offset) == (GetStatus.OFFSET_TOO_SMALL, low)
    [b] = await take(session)
    assert offsets_of(b) == [low]


async def test_a_bad_subscription_gets_its_own_status_and_the_others_go_on(
    session: DeliverySession, store: MessageStore
) -> None:
    send(store, 1)
    session.subscribe(Subscribe(1, "T", 0, 0, credit_messages=5))
    session.subscribe(Subscribe(2, "Nope", 0, 0, credit_messages=5))
    session.subscribe(Subscribe(3, "T", 9, 0, credit_messages=5))
    session.subscribe(Subscribe(4, "T", 1, -1, credit_messages=5))
    session.subscribe(Subscribe(5, "T", 1, 0, tag_expression="a||", credit_messages=5))
    session.subscribe(Subscribe(1, "T", 1, 0, credit_messages=5))  # the id is taken
    session.subscribe(Subscribe(0, "T", 1, 0, credit_messages=5))  # no id: nothing to answer
    got = {b.sub: b for b in await take(session)}
    assert offsets_of(got.pop(1)) == [0]
    errors = {n: type(b.error) for n, b in got.items()}
    assert errors == {
        2: UnknownTopicError,
        3: InvalidQueueIdError,
        4: InvalidArgumentError,
        5: InvalidArgumentError,
    }
    assert session.subscriptions == 1
    send(store, 1)
    [b] = await take(session)
    assert (b.sub, offsets_of(b)) == (1, [1])


async def test_a_deleted_topic_ends_its_subscriptions_only(
    session: DeliverySession, store: MessageStore, topics: TopicManager
) -> None:
    send(store, 1, topic="U")
    send(store, 1)
    session.subscribe(Subscribe(1, "U", 0, 0, credit_messages=5))
    session.subscribe(Subscribe(2, "T", 0, 0, credit_messages=5))
    session.subscribe(Subscribe(3, "T", 3, 0, credit_messages=0))  # no credit: still told
    assert {b.sub for b in await take(session)} == {1, 2}
    topics.delete("U")  # while both wait for messages: told at once
    [b] = await take(session)
    assert b.sub == 1
    assert isinstance(b.error, UnknownTopicError)
    topics.put(TopicConfig("T", 2, 2))  # fewer queues: queue 3 is gone
    [b] = await take(session)
    assert b.sub == 3
    assert isinstance(b.error, InvalidQueueIdError)
    send(store, 1)
    [b] = await take(session)
    assert (b.sub, offsets_of(b)) == (2, [1])
    assert session.subscriptions == 1
    assert watches(store) == 1


async def test_unsubscribe_stops_delivery_and_cancels_the_watch(
    session: DeliverySession, store: MessageStore
) -> None:
    session.subscribe(Subscribe(1, "T", 0, 0, credit_messages=5))
    await nothing_within(session, 0.05)
    assert watches(store) == 1
    session.unsubscribe([1, 99])
    assert watches(store) == 0
    send(store, 3)
    await nothing_within(session)
    session.grant(1, 5, 0)  # a grant for an ended subscription is ignored
    await nothing_within(session, 0.05)
    session.subscribe(Subscribe(2, "T", 0, 1, credit_messages=5))  # again, from another offset
    [b] = await take(session)
    assert (b.sub, offsets_of(b)) == (2, [1, 2])


async def test_commits_ride_on_the_session(
    session: DeliverySession, store: MessageStore, offsets: ConsumerOffsets
) -> None:
    send(store, 5)
    session.commit([("T", 0, 3)])
    assert offsets.committed("g", "T", 0) == 3
    session.commit([("T", 0, 4), ("T", 1, 7)])  # the second is beyond its queue: skipped
    assert offsets.committed("g", "T", 0) == 4
    assert offsets.committed("g", "T", 1) is None
    session.commit([("Nope", 0, 0), ("T", 9, 0), ("T", 0, 5)])  # a queue's trouble: skipped
    assert offsets.committed("g", "T", 0) == 5
    assert offsets.committed("g", "Nope", 0) is None
    with pytest.raises(InvalidArgumentError, match="commit\\[1\\]"):
        session.commit([("T", 0, 5), ("T", 0, -1)])


async def test_stop_ends_waiting_sessions_at_once_and_opens_no_more(
    hub: DeliveryHub, store: MessageStore
) -> None:
    sessions = [hub.open("g", f"c{i}") for i in range(3)]
    for s in sessions:
        s.subscribe(Subscribe(1, "T", 0, 0, credit_messages=5))
    waiting = [asyncio.create_task(s.next_batches()) for s in sessions]
    await eventually(lambda: watches(store) == 3, 5, "the sessions waiting for arrivals")
    hub.stop()
    assert await asyncio.wait_for(asyncio.gather(*waiting), 1.0) == [[], [], []]
    assert watches(store) == 0
    with pytest.raises(UnavailableError):
        hub.open("g", "late")


async def test_open_checks_names(hub: DeliveryHub) -> None:
    with pytest.raises(InvalidArgumentError, match="group"):
        hub.open("", "c")
    with pytest.raises(InvalidArgumentError, match="client_id"):
        hub.open("g", "")


async def test_stream_credit_is_shared_by_its_queues(
    session: DeliverySession, store: MessageStore
) -> None:
    for q in range(2):
        send(store, 5, queue_id=q)
    session.grant(0, 3, 0)  # the stream: three messages in all
    for q in range(2):
        session.subscribe(Subscribe(q + 1, "T", q, 0, credit_messages=100))
    got = await take(session)
    assert sum(len(offsets_of(b)) for b in got) == 3
    await nothing_within(session)  # the queues have credit, the stream has none
    session.grant(0, 100, 0)
    got = await take(session)
    assert sum(len(offsets_of(b)) for b in got) == 7


async def test_a_busy_stream_gathers_arrivals_into_one_answer_and_an_idle_one_answers_at_once(
    store: MessageStore, topics: TopicManager, offsets: ConsumerOffsets
) -> None:
    hub = DeliveryHub(store, topics, offsets, coalesce_s=0.2)
    session = hub.open("g", "c")
    try:
        for q in range(3):
            session.subscribe(Subscribe(q + 1, "T", q, 0, credit_messages=100))
        loop = asyncio.get_running_loop()
        start = loop.time()
        send(store, 1, queue_id=0)
        [first] = await take(session)  # idle: at once
        assert loop.time() - start < 0.15
        assert offsets_of(first) == [0]

        # answered just now: the next answer waits out the 0.2 s, and carries what arrived
        # meanwhile on every queue
        answer = asyncio.create_task(take(session))
        send(store, 1, queue_id=0)
        await asyncio.sleep(0.05)
        send(store, 1, queue_id=1)
        send(store, 1, queue_id=2)
        batches = await answer
        assert loop.time() - start >= 0.18
        assert sorted((b.sub, offsets_of(b)[0]) for b in batches) == [(1, 1), (2, 0), (3, 0)]
    finally:
        hub.close(session)


def test_waiting_out_the_coalescing_window_does_not_spin_uvloop(
    store: MessageStore, topics: TopicManager, offsets: ConsumerOffsets
) -> None:
    """The broker runs on uvloop, whose timers count whole milliseconds and run a shorter one
    at once: a session waiting out the rest of its window must sleep, not turn the loop over
    and over until the clock passes (CPU taken from the sends). Fifty answers, each within
    a window of 0.4 ms of the last: waiting, the loop's thread uses a fraction of the time."""
    import uvloop  # noqa: PLC0415 - what the broker runs on

    async def main() -> tuple[float, float]:
        hub = DeliveryHub(store, topics, offsets, coalesce_s=0.0004)
        session = hub.open("g", "c")
        try:
            session.subscribe(Subscribe(1, "T", 0, 0, credit_messages=1000))
            send(store, 1)
            await take(session)
            cpu = wall = 0.0
            for i in range(50):
                send(store, 1)  # answered just now: this one waits out the window
                began, began_cpu = time.monotonic(), time.thread_time()
                [batch] = await take(session)
                wall += time.monotonic() - began
                cpu += time.thread_time() - began_cpu
                assert offsets_of(batch) == [i + 1]
            return cpu, wall
        finally:
            hub.close(session)

    cpu, wall = uvloop.run(main())
    assert wall >= 50 * 0.0003  # the windows were kept
    assert cpu < 0.5 * wall, f"{cpu * 1000:.1f} ms of CPU in {wall * 1000:.1f} ms of waiting"


async def test_an_exclusive_queue_is_read_by_one_member_of_a_group_at_a_time(
    hub: DeliveryHub, session: DeliverySession, store: MessageStore
) -> None:
    """A rebalance moving a queue: the new owner's subscription is refused (QUEUE_HELD) until
    the old owner lets the queue go, by unsubscribing or by its stream ending."""
    send(store, 2)
    newcomer = hub.open("g", "c2")
    other_group = hub.open("h", "c3")
    try:
        session.subscribe(Subscribe(1, "T", 0, 0, credit_messages=5, exclusive=True))
        [b] = await take(session)
        assert (b.sub, offsets_of(b)) == (1, [0, 1])
        newcomer.subscribe(Subscribe(1, "T", 0, 0, credit_messages=5, exclusive=True))
        [b] = await take(newcomer)
        assert isinstance(b.error, QueueHeldError)
        assert b.error.retriable
        assert "T/0 is read by c of group g" in str(b.error)
        # while held, the group's offset is the holder's: the newcomer's (where it would
        # start) is not taken
        session.commit([("T", 0, 2)])
        newcomer.commit([("T", 0, 0)])
        assert hub.offsets.committed("g", "T", 0) == 2
        # another group, and a queue subscribed without exclusive, are not held back
        other_group.subscribe(Subscribe(1, "T", 0, 0, credit_messages=5, exclusive=True))
        assert offsets_of((await take(other_group))[0]) == [0, 1]
        newcomer.subscribe(Subscribe(2, "T", 0, 0, credit_messages=5))
        assert offsets_of((await take(newcomer))[0]) == [0, 1]
        newcomer.unsubscribe([2])
        session.unsubscribe([1])  # the old owner lets it go
        # asked from 1, it starts where the group committed: 2
        newcomer.subscribe(Subscribe(3, "T", 0, 1, credit_messages=5, exclusive=True))
        b = (await take(newcomer))[0]
        assert b.result is not None
        assert (b.sub, b.result.status, b.result.next_offset) == (
            3,
            GetStatus.NO_MATCHED_MESSAGE,
            2,
        )
        send(store, 1)
        assert [(x.sub, offsets_of(x)) for x in await take(newcomer)] == [(3, [2])]
        session.subscribe(Subscribe(2, "T", 0, 0, credit_messages=5, exclusive=True))
        assert isinstance((await take(session))[0].error, QueueHeldError)
        hub.close(newcomer)  # its stream ends: the queue is free again
        session.subscribe(Subscribe(3, "T", 0, 2, credit_messages=5, exclusive=True))
        [b] = await take(session)
        assert (b.sub, b.error, offsets_of(b)) == (3, None, [2])
    finally:
        hub.close(newcomer)
        hub.close(other_group)
