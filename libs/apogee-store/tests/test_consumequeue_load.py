"""A ConsumeQueue finds where its entries end (and, for a queue that begins past offset 0,
where they start) by reading only the parts of its sparse files that hold data: a broker
with thousands of quiet queues must not read (or fault in) 6 MB for each at every start."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from apogee.store.consumequeue import ENTRY, ENTRY_SIZE, ConsumeQueue, ConsumeQueueTable

pytestmark = pytest.mark.unit

#: entries per file as the broker has them by default (a 6,000,000-byte file)
PER_FILE = 300_000


def entries(first: int, n: int) -> list[int]:
    """phys, size, tag of ``n`` consecutive entries from queue offset ``first``."""
    flat: list[int] = []
    for k in range(first, first + n):
        flat += (1000 + 64 * k, 64, 7)
    return flat


def reopen(root: Path) -> ConsumeQueue:
    table = ConsumeQueueTable(root, PER_FILE)
    table.load()
    cq = table.get("Quiet", 0)
    assert cq is not None
    return cq


def test_quiet_queues_load_their_ends_without_faulting_in_their_files(tmp_path: Path) -> None:
    """Regression: loading read each queue's last file whole through its map, 6 MB of page
    faults a queue (part of why a broker with 100 topics of 8 quiet queues came back from
    kill -9 at 0.6-1.5 GiB resident). Ten such queues now fault in a few pages each."""
    table = ConsumeQueueTable(tmp_path, PER_FILE)
    for q in range(10):
        table.get_or_create("Quiet", q).put(0, entries(0, 3))
    table.flush()
    table.close()

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    again = ConsumeQueueTable(tmp_path, PER_FILE)
    again.load()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    assert faults < 1_000, f"{faults} page faults loading 10 queues of 3 entries"
    for q in range(10):
        cq = again.get("Quiet", q)
        assert cq is not None
        assert (cq.min_offset, cq.max_offset) == (0, 3)
        assert cq.entry(2) == (1000 + 64 * 2, 64, 7)
    again.close()


def test_entries_after_a_hole_and_a_queue_that_begins_late_load_as_written(
    tmp_path: Path,
) -> None:
    """A queue that started over at offset 250,000 (entries before it unwritten, a hole of
    5 MB) in its first file and went on into a second: its first entry, its end, and what is
    between read back after a reload."""
    table = ConsumeQueueTable(tmp_path, PER_FILE)
    cq = table.get_or_create("Quiet", 0)
    cq.put(250_000, entries(250_000, 50_010))  # ends 10 entries into the second file
    cq.flush()
    table.close()

    again = reopen(tmp_path)
    assert (again.min_offset, again.max_offset) == (250_000, 300_010)
    assert again.entry(250_000) == (1000 + 64 * 250_000, 64, 7)
    assert again.entry(300_009) == (1000 + 64 * 300_009, 64, 7)
    assert again.entry(300_010) is None
    again.close()


def test_a_file_written_with_zeros_throughout_still_loads_its_end(tmp_path: Path) -> None:
    """A file system that keeps no holes (or a file zero-filled when made) reports the whole
    file as data: the end is then found by reading back from its end, as before."""
    table = ConsumeQueueTable(tmp_path, PER_FILE)
    cq = table.get_or_create("Quiet", 0)
    cq.put(0, entries(0, 5))
    cq.flush()
    table.close()
    (path,) = (tmp_path / "Quiet" / "0").iterdir()
    with path.open("r+b") as f:  # fill the hole after the entries with written zeros
        f.seek(5 * ENTRY_SIZE)
        left = PER_FILE * ENTRY_SIZE - 5 * ENTRY_SIZE
        while left:
            n = min(left, 1 << 20)
            f.write(bytes(n))
            left -= n

    again = reopen(tmp_path)
    assert (again.min_offset, again.max_offset) == (0, 5)
    raw = again.files.files[0].read(4 * ENTRY_SIZE, ENTRY_SIZE)
    assert ENTRY.unpack(raw) == (1000 + 64 * 4, 64, 7)
    again.close()


def test_touching_many_queues_adds_each_once(tmp_path: Path) -> None:
    table = ConsumeQueueTable(tmp_path, 1_000)
    made = [table.get_or_create(f"T{i // 8}", i % 8) for i in range(4_000)]
    assert len(table.queues) == 4_000
    assert all(table.get_or_create(cq.topic, cq.queue_id) is cq for cq in made)
    assert sorted((cq.topic, cq.queue_id) for cq in table) == sorted(table.queues)
    table.close()


def test_cutting_quiet_queues_back_faults_in_nothing_of_their_files(tmp_path: Path) -> None:
    """Regression: recovery cuts every queue written since the last checkpoint back before
    writing its entries again, and the cut read the file a megabyte at a time through its map
    until a megabyte of zeros: about 1.8 MB resident for each queue. A broker of 1,000 topics
    came back from kill -9 at 5.8-12 GiB resident, after 48-93 s. The cut now reads and writes
    only where the file holds data, with pread."""
    table = ConsumeQueueTable(tmp_path, PER_FILE)
    cqs = [table.get_or_create("Quiet", q) for q in range(10)]
    for cq in cqs:
        cq.put(0, entries(0, 3))

    blocks = [cq.files.files[0].path.stat().st_blocks for cq in cqs]

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    dropped = [cq.truncate(1) for cq in cqs]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    assert dropped == [2] * 10
    assert faults < 1_000, f"{faults} page faults cutting 10 queues of 3 entries"
    # and the files' holes stay holes (no megabyte of zeros written into each)
    assert [cq.files.files[0].path.stat().st_blocks for cq in cqs] == blocks
    for cq in cqs:
        assert cq.max_offset == 1
        assert cq.entry(0) == (1000, 64, 7)
        raw = cq.files.files[0].read(ENTRY_SIZE, 2 * ENTRY_SIZE)
        assert raw == bytes(2 * ENTRY_SIZE)  # the cut entries are zeros on disk
    table.close()
