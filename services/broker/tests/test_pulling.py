"""PullService on a real store: checks, caps, the piggybacked commit, and long polling (woken by
an arrival within milliseconds, bounded by hold_ms, long_poll_max_ms and the deadline, ended by
stop, always leaving no watch behind)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apogee.common.errors import (
    InvalidArgumentError,
    InvalidQueueIdError,
    InvalidTopicError,
    PermissionDeniedError,
    UnknownTopicError,
)
from apogee.store import GetStatus, Message, MessageStore, StoreConfig
from apogee.testkit.broker import decode_records
from apogee.testkit.store import dispatched, watched_offsets
from apogee.testkit.waiting import eventually
from apogee_broker.core.consume.offsets import ConsumerOffsets
from apogee_broker.core.consume.pulling import Pull, PullService
from apogee_broker.core.topics import TopicConfig, TopicManager

pytestmark = pytest.mark.unit

CONFIG = StoreConfig(commitlog_file_size=1 << 20, max_message_size=64 * 1024)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "store", CONFIG, start_retention=False) as s:
        yield s


@pytest.fixture
def topics(tmp_path: Path) -> TopicManager:
    tm = TopicManager(tmp_path, broker_name="b1")
    tm.load()
    tm.put(TopicConfig("T", 4, 4))
    tm.put(TopicConfig("Narrow", 2, 4))  # 2 read queues, 4 write queues
    tm.put(TopicConfig("WriteOnly", 2, 2, perm=2))
    tm.put(TopicConfig("%RETRY%g", 1, 1))
    return tm


@pytest.fixture
def offsets(tmp_path: Path, store: MessageStore, topics: TopicManager) -> ConsumerOffsets:
    return ConsumerOffsets(tmp_path, store, topics)


@pytest.fixture
def service(store: MessageStore, topics: TopicManager, offsets: ConsumerOffsets) -> PullService:
    return PullService(
        store,
        topics,
        offsets,
        pull_max_messages=50,
        pull_max_bytes=64 * 1024,
        long_poll_max_ms=2000,
    )


def pull(offset: int = 0, **kw: object) -> Pull:
    fields: dict[str, object] = {
        "group": "g",
        "client_id": "c",
        "topic": "T",
        "queue_id": 0,
        "offset": offset,
    }
    fields.update(kw)
    return Pull(**fields)  # type: ignore[arg-type]


def send(
    store: MessageStore, n: int, queue_id: int = 0, tag: str | None = None, topic: str = "T"
) -> None:
    store.append(
        [Message(topic, f"{tag}-{i}".encode(), queue_id=queue_id, tags=tag) for i in range(n)]
    )
    dispatched(store)


async def test_found_and_caps(service: PullService, store: MessageStore) -> None:
    send(store, 60)
    got = await service.pull(pull())
    assert (got.status, got.count, got.next_offset) == (GetStatus.FOUND, 32, 32)  # default 32
    msgs = decode_records(got.records)
    assert [m.queue_offset for m in msgs] == list(range(32))
    capped = await service.pull(pull(max_messages=10_000))
    assert capped.count == 50  # pull_max_messages
    few = await service.pull(pull(5, max_messages=3))
    assert [m.queue_offset for m in decode_records(few.records)] == [5, 6, 7]
    big = Message("T", bytes(40_000), queue_id=1)
    store.append([big, big, big])
    dispatched(store)
    by_bytes = await service.pull(pull(queue_id=1, max_bytes=1 << 30))
    assert by_bytes.count == 1  # pull_max_bytes (64 KiB) holds one of them


async def test_checks(service: PullService, store: MessageStore) -> None:
    send(store, 3)
    cases: list[tuple[Pull, type[Exception], str]] = [
        (pull(group=""), InvalidArgumentError, "group: must not be empty"),
        (pull(group="a b"), InvalidArgumentError, "group: 'a b' has a character outside"),
        (pull(group="g" * 128), InvalidArgumentError, "group: 'ggg"),
        (pull(client_id=""), InvalidArgumentError, "client_id: must not be empty"),
        (pull(topic="a b"), InvalidTopicError, "topic 'a b': has a character outside"),
        (pull(topic="Nope"), UnknownTopicError, "topic 'Nope' does not exist on broker b1"),
        (
            pull(topic="WriteOnly"),
            PermissionDeniedError,
            "topic 'WriteOnly': is not readable on broker b1 (perm -W-, read permission R is "
            "missing)",
        ),
        (
            pull(queue_id=4),
            InvalidQueueIdError,
            "queue_id 4: must be between 0 and 3: topic 'T' has 4 read queues on broker b1",
        ),
        (
            pull(topic="Narrow", queue_id=2),
            InvalidQueueIdError,
            "queue_id 2: must be between 0 and 1",
        ),
        (pull(queue_id=-1), InvalidQueueIdError, "queue_id -1"),
        (pull(-1), InvalidArgumentError, "offset: must not be negative, got -1"),
        (
            pull(tag_expression="A ||"),
            InvalidArgumentError,
            "tag_expression: 'A ||' has an empty tag",
        ),
        (pull(commit_offset=-2), InvalidArgumentError, "commit_offset: must not be negative"),
    ]
    for p, kind, message in cases:
        with pytest.raises(kind) as caught:
            await service.pull(p)
        assert str(caught.value).startswith(message), p
    # retry topics are ordinary readable topics
    send(store, 1, topic="%RETRY%g")
    assert (await service.pull(pull(topic="%RETRY%g"))).count == 1


async def test_piggybacked_commit(
    service: PullService, store: MessageStore, offsets: ConsumerOffsets
) -> None:
    send(store, 5)
    await service.pull(pull(3, commit_offset=3))
    assert offsets.committed("g", "T", 0) == 3


async def test_statuses_of_an_empty_queue(service: PullService) -> None:
    empty = await service.pull(pull())
    assert (empty.status, empty.next_offset) == (GetStatus.NO_NEW_MESSAGE, 0)
    beyond = await service.pull(pull(7))
    assert (beyond.status, beyond.next_offset) == (GetStatus.OFFSET_OVERFLOW, 0)


async def test_a_held_pull_is_answered_when_a_message_lands(
    service: PullService, store: MessageStore
) -> None:
    send(store, 2)
    task = asyncio.create_task(service.pull(pull(2, hold_ms=5000)))
    await eventually(lambda: store.notifier.pending() == 1, 5, "the pull waiting")
    assert service.held == 1
    t0 = time.monotonic()
    store.append(Message("T", b"late", queue_id=0))
    got = await asyncio.wait_for(task, 5)
    waited = time.monotonic() - t0
    assert got.status is GetStatus.FOUND
    assert [m.body for m in decode_records(got.records)] == [b"late"]
    assert waited < 0.5  # woken by the arrival, not by a polling interval
    assert store.notifier.pending() == 0
    assert service.held == 0


async def test_hold_bounds(service: PullService, store: MessageStore) -> None:
    t0 = time.monotonic()
    got = await service.pull(pull(hold_ms=300))
    assert 0.28 <= time.monotonic() - t0 < 1.5
    assert got.status is GetStatus.NO_NEW_MESSAGE
    t0 = time.monotonic()
    await service.pull(pull(hold_ms=60_000), time_remaining_s=0.4)  # the deadline minus margin
    assert 0.25 <= time.monotonic() - t0 < 0.75
    t0 = time.monotonic()
    await service.pull(pull(hold_ms=60_000), time_remaining_s=0.05)  # no time to hold
    assert time.monotonic() - t0 < 0.2
    assert store.notifier.pending() == 0


async def test_long_poll_max_caps_the_hold(
    store: MessageStore, topics: TopicManager, offsets: ConsumerOffsets
) -> None:
    service = PullService(store, topics, offsets, long_poll_max_ms=200)
    t0 = time.monotonic()
    await service.pull(pull(hold_ms=10_000))
    assert 0.18 <= time.monotonic() - t0 < 1.0


async def test_stop_answers_held_pulls_at_once(service: PullService, store: MessageStore) -> None:
    tasks = [asyncio.create_task(service.pull(pull(hold_ms=60_000, queue_id=q))) for q in range(3)]
    await eventually(lambda: service.held == 3, 5, "three pulls held")
    t0 = time.monotonic()
    service.stop()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert time.monotonic() - t0 < 0.5
    assert {r.status for r in results} == {GetStatus.NO_NEW_MESSAGE}
    assert store.notifier.pending() == 0
    t0 = time.monotonic()
    await service.pull(pull(hold_ms=60_000))  # no more holding
    assert time.monotonic() - t0 < 0.5


async def test_a_filtered_hold_passes_over_unmatched_messages(
    service: PullService, store: MessageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    watched = watched_offsets(store, monkeypatch)
    send(store, 3, tag="B")
    first = await service.pull(pull(tag_expression="A"))
    assert (first.status, first.next_offset) == (GetStatus.NO_MATCHED_MESSAGE, 3)
    task = asyncio.create_task(service.pull(pull(3, tag_expression="A", hold_ms=5000)))
    await eventually(lambda: service.held == 1, 5, "one pull held")
    send(store, 2, tag="B")  # wakes the pull, which reads, finds no match and holds on
    await eventually(lambda: 5 in watched, 5, "the pull holding on past the B's")
    assert not task.done()
    send(store, 1, tag="A")
    got = await asyncio.wait_for(task, 5)
    assert got.status is GetStatus.FOUND
    assert [(m.queue_offset, m.tags) for m in decode_records(got.records)] == [(5, "A")]
    # held to the end with only unmatched arrivals: NO_MATCHED_MESSAGE past them
    task = asyncio.create_task(service.pull(pull(6, tag_expression="A", hold_ms=300)))
    await eventually(lambda: service.held == 1, 5, "one pull held")
    send(store, 2, tag="B")
    done = await asyncio.wait_for(task, 5)
    assert (done.status, done.next_offset) == (GetStatus.NO_MATCHED_MESSAGE, 8)


async def test_cold_reads_run_on_a_worker_thread_with_the_same_answer(
    store: MessageStore, topics: TopicManager, offsets: ConsumerOffsets
) -> None:
    send(store, 10)
    threads: list[str] = []
    cold = PullService(store, topics, offsets, inline_read_window=0)
    read = store.get_records

    def spy(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return read(*args)

    store.get_records = spy  # type: ignore[method-assign, assignment]
    try:
        a = await cold.pull(pull(2, max_messages=5))
    finally:
        store.get_records = read  # type: ignore[method-assign]
    hot = PullService(store, topics, offsets)
    b = await hot.pull(pull(2, max_messages=5))
    assert (a.records, a.count, a.next_offset) == (b.records, 5, 7)
    assert threads
    assert threading.main_thread().name not in threads
