"""ConsumeQueue: per (topic, queue), the position of each message in the CommitLog.

Files live under ``consumequeue/<topic>/<queue id>/`` and hold ``entries_per_file`` entries each
(300,000 by default), named like CommitLog files by the byte offset of their first entry. Entry
``n`` of a queue (its queue offset) sits at byte ``20 * n``. One entry, little-endian::

    0                8        12               20
    +----------------+--------+----------------+
    | commitlog off  |  size  |   tag code     |
    +----------------+--------+----------------+

``tag code`` is the CRC-32 of the message's tag (0 without one) so that pulls can filter before
touching the CommitLog; the schedule topic keeps the delivery time there instead. An entry with
size 0 has not been written. Entries are written only by the dispatcher, in queue-offset order,
and become visible when ``max_offset`` moves past them.

The files are :class:`~apogee.store.queue_file.QueueFile` objects: a queue holds a descriptor
only while it is read or written, and a store at most ``FileHandles.limit`` of them (see
``queue_file``). The table notes each queue written since the last flush, and flushes only
those: with 80,000 queues, a flush that visited each one every half second cost a tenth of a
second of the interpreter every time.

A queue may begin past offset 0: in a store that started over (``MessageStore.start_over``) its
first entry is its first record's queue offset, and the entries before it stay unwritten. Its
``min_offset`` is that first entry, when it is written and when the files are loaded again.
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from apogee.common.files import fsync_dir, sync_filesystem
from apogee.store.mapped_file import MappedFileQueue
from apogee.store.queue_file import FileHandles, QueueFile, default_limit

ENTRY = struct.Struct("<qiq")
ENTRY_SIZE = ENTRY.size  # 20
assert ENTRY_SIZE == 20

_packers: dict[int, struct.Struct] = {}
_MAX_PACK = 512


def _packer(n: int) -> struct.Struct:
    s = _packers.get(n)
    if s is None:
        s = _packers[n] = struct.Struct("<" + "qiq" * n)
    return s


class ConsumeQueue:
    def __init__(
        self,
        root: Path,
        topic: str,
        queue_id: int,
        entries_per_file: int,
        handles: FileHandles | None = None,
        written: deque[ConsumeQueue] | None = None,
    ) -> None:
        self.topic = topic
        self.queue_id = queue_id
        self.handles = handles if handles is not None else FileHandles(default_limit())

        def open_file(path: Path, start: int, size: int, create: bool) -> QueueFile:
            return QueueFile(path, start, size, create, self.handles)

        self.files = MappedFileQueue(
            root / topic / str(queue_id), entries_per_file * ENTRY_SIZE, opener=open_file
        )
        self.min_offset = 0
        #: one past the last visible entry
        self.max_offset = 0
        #: where the queue goes when written, for the next flush (see ConsumeQueueTable.flush)
        self._written = written if written is not None else deque()
        self._noted = False

    # -- writing (dispatcher thread only) -------------------------------------------------------

    def put(self, first_offset: int, flat: list[int]) -> None:
        """Write consecutive entries from ``first_offset``; ``flat`` is phys, size, tag, ..."""
        n = len(flat) // 3
        if first_offset > self.max_offset == self.min_offset:  # the first entry anchors it
            self.min_offset = first_offset
        done = 0
        fsize = self.files.file_size
        while done < n:
            byte_off = (first_offset + done) * ENTRY_SIZE
            mf = self.files.file_for(byte_off)
            pos = byte_off - mf.start
            count = min(n - done, (fsize - pos) // ENTRY_SIZE, _MAX_PACK)
            data = _packer(count).pack(*flat[done * 3 : (done + count) * 3])
            mf.write(pos, data)
            mf.wrote = max(mf.wrote, pos + len(data))
            done += count
        end = first_offset + n
        self.max_offset = max(self.max_offset, end)
        self.note_written()

    def note_written(self) -> None:
        """Put the queue on its table's list of queues to flush (once)."""
        # after the write: a flush that takes the queue and clears the flag does so after this
        # check saw it set, so it flushes what was just written
        if not self._noted:
            self._noted = True
            self._written.append(self)

    # -- reading --------------------------------------------------------------------------------

    def entries(self, offset: int, max_count: int) -> list[tuple[int, int, int]]:
        """Up to ``max_count`` entries from ``offset`` (clamped to what is visible)."""
        end = min(self.max_offset, offset + max_count)
        out: list[tuple[int, int, int]] = []
        fsize = self.files.file_size
        while offset < end:
            byte_off = offset * ENTRY_SIZE
            mf = self.files.find(byte_off)
            if mf is None:
                break
            pos = byte_off - mf.start
            count = min(end - offset, (fsize - pos) // ENTRY_SIZE)
            try:
                raw = mf.read(pos, count * ENTRY_SIZE)
            except ValueError:  # deleted by retention under us
                break
            out.extend(ENTRY.iter_unpack(raw))
            offset += count
        return out

    def entries_flat(self, offset: int, max_count: int) -> tuple[int, ...]:
        """Like :meth:`entries`, flattened (phys, size, tag, phys, size, tag, ...) and limited
        to one file: the fast path of reads, one C call instead of a tuple per entry."""
        end = min(self.max_offset, offset + max_count)
        if end <= offset:
            return ()
        byte_off = offset * ENTRY_SIZE
        mf = self.files.find(byte_off)
        if mf is None:
            return ()
        pos = byte_off - mf.start
        count = min(end - offset, (self.files.file_size - pos) // ENTRY_SIZE, _MAX_PACK)
        try:
            return _packer(count).unpack(mf.read(pos, count * ENTRY_SIZE))
        except ValueError:  # deleted by retention under us
            return ()

    def entry(self, offset: int) -> tuple[int, int, int] | None:
        got = self.entries(offset, 1)
        return got[0] if got else None

    def offset_for_timestamp(self, ts_ms: int, store_ts_at: Callable[[int], int | None]) -> int:
        """The first queue offset whose message was stored at or after ``ts_ms`` (binary search,
        reading store timestamps from the CommitLog); ``max_offset`` if none is."""
        lo, hi = self.min_offset, self.max_offset
        while lo < hi:
            mid = (lo + hi) // 2
            e = self.entry(mid)
            ts = store_ts_at(e[0]) if e is not None else None
            if ts is None or ts < ts_ms:  # its record is gone: everything up to here is older
                lo = mid + 1
            else:
                hi = mid
        return lo

    # -- recovery and retention -----------------------------------------------------------------

    def load(self) -> None:
        """Open the files and find the last written entry (a non-zero size)."""
        self.files.load()
        files = self.files.files
        if not files:
            return
        self.min_offset = _first_written(files[0]) // ENTRY_SIZE
        for mf in files:
            mf.wrote = mf.flushed = 0
        last_end = files[0].start
        for mf in reversed(files):
            used = _last_written(mf)
            if used:
                n = -(-used // ENTRY_SIZE)
                mf.wrote = mf.flushed = n * ENTRY_SIZE
                last_end = mf.start + mf.wrote
                for earlier in files[: files.index(mf)]:
                    earlier.wrote = earlier.flushed = self.files.file_size
                break
        self.max_offset = last_end // ENTRY_SIZE
        self.files.flushed_where = last_end

    def truncate(self, offset: int) -> int:
        """Drop entries from queue offset ``offset`` on; returns how many were dropped."""
        if offset >= self.max_offset:
            return 0
        dropped = self.max_offset - offset
        self.files.truncate(offset * ENTRY_SIZE)
        self.max_offset = offset
        self.min_offset = min(self.min_offset, offset)
        self.note_written()
        return dropped

    def correct_min_offset(self, commitlog_min: int) -> None:
        """Move ``min_offset`` to the first entry whose message is still in the CommitLog."""
        lo, hi = self.min_offset, self.max_offset
        while lo < hi:
            mid = (lo + hi) // 2
            e = self.entry(mid)
            if e is not None and e[0] >= commitlog_min:
                hi = mid
            else:
                lo = mid + 1
        self.min_offset = lo

    def delete_expired(self, commitlog_min: int) -> int:
        """Delete leading files whose every entry points below ``commitlog_min``."""
        self.correct_min_offset(commitlog_min)
        per_file = self.files.file_size // ENTRY_SIZE
        files = self.files.files
        count = 0
        for mf in files[:-1]:
            if (mf.start // ENTRY_SIZE) + per_file <= self.min_offset:
                count += 1
            else:
                break
        return len(self.files.drop_first(count))

    def flush(self) -> int:
        self._noted = False
        return self.files.flush()

    def taken(self) -> list[tuple[QueueFile, int]]:
        """Taken off its table's list to be flushed by a sync of the whole file system:
        what that sync makes durable (``MappedFileQueue.unflushed``)."""
        self._noted = False
        return self.files.unflushed()

    def close(self) -> None:
        self.files.close()


def _first_written(mf: QueueFile) -> int:
    """The byte offset of the first written entry of ``mf`` (a queue's first file), or its
    start when it has none: entries before a queue's first one stay zero."""
    if ENTRY.unpack(mf.read(0, ENTRY_SIZE))[1]:
        return mf.start
    for start, end in mf.data_regions():
        for at in range(start, end, _SCAN):
            chunk = mf.read(at, min(_SCAN, end - at))
            lead = len(chunk) - len(chunk.lstrip(b"\x00"))
            if lead < len(chunk):
                first = at + lead
                return mf.start + first - first % ENTRY_SIZE
    return mf.start


def _last_written(mf: QueueFile) -> int:
    """One past the last non-zero byte of ``mf`` (0 when it has none), read from its data
    regions only, from the end back, with ``pread``: a queue file is a sparse 6 MB of which a
    quiet queue has written a few entries, and reading it whole (or through its map) at every
    start would fault in all of it, for every queue the broker ever had."""
    for start, end in reversed(mf.data_regions()):
        at = end
        while at > start:
            lo = max(start, at - _SCAN)
            used = len(mf.read(lo, at - lo).rstrip(b"\x00"))
            if used:
                return lo + used
            at = lo
    return 0


def _subdirs(path: Path) -> list[str]:
    """The names of the directories in ``path``, sorted."""
    with os.scandir(path) as listing:
        return sorted(e.name for e in listing if e.is_dir())


#: queues to flush at once from which one sync of the whole file system does it
SYNCFS_QUEUES = 64

#: bytes read at a time when looking for a queue file's first or last entry
_SCAN = 64 * 1024


class ConsumeQueueTable:
    """Every ConsumeQueue of a store, created on first use, sharing one :class:`FileHandles`."""

    def __init__(
        self,
        root: Path,
        entries_per_file: int,
        open_files: int = 0,
        idle_close_s: float = 60.0,
    ) -> None:
        """``open_files``: at most this many queue files open at once (0: a quarter of the
        process's descriptor limit, see ``queue_file.default_limit``); a file unused for
        ``idle_close_s`` seconds is closed at the next flush."""
        self.root = root
        self.entries_per_file = entries_per_file
        self.handles = FileHandles(open_files or default_limit(), idle_close_s)
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
        self._written: deque[ConsumeQueue] = deque()
        self._lock = threading.Lock()

    def _new(self, topic: str, queue_id: int) -> ConsumeQueue:
        return ConsumeQueue(
            self.root, topic, queue_id, self.entries_per_file, self.handles, self._written
        )

    def get(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        return self.queues.get((topic, queue_id))

    def get_or_create(self, topic: str, queue_id: int) -> ConsumeQueue:
        cq = self.queues.get((topic, queue_id))
        if cq is None:
            with self._lock:
                cq = self.queues.get((topic, queue_id))
                if cq is None:
                    cq = self._new(topic, queue_id)
                    cq.files.dir.mkdir(parents=True, exist_ok=True)
                    # in place, not a copy: a copy per new queue made touching n queues cost
                    # n * n / 2 entries copied. Readers on other threads look one key up (one
                    # step under the GIL) or iterate over a list of the values (__iter__).
                    self.queues[(topic, queue_id)] = cq
        return cq

    def load(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        queues: dict[tuple[str, int], ConsumeQueue] = {}
        for topic in _subdirs(self.root):
            for qid in _subdirs(self.root / topic):
                if qid.isdigit():
                    cq = self._new(topic, int(qid))
                    cq.load()
                    queues[(cq.topic, cq.queue_id)] = cq
        self.queues = queues

    def remove_all(self) -> int:
        """Delete every queue, its files and directories durably (see
        ``MessageStore.start_over``); returns how many queues there were. A reader holding one
        finds its files closed, as after retention."""
        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock:
            queues, self.queues = self.queues, {}
        for cq in queues.values():
            cq.files.destroy()
        for path in self.root.iterdir():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        fsync_dir(self.root)
        return len(queues)

    def __iter__(self) -> Iterator[ConsumeQueue]:
        return iter(list(self.queues.values()))

    def flush(self) -> None:
        """Flush each queue written since the last flush, then close the descriptors that
        have been idle for ``idle_close_s``. With :data:`SYNCFS_QUEUES` or more to flush, one
        ``syncfs`` of the file system flushes them all: an ``fdatasync`` each took 1 to 2 ms
        here, minutes for the 80,000 queues that recovery writes again after a crash of a
        broker of 10,000 topics."""
        written = self._written
        # what a writer adds meanwhile waits for the next flush
        queues = [written.popleft() for _ in range(len(written))]
        done = 0
        try:
            if len(queues) >= SYNCFS_QUEUES:
                marks = [cq.taken() for cq in queues]
                if sync_filesystem(self.root):
                    for cq, mark in zip(queues, marks, strict=True):
                        cq.files.flushed_to(mark)
                    done = len(queues)
            for cq in queues[done:]:
                cq.flush()
                done += 1
        except BaseException:
            for cq in queues[done:]:  # flushed at the next try
                cq.note_written()
            raise
        self.handles.close_idle()

    def close(self) -> None:
        for cq in self:
            cq.close()
