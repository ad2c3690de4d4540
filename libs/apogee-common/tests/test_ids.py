"""Unique ids: distinct, ordered within a generator, and decodable back to their time."""

from __future__ import annotations

import threading
import time

import pytest

from apogee.common.ids import IdGenerator, id_timestamp_ms, new_id

pytestmark = pytest.mark.unit


def test_ids_are_32_hex_digits_and_unique_across_threads() -> None:
    gen = IdGenerator()
    seen: list[str] = []
    lock = threading.Lock()

    def work() -> None:
        mine = [gen.next_id() for _ in range(2000)] + gen.next_ids(500)
        with lock:
            seen.extend(mine)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(seen) == 10_000
    assert len(set(seen)) == 10_000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in seen)


def test_batch_ids_continue_the_sequence() -> None:
    gen = IdGenerator(prefix=b"\x01\x02\x03\x04\x05\x06")
    first = gen.next_id()
    batch = gen.next_ids(3)
    after = gen.next_id()
    counters = [int(i[24:], 16) for i in [first, *batch, after]]
    assert counters == list(range(counters[0], counters[0] + 5))
    assert all(i.startswith("010203040506") for i in [first, *batch, after])


def test_timestamp_round_trip() -> None:
    before = time.time_ns() // 1_000_000
    uid = new_id()
    after = time.time_ns() // 1_000_000
    ts = id_timestamp_ms(uid)
    assert ts is not None
    assert before <= ts <= after
    assert id_timestamp_ms("not-an-id") is None
    assert id_timestamp_ms("Z" * 32) is None


def test_prefix_must_be_six_bytes() -> None:
    with pytest.raises(ValueError, match="6 bytes"):
        IdGenerator(prefix=b"\x01")
