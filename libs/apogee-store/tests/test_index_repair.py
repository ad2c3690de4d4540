"""The index after a crash between writing slots and its header."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from apogee.store.indexfile import HEADER, IndexService

pytestmark = pytest.mark.unit


def test_slots_past_the_count_are_kept_on_load(tmp_path: Path) -> None:
    service = IndexService(tmp_path / "index", slots=7, entries=100)
    service.load()
    service.add([(f"id-{n}", n * 100, 1_700_000_000_000 + n) for n in range(10)])
    assert service.lookup("id-3", 0, 2**62, 10) == [300]
    f = service.files[-1]
    path = f.mf.path
    service.close()
    # The crash: entries 7..10 and the slots pointing to them were written, the header was not.
    with open(path, "r+b") as raw:
        head = list(HEADER.unpack(raw.read(HEADER.size)))
        head[5] = 6
        raw.seek(0)
        raw.write(struct.pack(HEADER.format, *head))
    reopened = IndexService(tmp_path / "index", slots=7, entries=100)
    reopened.load()
    try:
        assert reopened.files[-1].count == 10
        for n in range(10):
            assert reopened.lookup(f"id-{n}", 0, 2**62, 10) == [n * 100], n
    finally:
        reopened.close()


def test_garbage_chains_end_instead_of_looping(tmp_path: Path) -> None:
    service = IndexService(tmp_path / "index", slots=1, entries=50)
    service.load()
    service.add([(f"k{n}", n, 1_700_000_000_000) for n in range(5)])
    f = service.files[-1]
    # point entry 3's "prev" forward at entry 5: a cycle a naive walk would follow forever
    at = f._entries_at + 3 * 20 + 16
    f.mf.mm[at : at + 4] = (5).to_bytes(4, "little")
    try:
        assert service.lookup("k0", 0, 2**62, 10) == []
        assert service.lookup("k4", 0, 2**62, 10) == [4]
    finally:
        service.close()
