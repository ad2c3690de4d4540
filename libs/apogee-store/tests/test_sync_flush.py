"""Synchronous flush: group commit, durability callbacks, timeouts, and what consumers see."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from apogee.common.errors import FlushTimeoutError, StoreClosedError, StoreFailedError
from apogee.store import FlushMode, Message, MessageStore, StoreConfig, mapped_file
from apogee.store.flush import GroupCommit
from apogee.store.mapped_file import MappedFileQueue

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


# -- files zero-filled ahead of the log -----------------------------------------------------------


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_the_first_file_is_made_at_once_and_the_next_is_zero_filled_ahead(
    store: MessageStore, store_dir: Path, config: StoreConfig
) -> None:
    size = config.commitlog_file_size
    store.append(Message("Ahead", b"first"))
    log_dir = store_dir / "commitlog"
    first = log_dir / f"{0:020d}"
    # the first send did not wait for a whole file of zeros: only what was written is allocated
    assert _allocated(first) < size
    files = store.commitlog.files
    assert files.wait_prepared(30)
    ahead = log_dir / f"{size:020d}.preparing"
    assert _allocated(ahead) >= size, "the next file is not zero-filled ahead"
    inode = ahead.stat().st_ino
    body = b"x" * 8000
    while store.commitlog.files.max_offset < size + 1:
        store.append(Message("Ahead", body))
    second = log_dir / f"{size:020d}"
    assert second.stat().st_ino == inode, "the log did not take the prepared file"
    assert not ahead.exists()


def test_a_disk_too_small_for_a_file_ahead_goes_on_sparse_and_says_so_once(
    store: MessageStore,
    store_dir: Path,
    config: StoreConfig,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    real = shutil.disk_usage
    free = 48 << 20  # 48 MiB free: less than a file besides the headroom

    def small_disk(path: str | Path) -> object:
        total, used, _ = real(path)
        return type(real(path))(total, used, free)

    monkeypatch.setattr(shutil, "disk_usage", small_disk)
    size = config.commitlog_file_size
    body = b"y" * 8000
    with caplog.at_level("WARNING", logger="apogee.store.mapped_file"):
        while store.commitlog.files.max_offset < 3 * size + 1:
            store.append(Message("Small", body))
    assert store.wait_dispatched(10)
    told = [r.getMessage() for r in caplog.records if "not zero-filling" in r.getMessage()]
    assert len(told) == 1, told
    assert f"{free} bytes free" in told[0]
    assert f"{size + mapped_file.PREPARE_HEADROOM} needed" in told[0]
    assert not list((store_dir / "commitlog").glob("*.preparing"))
    got = store.get("Small", 0, 0, 1000)
    assert got.messages
    assert all(m.body == body for m in got.messages)


def test_a_file_left_half_prepared_by_a_crash_is_removed_on_open(
    open_store: Callable[..., MessageStore], store_dir: Path, config: StoreConfig
) -> None:
    store = open_store()
    store.append(Message("Left", b"one"))
    store.close()
    left = store_dir / "commitlog" / f"{config.commitlog_file_size:020d}.preparing"
    left.write_bytes(b"\0" * 4096)
    store = open_store()
    assert not left.exists()
    assert [m.body for m in store.get("Left", 0, 0, 10).messages] == [b"one"]


def test_a_log_that_outruns_its_preparation_does_not_wait_for_it(tmp_path: Path) -> None:
    size = 256 << 20
    files = MappedFileQueue(tmp_path, size, zero_fill=True)
    files.load()
    try:
        files.create(0)
        # the log needs the next file before it is ready: it is made sparse instead
        second = files.create(size)
        assert second.path.name == f"{size:020d}"
        assert _allocated(second.path) < size
    finally:
        files.close()
    # closing stopped every preparation and left no half-made file
    assert not list(tmp_path.glob("*.preparing"))
