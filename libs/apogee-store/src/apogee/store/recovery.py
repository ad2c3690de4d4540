"""Recovery: bring the CommitLog, ConsumeQueues and index back to one consistent state at open.

It follows RocketMQ's ``DefaultMessageStore#recover`` with offsets where RocketMQ uses times:

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
import time
from dataclasses import dataclass, field
from pathlib import Path

from apogee.codec import (
    BLANK,
    BLANK_MAGIC,
    HEADER,
    HEADER_SIZE,
    MESSAGE_MAGIC,
    MIN_BLANK,
    PROP_KEYS,
    PROP_TAGS,
    PROP_UNIQ_KEY,
    crc32,
    decode_properties,
)
from apogee.codec.layout import (
    BODY_LENGTH,
    CRC,
    CRC_FROM,
    MAGIC,
    PHYS_OFFSET,
    PROPERTIES_LENGTH,
    QUEUE_ID,
    QUEUE_OFFSET,
    SIZE,
    STORE_TIMESTAMP,
    TOPIC_LENGTH,
)
from apogee.store.checkpoint import Checkpoint
from apogee.store.commitlog import AppendResult, CommitLog
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
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"recovery after {'a clean stop' if self.clean_shutdown else 'a crash'}: "
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
) -> RecoveryReport:
    t0 = time.perf_counter()
    report = RecoveryReport(clean_shutdown=clean_shutdown, checkpoint=checkpoint)
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
        report.consume_queue_entries_dropped += _trim_past_end(cq, end)
        cq.correct_min_offset(log_min)
    commitlog.queue_offsets = {(cq.topic, cq.queue_id): cq.max_offset for cq in cqs}
    dispatcher.dispatched = end
    report.seconds = time.perf_counter() - t0
    return report


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


def _trim_past_end(cq: ConsumeQueue, end: int) -> int:
    lo, hi = cq.min_offset, cq.max_offset
    while lo < hi:
        mid = (lo + hi) // 2
        e = cq.entry(mid)
        if e is None or e[0] + e[1] > end or e[1] <= 0:
            hi = mid
        else:
            lo = mid + 1
    return cq.truncate(lo)


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
    new = tuple.__new__
    unpack_header = HEADER.unpack_from
    unpack_blank = BLANK.unpack_from
    where = start
    while mf is not None:
        report.files_checked += 1
        mm = mf.mm
        mv = memoryview(mm)
        pos = where - mf.start
        base = mf.start
        try:
            while True:
                if pos + MIN_BLANK > fsize:
                    report.stopped_because = f"no end marker in file {mf.path.name}"
                    break
                size, magic = unpack_blank(mm, pos)
                if magic == BLANK_MAGIC and size == fsize - pos:
                    pos = fsize
                    break
                if magic != MESSAGE_MAGIC:
                    if size or magic:
                        report.stopped_because = f"no record at offset {base + pos}"
                    break
                if size < HEADER_SIZE or pos + size + MIN_BLANK > fsize:
                    report.stopped_because = f"impossible size {size} at offset {base + pos}"
                    break
                f = unpack_header(mm, pos)
                blen, tlen, plen = f[BODY_LENGTH], f[TOPIC_LENGTH], f[PROPERTIES_LENGTH]
                if f[PHYS_OFFSET] != base + pos or size != HEADER_SIZE + blen + tlen + plen:
                    report.stopped_because = f"header does not check at offset {base + pos}"
                    break
                if crc32(mv[pos + CRC_FROM : pos + size]) != f[CRC]:
                    report.stopped_because = f"CRC mismatch at offset {base + pos}"
                    break
                report.records_checked += 1
                if base + pos >= redispatch_from:
                    tstart = pos + HEADER_SIZE + blen
                    try:
                        topic = str(mv[tstart : tstart + tlen], "utf-8")
                        props = decode_properties(str(mv[tstart + tlen : pos + size], "utf-8"))
                    except UnicodeDecodeError:
                        report.stopped_because = f"undecodable text at offset {base + pos}"
                        break
                    tags = props.get(PROP_TAGS)
                    keys = props.get(PROP_KEYS)
                    pending.append(
                        new(
                            AppendResult,
                            (
                                topic,
                                f[QUEUE_ID],
                                f[QUEUE_OFFSET],
                                base + pos,
                                size,
                                tag_code(topic, tags, props, f[STORE_TIMESTAMP]),
                                keys.split(" ") if keys else (),
                                props.get(PROP_UNIQ_KEY, ""),
                                f[STORE_TIMESTAMP],
                            ),
                        )
                    )
                    if len(pending) >= _REDISPATCH_BATCH:
                        dispatcher.apply(pending)
                        report.entries_redispatched += len(pending)
                        pending = []
                pos += size
        finally:
            mv.release()
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
