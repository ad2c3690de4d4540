"""The dedup window: a record carrying ``APOGEE_DEDUP_ID`` is stored once per topic within the
window; records without it are never looked at; a store opened again gives the window back."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from apogee.codec.send import encode_properties, encode_send_record
from apogee.store import Message, MessageStore
from apogee.testkit.store import dispatched
from apogee_broker.core.send.dedup import PENDING, DedupWindow, dedup_id
from apogee_broker.core.send.dedup_log import rebuild
from apogee_broker.core.send.record_intake import RecordIntake, RecordsOutcome

pytestmark = pytest.mark.unit


def _sibling(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"_{name}", Path(__file__).with_name(f"{name}.py")
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


Broker = Any
_sending = _sibling("test_broker_sending")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = _sending.make_broker(tmp_path)
    b.sending.dedup = DedupWindow(600.0, 100)
    try:
        yield b
    finally:
        b.store.close()


def record(body: bytes, uid: str, dedup: str = "", queue_id: int = 1) -> bytes:
    props = {"a": "1", **({"APOGEE_DEDUP_ID": dedup} if dedup else {})}
    m = Message("Orders", body, queue_id, properties=props)
    return bytes(
        encode_send_record(
            m.topic.encode(), m.body, encode_properties("", (), uid, m.properties), queue_id=1
        )
    )


async def send(broker: Broker, *records: bytes) -> RecordsOutcome:
    return await RecordIntake(broker.sending).send(b"".join(records), "10.0.0.9:5555")


def test_the_id_is_found_anywhere_in_the_properties() -> None:
    assert dedup_id("APOGEE_DEDUP_ID\x01q:1:0:7\x02a\x011\x02") == "q:1:0:7"
    assert dedup_id("a\x011\x02APOGEE_DEDUP_ID\x01q:1:0:8\x02") == "q:1:0:8"
    assert dedup_id("a\x011\x02XAPOGEE_DEDUP_ID\x01no\x02") == ""


async def test_a_message_sent_again_with_its_id_is_not_stored_twice(broker: Broker) -> None:
    first = await send(broker, record(b"a", "U1", "q:0:0:0"), record(b"b", "U2", "q:0:0:1"))
    assert list(first.queue_offsets) == [0, 1]
    again = await send(
        broker,
        record(b"a", "U3", "q:0:0:0"),
        record(b"c", "U4", "q:0:0:2"),
        record(b"b", "U5", "q:0:0:1"),
    )
    # the copies answer where the first ones are; only the new one is stored
    assert list(again.queue_offsets) == [0, 2, 1]
    assert again.others == []
    dispatched(broker.store)
    assert [m.body for m in broker.store.get("Orders", 1, 0).messages] == [b"a", b"b", b"c"]
    assert broker.sending.dedup.dropped == 2


async def test_messages_without_an_id_are_all_stored(broker: Broker) -> None:
    out = await send(broker, record(b"a", "U1"), record(b"a", "U1"))
    assert list(out.queue_offsets) == [0, 1]


def test_ids_are_forgotten_after_the_window_and_beyond_the_cap() -> None:
    now = [0.0]
    window = DedupWindow(10.0, 3, clock=lambda: now[0])
    assert window.claim("T", "x") is None
    window.stored("T", "x", 5)
    assert window.claim("T", "x") == 5
    assert window.claim("U", "x") is None  # per topic
    assert window.offset_of("U", "x") == PENDING
    window.release("U", "x")
    now[0] = 10.0
    assert window.claim("T", "x") is None  # forgotten: the window passed
    for key in "abcd":
        window.claim("T", key)
    assert len(window) == 3
    assert window.claim("T", "a") is None  # the oldest went first


async def test_the_window_is_read_back_from_the_log_after_a_restart(tmp_path: Path) -> None:
    """Ids stored within the window come back when the store is opened again (only those: the
    files before the window are not read), under their topic and with their queue offset."""
    b = _sending.make_broker(tmp_path)
    clock = b.clock
    b.sending.dedup = DedupWindow(600.0, 10_000, clock=clock.monotonic)
    filler = b"x" * 900
    try:
        for i in range(0, 400, 4):  # past the window by the end: more than one file of them
            await send(b, *[record(filler, f"O{j}", f"old-{j}") for j in range(i, i + 4)])
        clock.advance(700)
        new = await send(
            b,
            record(b"n0", "N0", "new-0"),
            record(b"n1", "N1", "new-1"),
            record(b"APOGEE_DEDUP_ID\x01in-the-body", "N2"),  # not a property: not an id
            record(b"plain", "N3"),
        )
        clock.advance(10)
    finally:
        b.store.close()
    store = MessageStore.open(
        tmp_path / "store", _sending.CONFIG, clock=clock, start_retention=False
    )
    try:
        window = DedupWindow(600.0, 10_000, clock=clock.monotonic)
        report = rebuild(window, store, clock.time_ms())
    finally:
        store.close()
    assert report.ids == len(window) == 2
    assert report.from_offset > 0  # the files wholly before the window were skipped
    assert window.claim("Orders", "new-1") == new.queue_offsets[1]
    assert window.claim("Orders", "old-399") is None  # older than the window: forgotten
    clock.advance(600)  # their window counts from when they were stored
    assert window.claim("Orders", "new-0") is None
