"""Fixed-size files mapped into memory, and the ordered queue of them that a log is made of.

A log (the CommitLog, or one ConsumeQueue) is a run of equally sized files, each named by the
20-digit, zero-padded log offset of its first byte::

    00000000000000000000  00000000001073741824  00000000002147483648 ...

Log files are created at full size as sparse files and written with ``pwrite``: a full disk is
then an ordinary ``ENOSPC`` error (:class:`DiskFullError`), never a SIGBUS as a write into a hole
through a map would be, and it is fast (measured here: ``posix_fallocate``'d files slow appends
down 5x as ext4 splits their unwritten extents; copying into the map faults on every fresh page).
Reads go through a shared memory map of the same file, which sees the same page cache. A region
that is updated in place through the map (the index's hash slots) is written with zeros first,
so its blocks exist: no SIGBUS, and no block allocation on each first write to a page (with
``posix_fallocate``'d blocks that cost about 4 us per index entry here).
Flushing is ``fdatasync``.

Threads: the owner appends or writes; readers call :meth:`MappedFileQueue.find` at any time. The
list of files is replaced, never mutated, so a reader always sees a consistent snapshot; a file
closed under a reader raises ``ValueError`` there, which readers turn into "deleted".
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar, cast, overload

from apogee.common.errors import DiskFullError, StoreConfigError
from apogee.common.files import fsync_dir

log = logging.getLogger(__name__)

NAME_DIGITS = 20
_ZERO_CHUNK = 1 << 20
#: The name a file has while it is being zero-filled ahead of the log.
PREPARING_SUFFIX = ".preparing"
#: Free space, besides the file itself, that preparing a file ahead leaves on the disk.
PREPARE_HEADROOM = 64 << 20
#: Seconds closing a log waits for an abandoned preparation to stop (one 4 MiB write).
_ABANDON_WAIT = 10.0


def file_name(offset: int) -> str:
    return f"{offset:0{NAME_DIGITS}d}"


class MappedFile:
    """One file of a log, mapped read-write."""

    __slots__ = ("fd", "flushed", "mm", "path", "size", "start", "wrote")

    def __init__(
        self,
        path: Path,
        start: int,
        size: int,
        create: bool,
        zero_prefix: int = 0,
        zero_stop: threading.Event | None = None,
    ) -> None:
        """Open (or with ``create``, make) the file. A new file is sparse, but for its first
        ``zero_prefix`` bytes, which are written with zeros; with ``zero_stop`` it is written
        with zeros throughout, and making it stops (:class:`_Abandoned`) once that is set."""
        self.path = path
        self.start = start
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(path, flags, 0o644)
        try:
            if create or os.fstat(self.fd).st_size < size:
                try:
                    if zero_stop is not None:
                        _write_zeros(self.fd, size, zero_stop)
                    else:
                        os.ftruncate(self.fd, size)
                        if zero_prefix:
                            _write_zeros(self.fd, zero_prefix)
                except OSError as exc:
                    raise disk_error(exc, path, f"{size} bytes wanted") from exc
            self.mm = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        self.wrote = 0
        self.flushed = 0

    @property
    def end(self) -> int:
        """Log offset just past the last written byte."""
        return self.start + self.wrote

    def write(self, pos: int, data: bytes) -> None:
        """Write ``data`` at ``pos`` through the file, not the map: a write into a hole of a
        sparse file then fails with ENOSPC (:class:`DiskFullError`) instead of a SIGBUS."""
        try:
            written = os.pwrite(self.fd, data, pos)
        except OSError as exc:
            raise disk_error(exc, self.path, f"writing {len(data)} bytes at {pos}") from exc
        if written != len(data):
            raise DiskFullError(path=str(self.path), detail=f"short write at {pos}")

    def sync(self) -> None:
        """fdatasync the whole file, whatever its flush mark says."""
        os.fdatasync(self.fd)
        self.flushed = self.wrote

    def sync_to(self, wrote: int) -> None:
        os.fdatasync(self.fd)
        self.flushed = max(self.flushed, wrote)

    def zero_from(self, pos: int) -> int:
        """Zero bytes from ``pos`` up to the first all-zero megabyte (see :func:`zero_from`)."""
        return zero_from(self.fd, self.size, pos, self.write)

    def data_regions(self) -> list[tuple[int, int]]:
        """Where the file holds data (see :func:`data_regions`)."""
        return data_regions(self.fd, self.size)

    @property
    def closed(self) -> bool:
        return self.mm.closed

    def mtime(self) -> float:
        return os.fstat(self.fd).st_mtime

    def close(self) -> None:
        if not self.mm.closed:
            self.mm.close()
            os.close(self.fd)

    def destroy(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


class LogFile(Protocol):
    """What a log needs of one of its files: a :class:`MappedFile`, or a file that opens its
    descriptor only while it is used (``apogee.store.queue_file.QueueFile``)."""

    path: Path
    start: int
    size: int
    wrote: int
    flushed: int

    @property
    def end(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def write(self, pos: int, data: bytes) -> None: ...

    def sync(self) -> None: ...

    def sync_to(self, wrote: int) -> None: ...

    def zero_from(self, pos: int) -> int: ...

    def close(self) -> None: ...

    def destroy(self) -> None: ...


F = TypeVar("F", bound=LogFile)
#: opens (or with ``create``, makes) the file at ``path`` that starts at ``start``, of ``size``
Opener = Callable[[Path, int, int, bool], F]


def _open_mapped(path: Path, start: int, size: int, create: bool) -> MappedFile:
    return MappedFile(path, start, size, create)


class MappedFileQueue(Generic[F]):
    """The ordered, contiguous files of one log: :class:`MappedFile` by default, or what
    ``opener`` makes."""

    @overload
    def __init__(
        self: MappedFileQueue[MappedFile],
        directory: Path,
        file_size: int,
        zero_fill: bool = False,
    ) -> None: ...

    @overload
    def __init__(self, directory: Path, file_size: int, *, opener: Opener[F]) -> None: ...

    def __init__(
        self,
        directory: Path,
        file_size: int,
        zero_fill: bool = False,
        opener: Opener[F] | None = None,
    ) -> None:
        self.dir = directory
        self.file_size = file_size
        #: only for mapped files, which the background preparation makes
        self.zero_fill = zero_fill and opener is None
        self._open: Opener[F] = opener or cast("Opener[F]", _open_mapped)
        self._next: _Preparing | None = None
        self._abandoned: list[_Preparing] = []
        self._low_space_told = False
        self.files: Sequence[F] = ()
        self.flushed_where = 0
        self._lock = threading.Lock()

    def load(self) -> None:
        """Open the files on disk. Every file must have the configured size, but a last file that
        is shorter (a crash while it was being created) is extended."""
        self.dir.mkdir(parents=True, exist_ok=True)
        # one listing, with os.scandir: pathlib's glob, iterdir and is_file cost a third of
        # loading a queue of one file, times the tens of thousands of queues a broker may hold
        found: list[tuple[str, int]] = []
        with os.scandir(self.dir) as listing:
            for entry in listing:
                if entry.name.endswith(PREPARING_SUFFIX):
                    log.info("removing %s, a file left half-prepared by a crash", entry.path)
                    Path(entry.path).unlink(missing_ok=True)
                elif _is_log_name(entry.name) and entry.is_file():
                    found.append((entry.name, entry.stat().st_size))
        found.sort()
        names = [self.dir / name for name, _ in found]
        files: list[F] = []
        for i, path in enumerate(names):
            size = found[i][1]
            start = int(path.name)
            if size != self.file_size and (size > self.file_size or i < len(names) - 1):
                for f in files:
                    f.close()
                raise StoreConfigError(
                    field="file size",
                    rule=f"{path} has {size} bytes but this log uses {self.file_size}-byte files; "
                    "open it with the size it was created with",
                )
            if start % self.file_size or (files and start != files[-1].start + self.file_size):
                for f in files:
                    f.close()
                raise StoreConfigError(
                    field="file name",
                    rule=f"{path} does not continue the log at a multiple of {self.file_size}",
                )
            try:
                if size < self.file_size:  # a crash while it was being created
                    os.truncate(path, self.file_size)
                mf = self._open(path, start, self.file_size, False)
            except BaseException:
                for f in files:
                    f.close()
                raise
            mf.wrote = mf.flushed = self.file_size
            files.append(mf)
        self.files = tuple(files)

    # -- lookup ---------------------------------------------------------------------------------

    def find(self, offset: int) -> F | None:
        files = self.files
        if not files:
            return None
        i = (offset - files[0].start) // self.file_size
        if 0 <= i < len(files):
            return files[i]
        return None

    @property
    def last(self) -> F | None:
        files = self.files
        return files[-1] if files else None

    @property
    def min_offset(self) -> int:
        files = self.files
        return files[0].start if files else 0

    @property
    def max_offset(self) -> int:
        files = self.files
        return files[-1].end if files else 0

    # -- growth ---------------------------------------------------------------------------------

    def create(self, start: int) -> F:
        """Create the file that starts at ``start`` (which must continue the log, or begin it).

        With ``zero_fill``, the file prepared in the background is taken when it is ready; when
        it is not (the log's first file, a disk too small to prepare one, a log that outran its
        preparation) the file is created sparse at once: appends never wait for zeros."""
        with self._lock:
            files = self.files
            if files and start != files[-1].start + self.file_size:
                raise ValueError(f"file at {start} would not continue the log")
            # only a queue of mapped files prepares files (zero_fill)
            mf = cast("F | None", self._take_prepared(start))
            if mf is None:
                mf = self._open(self.dir / file_name(start), start, self.file_size, True)
            self.files = (*files, mf)
            if self.zero_fill:
                self._prepare(start + self.file_size)
        return mf

    # Zero-filled files (for synchronous flush, where an fdatasync then writes data only, no
    # block allocation: measured here 0.2 ms instead of 0.4 ms at p50, 0.3 ms instead of 4.7 ms
    # at p99) take a while to write (seconds for 1 GiB), so the next one is made in the
    # background under a temporary name, as RocketMQ's AllocateMappedFileService does, and
    # renamed into the log when the log reaches it. It is made only when the disk has room for
    # it besides PREPARE_HEADROOM; otherwise the log goes on with sparse files, which take
    # space as they are written, and says so once. A crash can leave a half-made one behind:
    # :meth:`load` removes it.

    def _prepare(self, start: int) -> None:
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            free = 0
        needed = self.file_size + PREPARE_HEADROOM
        if free < needed:
            if not self._low_space_told:
                self._low_space_told = True
                log.warning(
                    "%s: not zero-filling the next %d-byte file ahead: %d bytes free, %d needed; "
                    "files are created sparse and take space as they are written (synchronous "
                    "flushes allocate blocks as they go, which makes them slower)",
                    self.dir,
                    self.file_size,
                    free,
                    needed,
                )
            return
        self._low_space_told = False
        job = _Preparing(self.dir / (file_name(start) + PREPARING_SUFFIX), start, self.file_size)
        job.thread.start()
        self._next = job

    def _take_prepared(self, start: int) -> MappedFile | None:
        job, self._next = self._next, None
        if job is None:
            return None
        if not job.done.is_set() or job.start != start:
            job.abandon()  # not waited for here: closing the log does
            self._abandoned = [j for j in self._abandoned if j.thread.is_alive()] + [job]
            return None
        got = job.result
        if isinstance(got, BaseException):
            log.warning("preparing file %s failed: %s", job.path.name, got)
            return None
        if got is None:
            return None
        path = self.dir / file_name(start)
        try:
            os.rename(got.path, path)
            fsync_dir(self.dir)
        except OSError as exc:
            log.warning("could not move prepared file %s into the log: %s", got.path, exc)
            got.destroy()
            return None
        got.path = path
        return got

    def wait_prepared(self, timeout: float) -> bool:
        """Wait until the next file being prepared in the background is ready (or there is
        none); False when it is still being made after ``timeout`` seconds."""
        job = self._next
        return job is None or job.done.wait(timeout)

    def _discard_prepared(self) -> None:
        job, self._next = self._next, None
        jobs, self._abandoned = self._abandoned, []
        if job is not None:
            job.abandon()
            jobs.append(job)
        for j in jobs:
            j.thread.join(_ABANDON_WAIT)

    def file_for(self, offset: int) -> F:
        """The file holding ``offset``, creating it (and any gap before it) when missing."""
        mf = self.find(offset)
        if mf is not None:
            return mf
        start = offset - offset % self.file_size
        last = self.last
        if last is None:
            return self.create(start)
        if start < last.start:
            raise ValueError(f"offset {offset} is before the first file of {self.dir}")
        while (last := self.create(last.start + self.file_size)).start < start:
            last.wrote = self.file_size
        return last

    # -- shrinking ------------------------------------------------------------------------------

    def truncate(self, offset: int, quarantine: Path | None = None) -> tuple[int, list[Path]]:
        """Cut the log at ``offset``: zero what follows in its file and remove every later file
        (moved under ``quarantine`` when given, else deleted). Returns (bytes zeroed, moved)."""
        zeroed = 0
        moved: list[Path] = []
        with self._lock:
            keep: list[F] = []
            for mf in self.files:
                if mf.start + self.file_size <= offset:
                    keep.append(mf)
                elif mf.start <= offset:
                    zeroed += mf.zero_from(offset - mf.start)
                    mf.wrote = min(mf.wrote, offset - mf.start)
                    mf.flushed = min(mf.flushed, mf.wrote)
                    keep.append(mf)
                elif quarantine is not None:
                    quarantine.mkdir(parents=True, exist_ok=True)
                    mf.close()
                    target = quarantine / mf.path.name
                    mf.path.rename(target)
                    moved.append(target)
                else:
                    mf.destroy()
            removed = len(keep) < len(self.files)
            self.files = tuple(keep)
            self.flushed_where = min(self.flushed_where, offset)
        if removed:  # zeros written into a file change no entry of the directory
            fsync_dir(self.dir)
        return zeroed, moved

    def remove_all(self) -> int:
        """Delete every file of the log (and one being prepared) durably; returns how many
        there were. Readers holding one see it closed (``ValueError``), as after retention."""
        with self._lock:
            self._discard_prepared()
            files, self.files = self.files, ()
            for mf in files:
                mf.destroy()
            for path in self.dir.iterdir():  # one left out of the list: it goes too
                if _is_log_name(path.name) or path.name.endswith(PREPARING_SUFFIX):
                    path.unlink(missing_ok=True)
            self.flushed_where = 0
        fsync_dir(self.dir)
        return len(files)

    def drop_first(self, count: int) -> list[F]:
        """Remove and delete the first ``count`` files (never the last one)."""
        with self._lock:
            files = self.files
            count = min(count, len(files) - 1)
            if count <= 0:
                return []
            dropped = list(files[:count])
            self.files = tuple(files[count:])
        for mf in dropped:
            mf.destroy()
        return dropped

    def flush(self) -> int:
        """fdatasync what was written, oldest file first; returns the log offset now durable."""
        if not self.files:
            return 0
        marks = self.unflushed()
        for mf, wrote in marks:
            if mf.flushed < wrote:
                try:
                    mf.sync_to(wrote)
                except (ValueError, OSError):  # closed by retention meanwhile
                    if not mf.closed:
                        raise
        return self.flushed_to(marks)

    def unflushed(self) -> list[tuple[F, int]]:
        """The files from the first not wholly flushed, each with how far it is written now:
        what a flush must make durable, and what :meth:`flushed_to` records once it is (by
        :meth:`flush`, or by one sync of the whole file system for many logs at once).

        Files are written in order, so a file that is not full is the last one with data."""
        files = self.files
        if not files:
            return []
        first = self.find(self.flushed_where) or files[0]
        marks: list[tuple[F, int]] = []
        for mf in files[files.index(first) :]:
            wrote = mf.wrote
            marks.append((mf, wrote))
            if wrote < self.file_size:
                break
        return marks

    def flushed_to(self, marks: list[tuple[F, int]]) -> int:
        """Record ``marks`` (from :meth:`unflushed`) as durable; returns the log offset now
        durable."""
        for mf, wrote in marks:
            mf.flushed = max(mf.flushed, wrote)
        if marks:
            mf, wrote = marks[-1]
            self.flushed_where = max(self.flushed_where, mf.start + wrote)
        return self.flushed_where

    def close(self) -> None:
        with self._lock:
            self._discard_prepared()
            for mf in self.files:
                mf.close()
            self.files = ()

    def destroy(self) -> None:
        with self._lock:
            for mf in self.files:
                mf.destroy()
            self.files = ()


def zero_from(fd: int, size: int, pos: int, write: Callable[[int, bytes], None]) -> int:
    """Zero the bytes of the file ``fd`` from ``pos`` up to the first all-zero megabyte (a hole
    counts as zeros), writing with ``write(pos, data)``; returns bytes changed. It reads with
    ``pread`` and only where the file holds data, and writes zeros only there: reading through
    a map faulted in (and kept resident) a megabyte or two of every queue file that recovery
    cuts, thousands after a crash, and writing a whole megabyte of zeros filled a sparse
    file's hole with blocks."""
    changed = 0
    for start, stop in data_regions(fd, size):
        if stop <= pos:
            continue
        if start > pos:
            if start - pos >= _ZERO_CHUNK:
                break  # a megabyte of hole: zeros
            pos = start
        while pos < stop:
            end = min(pos + _ZERO_CHUNK, stop)
            chunk = os.pread(fd, end - pos, pos)
            zeros = chunk.count(0)
            if zeros == len(chunk):
                if end - pos == _ZERO_CHUNK:
                    return changed
            else:
                changed += len(chunk) - zeros
                write(pos, bytes(end - pos))
            pos = end
    return changed


def data_regions(fd: int, size: int) -> list[tuple[int, int]]:
    """Where the file ``fd`` holds data (``SEEK_DATA`` / ``SEEK_HOLE``) below ``size``, in
    order, as (start, end) byte positions: the holes of a sparse file read as zeros. A file
    system that does not track holes reports the whole file as one region."""
    regions: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole from pos to the end
                break
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if start >= end:
            break
        regions.append((start, end))
        pos = end
    return regions


def _is_log_name(name: str) -> bool:
    return len(name) == NAME_DIGITS and name.isdigit()


def disk_error(exc: OSError, path: Path, detail: str) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(path=str(path), detail=detail)
    return exc


def _write_zeros(fd: int, size: int, stop: threading.Event | None = None) -> None:
    chunk = bytes(min(size, 4 << 20))
    pos = 0
    while pos < size:
        if stop is not None and stop.is_set():
            raise _Abandoned
        n = min(len(chunk), size - pos)
        pos += os.pwrite(fd, chunk[:n] if n < len(chunk) else chunk, pos)
    if stop is not None and stop.is_set():
        raise _Abandoned
    os.fdatasync(fd)


class _Abandoned(Exception):
    """The file being prepared is no longer wanted."""


class _Preparing:
    """One file being zero-filled on a thread of its own, under a temporary name."""

    def __init__(self, path: Path, start: int, size: int) -> None:
        self.path = path
        self.start = start
        self.size = size
        self.result: MappedFile | BaseException | None = None
        self.done = threading.Event()
        self._stop = threading.Event()
        self._drop_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="apogee-store-prepare", daemon=True)

    def _run(self) -> None:
        try:
            self.result = MappedFile(self.path, self.start, self.size, True, zero_stop=self._stop)
        except _Abandoned:
            self.result = None
        except BaseException as exc:  # reported by whoever takes the file
            self.result = exc
        finally:
            self.done.set()
        if self._stop.is_set():
            self._drop()

    def abandon(self) -> None:
        """Stop making the file and remove it: at once when it is made, else when the thread
        next looks (within one 4 MiB write)."""
        self._stop.set()
        if self.done.is_set():
            self._drop()

    def _drop(self) -> None:
        with self._drop_lock:
            got, self.result = self.result, None
        if isinstance(got, MappedFile):
            got.destroy()
