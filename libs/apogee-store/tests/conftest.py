"""Shared fixtures of the apogee.store unit tests.

Every store lives on real files under pytest's ``tmp_path`` and is closed at teardown even when
the test fails. The configuration is shrunk so that a few hundred kilobytes of messages roll
CommitLog, ConsumeQueue and index files: 256 KiB CommitLog files, 64 entries per ConsumeQueue
file, 97 index slots and 400 index entries per index file.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apogee.common.clock import ManualClock
from apogee.store import MessageStore, StoreConfig
from apogee.testkit import store as testing
from apogee.testkit.store import OpenStore

KiB = 1024

SMALL_CONFIG = StoreConfig(
    commitlog_file_size=256 * KiB,
    max_message_size=16 * KiB,
    consume_queue_entries_per_file=64,
    index_slots=97,
    index_entries_per_file=400,
)


@pytest.fixture
def config() -> StoreConfig:
    return SMALL_CONFIG


@pytest.fixture
def clock() -> ManualClock:
    """A clock that only moves when told to, starting at the real time (file mtimes are real)."""
    return ManualClock(start_ms=time.time_ns() // 1_000_000)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def open_store(store_dir: Path, config: StoreConfig, clock: ManualClock) -> Iterator[OpenStore]:
    """Opens stores (for close-and-reopen tests); every store it opened is closed at teardown."""
    with contextlib.ExitStack() as stack:

        def _open(
            cfg: StoreConfig | None = None, *, root: Path | None = None, **kwargs: Any
        ) -> MessageStore:
            kwargs.setdefault("clock", clock)
            kwargs.setdefault("start_retention", False)
            opened = MessageStore.open(root or store_dir, cfg or config, **kwargs)
            stack.callback(opened.close)  # close() is safe to call twice
            return opened

        yield _open


@pytest.fixture
def store(open_store: OpenStore) -> MessageStore:
    """A store opened with the small configuration and the manual clock."""
    return open_store()


@pytest.fixture(scope="session")
def crc32_twins() -> tuple[str, str]:
    """Two different tags of equal length with the same CRC-32 (the same tag code)."""
    return testing.crc32_twins()
