"""ConsumeQueue files hold a descriptor only while they are used, at most ``open_files`` at
once: a store with more queues than its process may open files starts, takes messages and
reads them, and a queue nobody uses holds no descriptor."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from apogee.common.clock import ManualClock
from apogee.store.consumequeue import ConsumeQueueTable
from apogee.store.queue_file import FileHandles, QueueFile

pytestmark = pytest.mark.unit

PER_FILE = 64


def open_under(root: Path) -> list[str]:
    """The files under ``root`` this process has open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the directory's own descriptor, closed by now
            continue
        if target.startswith(str(root)):
            found.append(target)
    return found


def entries_of(queue: int, first: int, n: int) -> list[int]:
    """Entries that say which queue they belong to: phys = queue * 1,000,000 + offset."""
    flat: list[int] = []
    for k in range(first, first + n):
        flat += (queue * 1_000_000 + k, 64, queue)
    return flat


def test_many_queues_keep_at_most_the_limit_open_and_read_back(tmp_path: Path) -> None:
    table = ConsumeQueueTable(tmp_path, PER_FILE, open_files=8)
    for q in range(100):  # two files each: 70 entries of 64 per file
        table.get_or_create(f"T{q}", 0).put(0, entries_of(q, 0, 70))
        assert len(open_under(tmp_path)) <= 8
    table.flush()
    for q in range(100):
        cq = table.get(f"T{q}", 0)
        assert cq is not None
        assert cq.entries(60, 10) == [(q * 1_000_000 + k, 64, q) for k in range(60, 70)]
        assert len(open_under(tmp_path)) <= 8
    table.close()
    assert open_under(tmp_path) == []

    again = ConsumeQueueTable(tmp_path, PER_FILE, open_files=8)
    again.load()
    assert len(again.queues) == 100
    assert len(open_under(tmp_path)) <= 8
    for q in random.Random(7).sample(range(100), 100):
        cq = again.get(f"T{q}", 0)
        assert cq is not None
        assert (cq.min_offset, cq.max_offset) == (0, 70)
        assert cq.entries_flat(69, 1) == (q * 1_000_000 + 69, 64, q)
    again.close()


def test_a_queue_file_unused_for_the_idle_time_closes_at_the_next_flush(tmp_path: Path) -> None:
    clock = ManualClock(start_ms=0)
    table = ConsumeQueueTable(tmp_path, PER_FILE, open_files=100)
    table.handles = FileHandles(100, idle_s=60.0, clock=lambda: clock.time_ms() / 1000)
    busy = table.get_or_create("Busy", 0)
    quiet = table.get_or_create("Quiet", 0)
    busy.put(0, entries_of(1, 0, 1))
    quiet.put(0, entries_of(2, 0, 1))
    table.flush()
    assert len(open_under(tmp_path)) == 2

    clock.advance(59_000)
    busy.put(1, entries_of(1, 1, 1))
    clock.advance(2_000)  # Quiet: 61 s unused; Busy: 2 s
    table.flush()
    assert open_under(tmp_path) == [str(busy.files.files[0].path)]
    assert quiet.entries(0, 5) == [(2_000_000, 64, 2)]  # and it opens again when read
    table.close()


def test_an_unflushed_file_is_not_closed_for_idleness(tmp_path: Path) -> None:
    clock = ManualClock(start_ms=0)
    handles = FileHandles(10, idle_s=1.0, clock=lambda: clock.time_ms() / 1000)
    qf = QueueFile(tmp_path / "f", 0, 4096, True, handles)
    qf.write(0, b"x" * 20)
    qf.wrote = 20
    clock.advance(5_000)
    assert handles.close_idle() == 0
    qf.sync()  # a use too: idle from here
    clock.advance(5_000)
    assert handles.close_idle() == 1
    assert handles.open_count == 0
    qf.close()


def test_a_pinned_descriptor_outlives_eviction_and_close(tmp_path: Path) -> None:
    """Regression guard for descriptor reuse: a descriptor closed under a pread can be handed
    to the next file opened, and the pread then reads that file."""
    handles = FileHandles(1)
    a = QueueFile(tmp_path / "a", 0, 4096, True, handles)
    a.write(0, b"A" * 16)
    fd = handles.pin(a)
    b = QueueFile(tmp_path / "b", 0, 4096, True, handles)  # over the limit: a is pinned
    b.write(0, b"B" * 16)
    a.close()
    assert os.pread(fd, 16, 0) == b"A" * 16  # still a's
    with pytest.raises(ValueError, match="closed"):
        a.read(0, 16)
    handles.unpin(a)
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)  # now closed, and b kept its own
    assert b.read(0, 16) == b"B" * 16
    b.close()


def test_readers_on_many_threads_read_only_their_queue_while_descriptors_churn(
    tmp_path: Path,
) -> None:
    """Three descriptors for 24 queues, a writer and four readers: every read returns the
    entries of the queue it asked, never those of a file whose descriptor took the number."""
    table = ConsumeQueueTable(tmp_path, PER_FILE, open_files=3)
    queues = [table.get_or_create(f"T{q}", 0) for q in range(24)]
    for q, cq in enumerate(queues):
        cq.put(0, entries_of(q, 0, 10))
    stop = threading.Event()
    wrong: list[str] = []
    reads = [0] * 4

    def reader(n: int) -> None:
        rng = random.Random(n)
        while not stop.is_set() and reads[n] < 3_000:
            q = rng.randrange(24)
            got = queues[q].entries(0, 10)
            if [e[2] for e in got] != [q] * len(got) or len(got) < 10:
                wrong.append(f"queue {q}: {got[:2]}")
            reads[n] += 1

    def writer() -> None:
        for k in range(10, 10 + PER_FILE * 2):  # into a second file of each queue
            for q, cq in enumerate(queues):
                cq.put(k, entries_of(q, k, 1))
            table.flush()

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(4)]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    threads[-1].join(60)
    stop.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    assert min(reads) > 0
    for q, cq in enumerate(queues):
        assert cq.entries(0, 200) == [(q * 1_000_000 + k, 64, q) for k in range(10 + 128)]
    assert table.handles.opened > 24  # they did churn
    table.close()


_CHILD = """
import resource, sys
from pathlib import Path
from apogee.store import Message, MessageStore, StoreConfig
from apogee.testkit.store import dispatched

resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
root, phase = Path(sys.argv[1]), sys.argv[2]
cfg = StoreConfig(commitlog_file_size=1 << 20, max_message_size=16384,
                  consume_queue_entries_per_file=64, index_slots=97, index_entries_per_file=4000)
store = MessageStore.open(root, cfg, start_retention=False)
try:
    if phase == "write":
        for t in range(150):
            store.append([Message(f"T{t}", f"m{t}-{q}".encode(), queue_id=q) for q in range(4)])
        dispatched(store)
    for t in range(150):
        for q in range(4):
            got = store.get(f"T{t}", q, 0)
            assert [m.body for m in got.messages] == [f"m{t}-{q}".encode()], (t, q, got)
    print("ok", len(store.cqs.queues), store.cqs.handles.open_count)
finally:
    store.close()
"""


def test_a_store_with_more_queues_than_open_files_allowed_writes_and_restarts(
    tmp_path: Path,
) -> None:
    """Regression: each queue written kept its file open (twice, with its map) until the
    store closed; 600 queues under a limit of 128 descriptors failed with EMFILE when written,
    and a store holding them could not open again. Both run in a child process, with that
    limit."""
    for phase in ("write", "read"):
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(tmp_path / "store"), phase],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        words = done.stdout.split()
        assert words[:2] == ["ok", "600"], done.stdout
        assert int(words[2]) <= 64  # a quarter of 128, as the default says
