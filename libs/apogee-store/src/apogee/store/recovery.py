"""Recovery: bring the CommitLog, ConsumeQueues and index back to one consistent state at open.

It follows RocketMQ's ``DefaultMessageStore#recover`` with offsets where RocketMQ uses times:

0. A ``truncate`` marker (:class:`TruncateMarker`) left behind means a cut of the log was under
   way: it is redone first (:func:`redo_truncation`), and the open counts as after a crash. A
   ``start-over`` marker (:class:`StartOverMarker`) means the store was discarding its whole log
   to continue it at a later offset: that is redone first of all (:func:`redo_start_over`).
1. An ``abort`` file left behind means the last stop was a crash.
2. Where to verify from: after a clean stop, the third-last CommitLog file; after a crash, the
   file holding the checkpoint's trusted offset (everything below it was fsynced and dispatched
   durably), or the first file when there is no valid checkpoint.
3. Where to re-dispatch from: the checkpoint's dispatch point, or the start of the log when the
   ``consumequeue`` or ``index`` directory was deleted (they are rebuilt from the CommitLog).
4. ConsumeQueues are cut back to entries below the re-dispatch point whose record still checks.
5. One scan from the smaller of the two points checks every record (magic, size, its own
   physical offset, CRC) and re-dispatches those past the re-dispatch point. The first record
   that fails ends the log: the rest of its file is zeroed; later files that hold data are moved
   to ``quarantine/`` (never deleted: only damage, not a crash, puts data after a bad record).
6. ConsumeQueue entries that point past the new end are dropped, the table of queue offsets is
   rebuilt from the ConsumeQueues, everything is flushed and a new checkpoint written.

The result is a :class:`RecoveryReport`, logged and returned.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from apogee.codec import HEADER, HEADER_SIZE, MESSAGE_MAGIC
from apogee.codec.layout import MAGIC, PHYS_OFFSET, QUEUE_ID, QUEUE_OFFSET, SIZE
from apogee.common.errors import StoreConfigError
from apogee.common.files import fsync_dir
from apogee.store.checkpoint import Checkpoint
from apogee.store.commitlog import AppendResult, CommitLog, RecordInvalid, parse_record
from apogee.store.consumequeue import ConsumeQueue, ConsumeQueueTable
from apogee.store.dispatcher import Dispatcher
from apogee.store.indexfile import IndexService
from apogee.store.records import TagCode

log = logging.getLogger(__name__)

_REDISPATCH_BATCH = 2048


@dataclass(slots=True)
class RecoveryReport:
    clean_shutdown: bool
    checkpoint: Checkpoint | None
    verify_from: int = 0
    redispatch_from: int = 0
    files_checked: int = 0
    records_checked: int = 0
    last_valid_offset: int = 0
    stopped_because: str = ""
    bytes_truncated: int = 0
    files_quarantined: list[str] = field(default_factory=list)
    entries_redispatched: int = 0
    consume_queue_entries_dropped: int = 0
    rebuilt_consume_queues: bool = False
    rebuilt_index: bool = False
    #: the offset an interrupted truncation (its marker found at open) was redone to
    truncation_redone_to: int | None = None
    #: the offset an interrupted start over (its marker found at open) began the log at again
    start_over_redone_at: int | None = None
    seconds: float = 0.0

    def summary(self) -> str:
        redone = self.truncation_redone_to
        began = self.start_over_redone_at
        return (
            f"recovery after {'a clean stop' if self.clean_shutdown else 'a crash'}: "
            f"{'' if began is None else f'redid an interrupted start over at {began}; '}"
            f"{'' if redone is None else f'redid an interrupted truncation to {redone}; '}"
            f"checked {self.records_checked} records in {self.files_checked} files from offset "
            f"{self.verify_from}; log ends at {self.last_valid_offset}"
            f"{' (' + self.stopped_because + ')' if self.stopped_because else ''}; "
            f"truncated {self.bytes_truncated} bytes, quarantined {len(self.files_quarantined)} "
            f"files; re-dispatched {self.entries_redispatched} entries from "
            f"{self.redispatch_from}; dropped {self.consume_queue_entries_dropped} queue entries"
            f"{'; rebuilt consume queues' if self.rebuilt_consume_queues else ''}"
            f"{'; rebuilt index' if self.rebuilt_index else ''}; {self.seconds:.3f}s"
        )


def recover(
    *,
    root: Path,
    commitlog: CommitLog,
    cqs: ConsumeQueueTable,
    index: IndexService,
    dispatcher: Dispatcher,
    checkpoint: Checkpoint | None,
    clean_shutdown: bool,
    verify_files_after_clean_stop: int,
    tag_code: TagCode,
    truncation_redone_to: int | None = None,
    start_over_redone_at: int | None = None,
    queue_starts: Mapping[tuple[str, int], int] | None = None,
) -> RecoveryReport:
    """``queue_starts``: the next offset of queues as the log began (:class:`QueueStarts`),
    for those no ConsumeQueue holds."""
    t0 = time.perf_counter()
    report = RecoveryReport(
        clean_shutdown=clean_shutdown,
        checkpoint=checkpoint,
        truncation_redone_to=truncation_redone_to,
        start_over_redone_at=start_over_redone_at,
    )
    files = commitlog.files.files
    log_min = commitlog.files.min_offset
    if not files:
        for cq in cqs:
            report.consume_queue_entries_dropped += cq.truncate(0)
        report.seconds = time.perf_counter() - t0
        return report

    # 2. where to verify from
    if clean_shutdown:
        verify_from = files[max(0, len(files) - verify_files_after_clean_stop)].start
    elif checkpoint is not None:
        mf = commitlog.files.find(max(checkpoint.trusted, log_min))
        verify_from = mf.start if mf is not None else files[-1].start
    else:
        verify_from = log_min

    # 3. where to re-dispatch from
    report.rebuilt_consume_queues = not any(cq.files.files for cq in cqs)
    report.rebuilt_index = not index.files
    if report.rebuilt_consume_queues or report.rebuilt_index:
        redispatch_from = log_min
    elif checkpoint is not None:
        redispatch_from = max(log_min, checkpoint.dispatch_flushed)
    else:
        redispatch_from = verify_from
    report.verify_from = verify_from = min(verify_from, redispatch_from)
    report.redispatch_from = redispatch_from

    # 4. cut queues back to what is known good
    for cq in cqs:
        report.consume_queue_entries_dropped += _trim_queue(cq, commitlog, redispatch_from)

    # 5. scan
    end = _scan(commitlog, verify_from, redispatch_from, dispatcher, tag_code, report)
    report.last_valid_offset = end
    zeroed, moved = commitlog.files.truncate(end, quarantine=root / "quarantine")
    report.bytes_truncated = zeroed
    for path in moved:
        with open(path, "rb") as f:
            head = f.read(8)
        if head.count(0) == len(head):  # an empty file made (or zero-filled) before the crash
            path.unlink()
        else:
            report.files_quarantined.append(str(path))
    last = commitlog.files.last
    if last is not None and last.start + last.wrote > end:
        last.wrote = end - last.start
    for mf in commitlog.files.files:
        mf.flushed = 0 if mf.start + commitlog.files.file_size > verify_from else mf.wrote
    commitlog.files.flushed_where = verify_from

    # 6. drop entries past the end, rebuild the offset table
    for cq in cqs:
        report.consume_queue_entries_dropped += trim_past_end(cq, end)
        cq.correct_min_offset(log_min)
    set_queue_offsets(commitlog, cqs, queue_starts or {})
    dispatcher.dispatched = end
    report.seconds = time.perf_counter() - t0
    return report


def set_queue_offsets(
    commitlog: CommitLog, cqs: ConsumeQueueTable, starts: Mapping[tuple[str, int], int]
) -> None:
    """Rebuild the CommitLog's table of next queue offsets from the ConsumeQueues, and from
    ``starts`` for the queues none holds (those stay :attr:`CommitLog.unanchored`)."""
    offsets = dict(starts)
    offsets.update({(cq.topic, cq.queue_id): cq.max_offset for cq in cqs})
    commitlog.queue_offsets = offsets
    commitlog.unanchored = {k for k in starts if cqs.get(*k) is None}


def _trim_queue(cq: ConsumeQueue, commitlog: CommitLog, redispatch_from: int) -> int:
    """Drop entries at or past ``redispatch_from`` (they are rewritten by the scan), then drop
    trailing entries that do not match their record (torn writes)."""
    lo, hi = cq.min_offset, cq.max_offset
    while lo < hi:  # first entry whose record is at or past the re-dispatch point
        mid = (lo + hi) // 2
        e = cq.entry(mid)
        if e is None or e[0] >= redispatch_from or e[1] <= 0:
            hi = mid
        else:
            lo = mid + 1
    n = lo
    while n > cq.min_offset and not _entry_matches(cq, n - 1, commitlog):
        n -= 1
    return cq.truncate(n)


def _entry_matches(cq: ConsumeQueue, offset: int, commitlog: CommitLog) -> bool:
    e = cq.entry(offset)
    if e is None:
        return False
    phys, size, _ = e
    if phys < commitlog.files.min_offset:
        return True  # deleted by retention: nothing to check it against
    try:
        head = commitlog.read(phys, HEADER_SIZE)
    except Exception:
        return False
    if len(head) < HEADER_SIZE:
        return False
    fields = HEADER.unpack(head)
    return bool(
        fields[MAGIC] == MESSAGE_MAGIC
        and fields[SIZE] == size
        and fields[QUEUE_ID] == cq.queue_id
        and fields[QUEUE_OFFSET] == offset
        and fields[PHYS_OFFSET] == phys
    )


def trim_past_end(cq: ConsumeQueue, end: int) -> int:
    """Drop the entries whose record does not end by log offset ``end``; returns how many."""
    lo, hi = cq.min_offset, cq.max_offset
    while lo < hi:
        mid = (lo + hi) // 2
        e = cq.entry(mid)
        if e is None or e[0] + e[1] > end or e[1] <= 0:
            hi = mid
        else:
            lo = mid + 1
    return cq.truncate(lo)


# -- truncation --------------------------------------------------------------------------------


class TruncateMarker:
    """``<root>/truncate``: present while a truncation of the log is under way (see
    :meth:`MessageStore.truncate`), so that an open after a crash redoes it before recovery
    (RocketMQ #10666: a half-done cut must never let the cut tail come back). 20 bytes,
    little-endian, written to ``truncate.tmp``, fsynced and renamed into place::

        0       4       8                16      20
        +-------+-------+----------------+-------+
        | magic | vers  | target offset  |  crc  |
        +-------+-------+----------------+-------+

    ``crc`` is the CRC-32 of the first 16 bytes.
    """

    BODY = struct.Struct("<IIq")
    CRC = struct.Struct("<I")
    MAGIC = 0x41505452  # "APTR"
    VERSION = 1
    NAME = "truncate"
    #: what the marker guards, for messages
    WORK = "truncation"

    def __init__(self, root: Path) -> None:
        self.path = root / self.NAME
        self._tmp = root / f"{self.NAME}.tmp"

    def write(self, offset: int) -> None:
        body = self.BODY.pack(self.MAGIC, self.VERSION, offset)
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, body + self.CRC.pack(zlib.crc32(body)))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self._tmp, self.path)
        fsync_dir(self.path.parent)

    def read(self) -> int | None:
        """The target offset, or None when there is no marker. A damaged marker raises
        :class:`StoreConfigError`: the cut it guards may be half done, and opening without it
        could bring the cut tail back."""
        self._tmp.unlink(missing_ok=True)  # a marker never renamed into place: nothing was cut
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        size = self.BODY.size + self.CRC.size
        if len(raw) == size:
            magic, version, offset = self.BODY.unpack_from(raw)
            (crc,) = self.CRC.unpack_from(raw, self.BODY.size)
            if (magic, version) == (self.MAGIC, self.VERSION) and crc == zlib.crc32(
                raw[: self.BODY.size]
            ):
                return int(offset)
        raise StoreConfigError(
            field=str(self.path),
            rule=f"a {self.WORK} marker must be {size} bytes with a good CRC; this one is "
            f"damaged, so an interrupted {self.WORK} cannot be redone: restore the store from "
            "a replica",
        )

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        fsync_dir(self.path.parent)


class StartOverMarker(TruncateMarker):
    """``<root>/start-over``: present while a store discards its whole log to continue it at
    a later offset (see :meth:`MessageStore.start_over`), so that an open after a crash
    finishes that before recovery (:func:`redo_start_over`): an old file left behind must never
    be read as part of the new log. The layout is :class:`TruncateMarker`'s, with the magic
    "APSO" and the offset the log begins at again."""

    MAGIC = 0x4150534F  # "APSO"
    NAME = "start-over"
    WORK = "start over"


class QueueStarts:
    """``<root>/queue-starts``: the next queue offset of each queue where the log began when
    the store last started over (its leader's table then), so that a queue none of whose
    records is left still continues at its offset (its ConsumeQueue, once it has one, says
    more). Text, one queue a line after a version line::

        1
        <topic> <queue id> <next offset>

    ``start_over`` writes the new table to ``queue-starts.next`` (fsynced) before its marker
    and renames it into place before removing the marker; an open that finds the marker does
    the rename, one that finds a ``.next`` without the marker removes it."""

    VERSION = 1

    def __init__(self, root: Path) -> None:
        self.path = root / "queue-starts"
        self.next = root / "queue-starts.next"

    def write_next(self, starts: Mapping[tuple[str, int], int]) -> None:
        lines = [str(self.VERSION)] + [f"{t} {q} {o}" for (t, q), o in sorted(starts.items())]
        fd = os.open(self.next, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, ("\n".join(lines) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.next.parent)

    def install(self) -> None:
        """Make the table written last the one in force (nothing when it already is)."""
        if self.next.exists():
            os.replace(self.next, self.path)
            fsync_dir(self.path.parent)

    def drop_next(self) -> None:
        """Remove a table whose start over never began (no marker was written)."""
        self.next.unlink(missing_ok=True)

    def read(self) -> dict[tuple[str, int], int]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        lines = text.splitlines()
        try:
            if not lines or int(lines[0]) != self.VERSION:
                raise ValueError(f"version line {lines[0] if lines else ''!r}")
            out: dict[tuple[str, int], int] = {}
            for line in lines[1:]:
                topic, queue, offset = line.split(" ")
                out[(topic, int(queue))] = int(offset)
        except ValueError as exc:
            raise StoreConfigError(
                field=str(self.path),
                rule=f"must be a version line and `<topic> <queue id> <offset>` lines: {exc}",
            ) from None
        return out


def discard_all(
    offset: int,
    commitlog: CommitLog,
    cqs: ConsumeQueueTable,
    index: IndexService,
    step: Callable[[str], None] | None = None,
) -> tuple[int, int]:
    """Remove every CommitLog file, every ConsumeQueue and every index file, durably, then
    begin the log again at ``offset`` with an empty file (its table of queue offsets empty).
    Each step may be repeated after a crash. ``step`` is told each step done (``"log removed"``,
    ``"queues removed"``, ``"log begun"``). Returns the CommitLog files and the queues removed.
    The caller holds the CommitLog's locks, or the store is not open yet."""
    files = commitlog.files.remove_all()
    if step is not None:
        step("log removed")
    queues = cqs.remove_all()
    index.remove_all()
    if step is not None:
        step("queues removed")
    commitlog.begin_at_locked(offset)
    if step is not None:
        step("log begun")
    return files, queues


def redo_start_over(
    marker: StartOverMarker,
    starts: QueueStarts,
    commitlog: CommitLog,
    cqs: ConsumeQueueTable,
    index: IndexService,
) -> int | None:
    """At open, before anything else: when a start over was interrupted, do it again whole
    (:func:`discard_all`, and the table of queue starts put in force), then remove the marker.
    Returns the offset the log begins at, or None when there was no marker. Recovery then
    finds one empty file there."""
    offset = marker.read()
    if offset is None:
        starts.drop_next()
        return None
    with commitlog.lock:
        files, queues = discard_all(offset, commitlog, cqs, index)
    starts.install()
    marker.remove()
    log.warning(
        "%s: redid an interrupted start over at offset %d (%d commitlog files and %d consume "
        "queues removed)",
        marker.path.parent,
        offset,
        files,
        queues,
    )
    return offset


def cut_queues(offset: int, cqs: ConsumeQueueTable, index: IndexService) -> int:
    """After the CommitLog was cut back to ``offset``: drop the ConsumeQueue entries that point
    at or past it (durably), and the index files that begin at or past it. Entries of the
    index files that remain may still point past ``offset``: lookups check every hit against
    the record it points at, so they find nothing there, or the new record only when it
    matches. Returns the queue entries dropped."""
    dropped = 0
    for cq in cqs:
        n = trim_past_end(cq, offset)
        if n:
            last = cq.files.last
            if last is not None:
                last.sync()
            fsync_dir(cq.files.dir)
            dropped += n
    gone = [f for f in index.files if f.mf.start >= offset]
    if gone:
        index.files = tuple(f for f in index.files if f.mf.start < offset)
        for f in gone:
            f.destroy()
        fsync_dir(index.dir)
    return dropped


def redo_truncation(
    marker: TruncateMarker, commitlog: CommitLog, cqs: ConsumeQueueTable, index: IndexService
) -> int | None:
    """At open, before recovery: when a truncation was interrupted, cut everything back to its
    offset again (each step is idempotent), then remove the marker. Returns that offset, or
    None when there was no marker. Recovery then finds the log ending there."""
    offset = marker.read()
    if offset is None:
        return None
    with commitlog.lock:
        zeroed = commitlog.cut_locked(offset)
    dropped = cut_queues(offset, cqs, index)
    marker.remove()
    log.warning(
        "%s: redid an interrupted truncation to offset %d (%d bytes zeroed, %d queue entries "
        "dropped)",
        marker.path.parent,
        offset,
        zeroed,
        dropped,
    )
    return offset


def _scan(
    commitlog: CommitLog,
    start: int,
    redispatch_from: int,
    dispatcher: Dispatcher,
    tag_code: TagCode,
    report: RecoveryReport,
) -> int:
    """Check records from ``start``; returns the offset just past the last good one."""
    fsize = commitlog.files.file_size
    mf = commitlog.files.find(start)
    pending: list[AppendResult] = []
    where = start
    while mf is not None:
        report.files_checked += 1
        pos = where - mf.start
        base = mf.start
        with memoryview(mf.mm) as mv:
            while True:
                try:
                    size, result = parse_record(
                        mv,
                        pos,
                        base + pos,
                        fsize - pos,
                        tag_code if base + pos >= redispatch_from else None,
                    )
                except RecordInvalid as exc:
                    if exc.reason:
                        report.stopped_because = f"{exc.reason} at offset {base + pos}"
                    break
                if size == fsize - pos:  # the blank end marker
                    pos = fsize
                    break
                report.records_checked += 1
                if result is not None:
                    pending.append(result)
                    if len(pending) >= _REDISPATCH_BATCH:
                        dispatcher.apply(pending)
                        report.entries_redispatched += len(pending)
                        pending = []
                pos += size
        if pos < fsize:  # stopped inside this file: the log ends here
            where = base + pos
            break
        nxt = commitlog.files.find(base + fsize)
        where = base + fsize
        if nxt is None:
            break
        mf = nxt
    if pending:
        dispatcher.apply(pending)
        report.entries_redispatched += len(pending)
    return where
