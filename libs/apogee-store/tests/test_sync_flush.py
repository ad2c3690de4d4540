"""Synchronous flush: group commit, durability callbacks, timeouts, and what consumers see."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from apogee.common.errors import FlushTimeoutError, StoreClosedError, StoreFailedError
from apogee.store import FlushMode, Message, MessageStore, StoreConfig
from apogee.store.flush import GroupCommit

pytestmark = pytest.mark.unit


@pytest.fixture
def config(config: StoreConfig) -> StoreConfig:
    return dataclasses.replace(config, flush_mode=FlushMode.SYNC)


def test_concurrent_appends_share_fsyncs(store: MessageStore) -> None:
    writers, each = 16, 25
    start = threading.Barrier(writers)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            start.wait(10)
            for n in range(each):
                store.append(Message("Sync", f"{i}-{n}".encode(), queue_id=i % 4))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    gc = store._group_commit
    assert gc is not None
    assert gc.flushes < writers * each, "every append paid its own fsync: no group commit"
    assert store.wait_dispatched(10)
    assert sum(store.max_offset("Sync", q) for q in range(4)) == writers * each


def test_append_async_calls_back_once_durable_and_only_then_is_readable(
    store: MessageStore,
) -> None:
    done = threading.Event()
    outcome: list[BaseException | None] = []

    def on_durable(err: BaseException | None) -> None:
        outcome.append(err)
        done.set()

    [result] = store.append_async(Message("Aio", b"payload"), on_durable)
    assert done.wait(10)
    assert outcome == [None]
    assert store.commitlog.files.flushed_where >= result.phys_offset + result.size
    assert store.wait_for("Aio", 0, 0, timeout=10)
    got = store.get("Aio", 0, 0)
    assert [m.body for m in got.messages] == [b"payload"]


def test_sync_mode_messages_survive_reopen_without_clean_close(
    open_store: Callable[..., MessageStore], store_dir: Path
) -> None:
    store = open_store()
    results = store.append([Message("Dur", f"m{i}".encode()) for i in range(50)])
    # As if the process died now: its threads stop, nothing more is flushed or checkpointed,
    # the abort marker stays. (test_crash_kill9.py does this with a real kill -9.)
    store.closed = True
    for part in (store._periodic, store._retention_loop, store.dispatcher, store._group_commit):
        if part is not None:
            part.stop()
    store._release()
    reopened = open_store()
    assert not reopened.recovery.clean_shutdown
    got = reopened.get("Dur", 0, 0, 100)
    assert [m.body for m in got.messages] == [f"m{i}".encode() for i in range(50)]
    assert [m.phys_offset for m in got.messages] == [r.phys_offset for r in results]


def test_a_flush_slower_than_the_timeout_raises_flush_timeout() -> None:
    release = threading.Event()

    def slow_flush() -> int:
        release.wait(10)
        return 100

    gc = GroupCommit(slow_flush, durable=0, callback_timeout=1.0)
    leader = threading.Thread(target=gc.wait, args=(100, 10.0))
    leader.start()
    try:
        with pytest.raises(FlushTimeoutError) as caught:
            gc.wait(100, 0.05)
        assert str(caught.value) == (
            "stored but not confirmed durable within 0.05s (flush to offset 100)"
        )
        assert caught.value.retriable
    finally:
        release.set()
        leader.join(10)
    gc.wait(100, 1.0)  # durable now: returns at once


def test_a_failed_flush_fails_waiters_with_a_clear_error() -> None:
    def broken_flush() -> int:
        raise OSError(5, "Input/output error")

    gc = GroupCommit(broken_flush, durable=0, callback_timeout=1.0)
    with pytest.raises(StoreFailedError, match="flush failed"):
        gc.wait(10, 1.0)
    with pytest.raises(StoreFailedError, match="flush failed"):
        gc.wait(10, 1.0)


def test_close_answers_callbacks_still_waiting() -> None:
    release = threading.Event()

    def slow_flush() -> int:
        release.wait(10)
        return 5

    gc = GroupCommit(slow_flush, durable=0, callback_timeout=10.0)
    gc.start()
    got: list[BaseException | None] = []
    answered = threading.Event()

    def cb(err: BaseException | None) -> None:
        got.append(err)
        answered.set()

    gc.when_durable(5, cb)
    release.set()
    assert answered.wait(10)
    assert got == [None]
    gc.stop(10)
    late: list[BaseException | None] = []
    gc.when_durable(50, late.append)
    assert len(late) == 1
    assert isinstance(late[0], StoreClosedError)
