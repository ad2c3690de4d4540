"""Files that hold a descriptor only while they are used: the ConsumeQueue's files.

A broker has a ConsumeQueue per queue of every topic, and a file or more per ConsumeQueue:
tens of thousands of them with thousands of topics. A file that kept its descriptor (and a
mapping, which in Python holds a second one) from its first write until the broker stopped ran
the process out of descriptors (``EMFILE``) with 10,000 topics of 8 queues, refused sends, and
then could not start again: loading the queues opened every file. RocketMQ meets the same wall
and moved its queues into RocksDB (RIP-66).

Here a :class:`QueueFile` opens its descriptor when it is read or written, through a
:class:`FileHandles` shared by every queue of a store, which keeps at most ``limit`` of them
open: the least recently used is closed when another must open, and one unused for
``idle_s`` is closed by :meth:`FileHandles.close_idle`, which the store's flush loop calls. A
queue that nobody reads or writes then costs no descriptor and no mapping. Reads are
``pread``, no map: a queue entry is 20 bytes and a pull reads a few hundred at most.

A descriptor in use is *pinned*: it is never closed under a ``pread``, ``pwrite`` or
``fdatasync`` that uses it, for once closed its number can be given to another file at once,
and the call would then read or write that one. Closing a file (retention, a store's close)
marks it closed at once, so no one pins it again (``ValueError``, as a closed map raises), and
closes the descriptor when the last pin goes.

Writes closed before they were flushed stay in the page cache: ``fdatasync`` on a descriptor
opened later writes them, for it flushes the file, not the descriptor. Eviction still prefers
files with nothing left to flush.

Lock order: :attr:`FileHandles._lock` is taken last, after any lock of the store, and nothing
is called under it but ``open`` and ``close``.
"""

from __future__ import annotations

import errno
import os
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from apogee.common.errors import DiskFullError
from apogee.store.mapped_file import data_regions, disk_error, zero_from

#: how far into the least recently used descriptors eviction looks for one with nothing to flush
_CLEAN_SCAN = 64


def default_limit() -> int:
    """A quarter of the process's descriptor limit, between 64 and 4,096: room is left for
    connections, the CommitLog and the index, and a busy broker reopens few files."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(64, min(4096, soft // 4))


class FileHandles:
    """The open descriptors of the :class:`QueueFile` objects of one store, at most ``limit``
    at once (more only while more are pinned), least recently used first."""

    def __init__(
        self, limit: int, idle_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self.limit = limit
        self.idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open: OrderedDict[QueueFile, None] = OrderedDict()
        #: descriptors opened (metrics and tests: a steady load reopens few)
        self.opened = 0

    @property
    def open_count(self) -> int:
        return len(self._open)

    def pin(self, qf: QueueFile) -> int:
        """The descriptor of ``qf``, opened when it is not, held open until :meth:`unpin`."""
        with self._lock:
            if qf.gone:
                raise ValueError(f"{qf.path} is closed")
            fd = qf.fd
            if fd < 0:
                fd = self._open_locked(qf)
            else:
                self._open.move_to_end(qf)
            qf.pins += 1
            qf.used = self._clock()
            return fd

    def unpin(self, qf: QueueFile) -> None:
        with self._lock:
            qf.pins -= 1
            if qf.pins == 0 and (qf.gone or len(self._open) > self.limit):
                if qf.gone:
                    self._close_locked(qf)
                else:
                    self._evict_locked()

    def adopt(self, qf: QueueFile, fd: int) -> None:
        """Count ``fd``, just opened by ``qf``, as one of the open descriptors."""
        with self._lock:
            qf.fd = fd
            qf.used = self._clock()
            self._open[qf] = None
            self.opened += 1
            self._evict_locked()

    def retire(self, qf: QueueFile) -> None:
        """Mark ``qf`` closed; its descriptor closes now, or when its last pin goes."""
        with self._lock:
            qf.gone = True
            if qf.pins == 0:
                self._close_locked(qf)

    def close_idle(self) -> int:
        """Close every descriptor unused for ``idle_s`` seconds and with nothing left to
        flush; returns how many."""
        cutoff = self._clock() - self.idle_s
        with self._lock:
            idle: list[QueueFile] = []
            for qf in self._open:
                if qf.used > cutoff:
                    break  # least recently used first: the rest are newer
                if qf.pins == 0 and qf.flushed >= qf.wrote:
                    idle.append(qf)
            for qf in idle:
                self._close_locked(qf)
        return len(idle)

    def _open_locked(self, qf: QueueFile) -> int:
        self._evict_locked(room=1)
        try:
            fd = os.open(qf.path, os.O_RDWR)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            # the process ran out with others' descriptors: give back half of ours, once
            self._evict_locked(room=len(self._open) // 2 + 1)
            fd = os.open(qf.path, os.O_RDWR)
        qf.fd = fd
        self._open[qf] = None
        self.opened += 1
        return fd

    def _evict_locked(self, room: int = 0) -> None:
        """Close the least recently used descriptors until ``room`` more fit in the limit,
        never a pinned one; among the oldest ``_CLEAN_SCAN``, those with nothing left to flush
        first."""
        excess = len(self._open) + room - self.limit
        if excess <= 0:
            return
        clean: list[QueueFile] = []
        unpinned: list[QueueFile] = []
        for seen, qf in enumerate(self._open):
            if qf.pins:
                continue
            if qf.flushed >= qf.wrote:
                clean.append(qf)
                if len(clean) >= excess:
                    break
            elif len(unpinned) < excess:
                unpinned.append(qf)
            if seen >= _CLEAN_SCAN and len(clean) + len(unpinned) >= excess:
                break
        for qf in (clean + unpinned)[:excess]:
            self._close_locked(qf)

    def _close_locked(self, qf: QueueFile) -> None:
        fd = qf.fd
        if fd >= 0:
            qf.fd = -1
            del self._open[qf]
            os.close(fd)


class QueueFile:
    """One file of a ConsumeQueue, read with ``pread`` and written with ``pwrite`` through a
    descriptor its :class:`FileHandles` opens when needed. Thread-safe as a
    :class:`~apogee.store.mapped_file.MappedFile` is: one writer, any number of readers."""

    __slots__ = (
        "fd",
        "flushed",
        "gone",
        "handles",
        "path",
        "pins",
        "size",
        "start",
        "used",
        "wrote",
    )

    def __init__(
        self, path: Path, start: int, size: int, create: bool, handles: FileHandles
    ) -> None:
        self.path = path
        self.start = start
        self.size = size
        self.handles = handles
        self.fd = -1
        self.pins = 0
        self.used = 0.0
        self.gone = False
        self.wrote = 0
        self.flushed = 0
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.ftruncate(fd, size)
            except OSError as exc:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise disk_error(exc, path, f"{size} bytes wanted") from exc
            handles.adopt(self, fd)
        # else it exists, at its full size (MappedFileQueue.load extends one cut short)

    @property
    def end(self) -> int:
        return self.start + self.wrote

    @property
    def closed(self) -> bool:
        return self.gone

    def read(self, pos: int, size: int) -> bytes:
        """``size`` bytes from ``pos`` (``ValueError`` once the file is closed)."""
        fd = self.handles.pin(self)
        try:
            return os.pread(fd, size, pos)
        finally:
            self.handles.unpin(self)

    def write(self, pos: int, data: bytes) -> None:
        fd = self.handles.pin(self)
        try:
            written = os.pwrite(fd, data, pos)
        except OSError as exc:
            raise disk_error(exc, self.path, f"writing {len(data)} bytes at {pos}") from exc
        finally:
            self.handles.unpin(self)
        if written != len(data):
            raise DiskFullError(path=str(self.path), detail=f"short write at {pos}")

    def sync(self) -> None:
        self.sync_to(self.wrote)

    def sync_to(self, wrote: int) -> None:
        fd = self.handles.pin(self)
        try:
            os.fdatasync(fd)
        finally:
            self.handles.unpin(self)
        self.flushed = max(self.flushed, wrote)

    def zero_from(self, pos: int) -> int:
        fd = self.handles.pin(self)
        try:
            return zero_from(fd, self.size, pos, self.write)
        finally:
            self.handles.unpin(self)

    def data_regions(self) -> list[tuple[int, int]]:
        fd = self.handles.pin(self)
        try:
            return data_regions(fd, self.size)
        finally:
            self.handles.unpin(self)

    def close(self) -> None:
        self.handles.retire(self)

    def destroy(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
