"""Offset stores: the local file survives restarts and damage; the remote store never lets a
dead broker break a persist (its happy path runs against real brokers in the cluster tests)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from apogee.client._rpc import ChannelPool
from apogee.client.consumer.offset_store import (
    OFFSETS_FILE,
    LocalOffsetStore,
    OffsetStore,
    RemoteOffsetStore,
    default_offset_dir,
)
from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import UnavailableError
from apogee.testkit.ports import free_port

pytestmark = pytest.mark.unit

Q0 = MessageQueue("Orders", "broker-a", 0)
Q1 = MessageQueue("Orders", "broker-a", 1)
Q2 = MessageQueue("Orders", "broker-b", 0)


def test_both_stores_satisfy_the_protocol(tmp_path: Path) -> None:
    stores: list[OffsetStore] = [
        LocalOffsetStore(tmp_path / OFFSETS_FILE),
        RemoteOffsetStore("g", "c", ChannelPool(), lambda _: None, 1.0),
    ]
    for store in stores:
        store.update(Q0, 10)
        store.update(Q0, 7)  # increase only: ignored
        assert store.read(Q0) == 10
        store.update(Q0, 7, increase_only=False)
        assert store.read(Q0) == 7
        store.remove(Q0)
        assert store.read(Q0) is None


async def test_local_offsets_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / OFFSETS_FILE
    store = LocalOffsetStore(path)
    assert await store.load(Q0) is None
    store.update(Q0, 12)
    store.update(Q1, 30)
    store.update(Q2, 5)
    await store.persist_all([Q0, Q1])  # Q2 is not ours to persist now
    content = json.loads(path.read_text())
    assert content == {
        "version": 1,
        "offsets": [
            {"topic": "Orders", "broker_name": "broker-a", "queue_id": 0, "offset": 12},
            {"topic": "Orders", "broker_name": "broker-a", "queue_id": 1, "offset": 30},
        ],
    }
    store.update(Q0, 13)
    store.remove(Q1)  # no longer ours: its offset stays in the file
    await store.persist(Q0)
    assert not path.with_name(OFFSETS_FILE + ".tmp").exists()
    assert path.with_name(OFFSETS_FILE + ".bak").exists()  # the previous version

    again = LocalOffsetStore(path)
    assert await again.load(Q0) == 13
    assert again.read(Q0) == 13  # loading sets the in-memory offset
    assert await again.load(Q1) == 30
    assert await again.load(Q2) is None


async def test_unchanged_offsets_are_not_rewritten(tmp_path: Path) -> None:
    path = tmp_path / OFFSETS_FILE
    store = LocalOffsetStore(path)
    store.update(Q0, 1)
    await store.persist_all([Q0])
    before = path.stat().st_mtime_ns
    path.with_name(OFFSETS_FILE + ".bak").unlink(missing_ok=True)
    await store.persist_all([Q0])
    assert path.stat().st_mtime_ns == before
    assert not path.with_name(OFFSETS_FILE + ".bak").exists()  # no write happened


@pytest.mark.parametrize(
    "damage",
    [
        b"{not json",
        b"\xff\xfe",
        b'["a list"]',
        b'{"version": 1, "offsets": [{"topic": "Orders", "queue_id": 0, "offset": 3}]}',
        b'{"version": 1, "offsets": [{"topic": "T", "broker_name": "b", "queue_id": 0, '
        b'"offset": -4}]}',
        b'{"version": 99, "offsets": []}',
    ],
)
async def test_a_damaged_file_is_reported_and_the_consumer_starts_empty(
    tmp_path: Path, damage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / OFFSETS_FILE
    path.write_bytes(damage)
    store = LocalOffsetStore(path)
    with caplog.at_level(logging.WARNING):
        assert await store.load(Q0) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"the offset file {path} is damaged" in w for w in warnings), warnings
    assert any("starts as if it had no offsets" in w for w in warnings), warnings
    aside = _damaged_copies(tmp_path)
    assert len(aside) == 1
    assert aside[0].read_bytes() == damage  # kept for inspection
    store.update(Q0, 4)
    await store.persist_all([Q0])
    assert await LocalOffsetStore(path).load(Q0) == 4


async def test_a_damaged_file_falls_back_to_its_backup(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / OFFSETS_FILE
    store = LocalOffsetStore(path)
    store.update(Q0, 8)
    await store.persist_all([Q0])
    store.update(Q0, 9)
    await store.persist_all([Q0])  # the file holds 9, its backup 8
    path.write_bytes(b"\0\0\0 torn")
    with caplog.at_level(logging.WARNING):
        assert await LocalOffsetStore(path).load(Q0) == 8
    assert any("using its backup" in r.getMessage() for r in caplog.records)


async def test_a_failing_write_is_logged_once_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "offsets"
    blocker.write_text("a file where the folder should be")
    store = LocalOffsetStore(blocker / OFFSETS_FILE)
    store.update(Q0, 3)
    with caplog.at_level(logging.INFO):
        await store.persist_all([Q0])  # does not raise
        await store.persist_all([Q0])
        failures = [r for r in caplog.records if "failed" in r.getMessage()]
        assert len(failures) == 1
        assert str(blocker / OFFSETS_FILE) in failures[0].getMessage()
        blocker.unlink()
        await store.persist_all([Q0])
    assert any("works again" in r.getMessage() for r in caplog.records)
    assert await LocalOffsetStore(blocker / OFFSETS_FILE).load(Q0) == 3


def test_default_offset_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("APOGEE_HOME", str(tmp_path))
    assert default_offset_dir("orders", "host@12@ab") == tmp_path / "offsets/host@12@ab/orders"
    assert default_offset_dir("g", "../x/y") == tmp_path / "offsets/.._x_y/g"
    monkeypatch.delenv("APOGEE_HOME")
    assert default_offset_dir("g", "c") == Path.home() / ".apogee/offsets/c/g"


def _damaged_copies(folder: Path) -> list[Path]:
    return sorted(folder.glob(OFFSETS_FILE + ".damaged-*"))


def _dead_address() -> str:
    """A local port nothing listens on."""
    return f"127.0.0.1:{free_port()}"


async def test_remote_persist_survives_dead_and_unknown_brokers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = _dead_address()
    addresses = {"broker-a": dead}
    pool = ChannelPool()
    store = RemoteOffsetStore("g", "c1", pool, addresses.get, timeout=1.0)
    try:
        store.update(Q0, 5)
        store.update(Q2, 6)  # broker-b: no address known
        with caplog.at_level(logging.DEBUG, logger="apogee.client.consumer.offset_store"):
            await store.persist_all([Q0, Q1, Q2])  # never raises
            await store.persist_all([Q0, Q2])
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 2, warnings  # once per broker, not at every persist
        assert any("to broker broker-a failed" in w for w in warnings)
        assert any(
            "broker broker-b is unavailable: its address is not in the routes" in w
            for w in warnings
        )
        assert store.read(Q0) == 5  # kept for the next persist
        with pytest.raises(UnavailableError):
            await store.load(Q0)
        with pytest.raises(UnavailableError, match="broker broker-b"):
            await store.load(Q2)
    finally:
        await pool.close()
