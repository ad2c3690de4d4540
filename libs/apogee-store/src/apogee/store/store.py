"""MessageStore: the storage engine a broker runs on, wiring the parts together.

Directory layout::

    <root>/lock              held (flock) while a process has the store open
    <root>/abort             present while open; found at start = the last stop was a crash
    <root>/checkpoint        flush points (see checkpoint.py)
    <root>/truncate          present while the log is being cut back (see recovery.py)
    <root>/start-over        present while the store discards everything to begin again later
    <root>/queue-starts      the next queue offsets where the log began at the last start over
    <root>/commitlog/        00000000000000000000, 00000000001073741824, ...
    <root>/consumequeue/<topic>/<queue>/00000000000000000000, ...
    <root>/index/            00000000000000000000, ...
    <root>/quarantine/       CommitLog files found after a damaged record (kept for inspection)

Threads: appends run on the caller's thread under the CommitLog lock; one dispatcher thread
writes queue and index entries; one group-commit thread (sync flush); one periodic flush thread;
one retention thread. ``close()`` stops them in that order, each with a bounded wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from apogee.codec import Message, StoredMessage
from apogee.codec.send import RecordRef
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import (
    CorruptRecordError,
    InvalidArgumentError,
    InvalidQueueIdError,
    OffsetDeletedError,
    StoreClosedError,
    StoreFailedError,
    StoreLockedError,
)
from apogee.common.files import fsync_dir
from apogee.store.checkpoint import Checkpoint, CheckpointFile
from apogee.store.commitlog import AppendResult, CommitLog
from apogee.store.config import FlushMode, StoreConfig
from apogee.store.consumequeue import ConsumeQueue, ConsumeQueueTable
from apogee.store.dispatcher import ArrivalNotifier, Dispatcher, Watch
from apogee.store.flush import GroupCommit, PeriodicFlush
from apogee.store.indexfile import IndexService
from apogee.store.reading import PropertyFilter, QueueReader
from apogee.store.records import Encoder, TagCode, default_tag_code, validate_topic
from apogee.store.recovery import (
    QueueStarts,
    RecoveryReport,
    StartOverMarker,
    TruncateMarker,
    cut_queues,
    discard_all,
    recover,
    redo_start_over,
    redo_truncation,
    set_queue_offsets,
)
from apogee.store.retention import Retention, disk_used_ratio

log = logging.getLogger(__name__)

#: How long :meth:`MessageStore.truncate` waits for the dispatcher to catch up with the log.
_TRUNCATE_DISPATCH_WAIT_S = 30.0
#: Test-only: called with the step a truncation has reached (``"marked"``: the marker is
#: durable, nothing is cut yet; ``"log cut"``: the CommitLog is cut, the queues not yet), so a
#: test can kill the process there. None otherwise.
TRUNCATE_HOOK: Callable[[str], None] | None = None
#: Test-only: called with the step a start over has reached (``"marked"``, ``"log removed"``,
#: ``"queues removed"``, ``"log begun"``, ``"checkpoint written"``: the last before the marker
#: goes), so a test can kill the process there. None otherwise.
START_OVER_HOOK: Callable[[str], None] | None = None


class GetStatus(Enum):
    FOUND = "FOUND"
    NO_MATCHED_MESSAGE = "NO_MATCHED_MESSAGE"
    """Entries were scanned but none passed the tag filter; ``next_offset`` moves past them."""
    NO_NEW_MESSAGE = "NO_NEW_MESSAGE"
    """The offset equals the queue's max offset."""
    OFFSET_TOO_SMALL = "OFFSET_TOO_SMALL"
    """Below the earliest kept offset (retention); ``next_offset`` is the earliest."""
    OFFSET_OVERFLOW = "OFFSET_OVERFLOW"
    """Beyond the max offset; ``next_offset`` is the max."""
    NO_SUCH_QUEUE = "NO_SUCH_QUEUE"
    """Nothing was ever stored in this queue."""


@dataclass(frozen=True, slots=True)
class GetResult:
    status: GetStatus
    messages: list[StoredMessage]
    next_offset: int
    min_offset: int
    max_offset: int


@dataclass(frozen=True, slots=True)
class RecordsResult:
    """What :meth:`MessageStore.get_records` read: ``count`` whole CommitLog records back to
    back in queue order (the layout is in :mod:`apogee.codec.layout`)."""

    status: GetStatus
    records: bytes
    count: int
    next_offset: int
    min_offset: int
    max_offset: int


def _status(found: object, next_offset: int, offset: int) -> GetStatus:
    """FOUND when something was read; else NO_MATCHED_MESSAGE when entries were passed over
    (filtered out, or removed by retention), NO_NEW_MESSAGE when none were."""
    if found:
        return GetStatus.FOUND
    return GetStatus.NO_MATCHED_MESSAGE if next_offset != offset else GetStatus.NO_NEW_MESSAGE


class MessageStore:
    """Open with :meth:`open`; every method is thread-safe."""

    def __init__(
        self,
        root: Path,
        config: StoreConfig,
        clock: Clock,
        store_host: str,
        tag_code: TagCode | None,
        disk_usage: Callable[[], float] | None,
    ) -> None:
        self.root = root
        self.cfg = config
        self.clock = clock
        self.tag_code: TagCode = tag_code or default_tag_code
        root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreLockedError(path=str(root), lock=str(root / "lock")) from None
        self.encoder = Encoder(config, store_host, tag_code)
        self.commitlog = CommitLog(root / "commitlog", config, self.encoder, clock)
        self.cqs = ConsumeQueueTable(
            root / "consumequeue",
            config.consume_queue_entries_per_file,
            config.consume_queue_open_files,
            config.consume_queue_idle_close_s,
        )
        self.index = IndexService(root / "index", config.index_slots, config.index_entries_per_file)
        self._reader = QueueReader(self.commitlog, config.verify_crc_on_read)
        self.notifier = ArrivalNotifier(self.cqs)
        self.dispatcher = Dispatcher(
            self.cqs,
            self.index,
            self.notifier,
            config.dispatch_backlog_max,
            0,
            name=str(root),
            inline_max=config.dispatch_inline_max,
        )
        self.checkpoint = CheckpointFile(root / "checkpoint")
        self._truncate_marker = TruncateMarker(root)
        self._start_over_marker = StartOverMarker(root)
        self._queue_starts_file = QueueStarts(root)
        self._queue_starts: dict[tuple[str, int], int] = {}
        self.retention = Retention(
            self.commitlog,
            self.cqs,
            self.index,
            config,
            clock,
            disk_usage or (lambda: disk_used_ratio(root)),
        )
        self._group_commit: GroupCommit | None = None
        self._periodic = PeriodicFlush(
            self._flush_step, config.flush_interval_s, "apogee-store-flush"
        )
        self._retention_loop = PeriodicFlush(
            self._retention_step, config.retention_check_interval_s, "apogee-store-retention"
        )
        self._close_lock = threading.Lock()
        #: held by each flush step, each retention step and a truncation: a checkpoint never
        #: mixes points from before and after a cut, and retention never drops files during one
        self._upkeep_lock = threading.Lock()
        self.closed = False
        self.recovery: RecoveryReport

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        config: StoreConfig | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        store_host: str = "",
        tag_code: TagCode | None = None,
        disk_usage: Callable[[], float] | None = None,
        start_retention: bool = True,
    ) -> MessageStore:
        """Open (creating if needed) the store at ``root``, recover it and start its threads.
        ``recovery`` holds the report of what recovery did."""
        store = cls(Path(root), config or StoreConfig(), clock, store_host, tag_code, disk_usage)
        try:
            store._start(start_retention)
        except BaseException:
            store._release()
            raise
        return store

    def _start(self, start_retention: bool) -> None:
        abort = self.root / "abort"
        clean = not abort.exists()
        cp = self.checkpoint.read()
        self.commitlog.files.load()
        self.cqs.load()
        self.index.load()
        began = redo_start_over(
            self._start_over_marker, self._queue_starts_file, self.commitlog, self.cqs, self.index
        )
        self._queue_starts = self._queue_starts_file.read()
        if began is not None:
            cp = None  # its points belong to the log that is gone
        redone = redo_truncation(self._truncate_marker, self.commitlog, self.cqs, self.index)
        clean = clean and redone is None and began is None
        report = recover(
            root=self.root,
            commitlog=self.commitlog,
            cqs=self.cqs,
            index=self.index,
            dispatcher=self.dispatcher,
            checkpoint=cp,
            clean_shutdown=clean,
            verify_files_after_clean_stop=self.cfg.recovery_verify_files_after_clean_stop,
            tag_code=self.tag_code,
            truncation_redone_to=redone,
            start_over_redone_at=began,
            queue_starts=self._queue_starts,
        )
        self.recovery = report
        level = (
            logging.WARNING
            if report.bytes_truncated
            or report.files_quarantined
            or redone is not None
            or began is not None
            else logging.INFO
        )
        log.log(level, "%s: %s", self.root, report.summary())
        durable = self._flush_step()
        abort.touch()
        fsync_dir(self.root)
        self.commitlog.sink = self.dispatcher.submit
        self.dispatcher.start()
        if self.cfg.flush_mode is FlushMode.SYNC:
            self._start_group_commit(durable)
        self._periodic.start()
        if start_retention:
            self._retention_loop.start()

    def _start_group_commit(self, durable: int) -> None:
        gc = GroupCommit(
            self.commitlog.flush, durable, self.cfg.sync_flush_timeout_s, name=str(self.root)
        )
        gc.start()
        self._group_commit = gc

    # -- writing --------------------------------------------------------------------------------

    def append(self, messages: Message | Sequence[Message]) -> list[AppendResult]:
        """Append one message or a batch; returns where each went. With ``FlushMode.SYNC`` it
        returns once the bytes are durable (raising :class:`FlushTimeoutError` after
        ``sync_flush_timeout_s``: then the messages are stored but durability is unconfirmed)."""
        batch = [messages] if isinstance(messages, Message) else messages
        self._check_open()
        if not batch:
            return []
        results, end = self.commitlog.put(batch)
        if self._group_commit is not None:
            self._group_commit.wait(end, self.cfg.sync_flush_timeout_s)
        return results

    def append_async(
        self,
        messages: Message | Sequence[Message],
        on_durable: Callable[[BaseException | None], None],
    ) -> list[AppendResult]:
        """Append without blocking for durability: returns where each message went, and calls
        ``on_durable(None)`` once they are durable (at once with ``FlushMode.ASYNC``), or
        ``on_durable(error)``. The callback runs on a store thread; an event loop hands it over
        with ``call_soon_threadsafe``. Concurrent callers share each fdatasync."""
        batch = [messages] if isinstance(messages, Message) else messages
        self._check_open()
        if not batch:
            on_durable(None)
            return []
        results, end = self.commitlog.put(batch)
        if self._group_commit is None:
            on_durable(None)
        else:
            self._group_commit.when_durable(end, on_durable)
        return results

    def append_records(
        self, block: bytes, refs: Sequence[RecordRef], born_host: str = ""
    ) -> list[AppendResult]:
        """Append send records (:mod:`apogee.store.send_records`) as one block: the bytes as
        their sender encoded them, with only what the log assigns written in. ``refs`` names
        each record's topic, queue, size, tag code, keys and unique id (the caller read and
        checked them); ``born_host`` fills records whose born host is zero. Durability as
        :meth:`append`."""
        self._check_open()
        if not refs:
            return []
        results, end = self.commitlog.put_records(block, refs, born_host)
        if self._group_commit is not None:
            self._group_commit.wait(end, self.cfg.sync_flush_timeout_s)
        return results

    def append_records_async(
        self,
        block: bytes,
        refs: Sequence[RecordRef],
        on_durable: Callable[[BaseException | None], None],
        born_host: str = "",
    ) -> list[AppendResult]:
        """:meth:`append_records` without blocking for durability, as :meth:`append_async`."""
        self._check_open()
        if not refs:
            on_durable(None)
            return []
        results, end = self.commitlog.put_records(block, refs, born_host)
        if self._group_commit is None:
            on_durable(None)
        else:
            self._group_commit.when_durable(end, on_durable)
        return results

    # -- replication ----------------------------------------------------------------------------

    def append_replica(self, phys: int, data: bytes) -> int:
        """Append bytes copied unchanged from a leader's CommitLog (:meth:`read_log` there) at
        log offset ``phys``, which must be this log's end; returns the new end. The records land
        at the physical offsets they name, so both logs hold the same bytes at the same offsets;
        this store builds its own ConsumeQueues and index from them, as for its own appends.

        ``data`` is whole records back to back, and may hold a file's blank end marker (its 8
        bytes), after which the records continue at the start of the next file. Every record is
        checked before anything is written (magic, size, stored physical offset, CRC, topic,
        queue id, and that its queue offset continues its queue): a bad one raises
        :class:`CorruptRecordError` naming its offset and nothing is written. A ``phys`` that is
        not the end raises :class:`InvalidArgumentError`.

        Durability as :meth:`append`. In SYNC mode the bytes are staged like an append's: the
        group commit writes them, fdatasyncs and only then dispatches them, and this call waits
        for that, so a follower's queues only ever show durable records."""
        self._check_open()
        _, end = self.commitlog.put_replica(
            phys, data, self.tag_code, self.cfg.max_queues_per_topic
        )
        if self._group_commit is not None:
            self._group_commit.wait(end, self.cfg.sync_flush_timeout_s)
        return end

    def read_log(self, phys: int, max_bytes: int, limit: int | None = None) -> bytes:
        """The leader's side of :meth:`append_replica`: the CommitLog's bytes from ``phys``
        (where a record must start), whole records only, about ``max_bytes`` of them but at
        least one when there is one (even if larger). A file's blank end marker comes as its 8
        bytes and the next file's records follow it. Only what is written and dispatched
        (readable through the queues; in SYNC mode, durable) is read. b"" at that end; raises
        :class:`OffsetDeletedError` below the log's first offset, and
        :class:`InvalidArgumentError` past its end or where no record starts.

        ``limit``: read up to this log offset instead of the dispatched point (a replica group
        leader dispatches only what its followers have, so it passes the end of what it was
        told was written: :mod:`apogee_broker.replication.leader`)."""
        if self.closed:
            raise StoreClosedError(path=str(self.root))
        if max_bytes <= 0:
            raise InvalidArgumentError(field="max_bytes", rule=f"must be positive, got {max_bytes}")
        cl = self.commitlog
        if phys < cl.min_offset:
            raise OffsetDeletedError(what="physical offset", offset=phys, earliest=cl.min_offset)
        end = cl.end
        if phys > end:
            raise InvalidArgumentError(
                field="phys", rule=f"must not be past the end of the log ({end}), got {phys}"
            )
        upto = self.dispatcher.dispatched if limit is None else min(limit, end)
        return cl.read_records(phys, upto, max_bytes)

    def truncate(self, offset: int) -> int:
        """Cut the log back to ``offset`` (where a record starts, or the end) and everything
        built from it; returns the bytes of log cut. Appends (own or replica) continue at
        ``offset``. For a follower whose log went past the point where it agrees with its
        leader (:func:`apogee.store.epochs.consistent_point`); it is meant to run while nothing
        else appends: appends racing with it may be cut, or fail.

        Crash-safe (RocketMQ #10666): a marker holding ``offset`` is made durable first
        (:class:`~apogee.store.recovery.TruncateMarker`); then the rest of the file holding
        ``offset`` is zeroed and later CommitLog files deleted, ConsumeQueue entries pointing
        at or past ``offset`` dropped, the table of queue offsets rebuilt from the queues, the
        dispatch point moved back, everything flushed and the checkpoint written; only then is
        the marker removed. An open that finds the marker redoes the cut before recovery
        (:attr:`RecoveryReport.truncation_redone_to`). Index entries past the cut may stay:
        lookups check each hit against the record it points at."""
        self._check_open()
        if offset < 0:
            raise InvalidArgumentError(field="offset", rule=f"must not be negative, got {offset}")
        with self._upkeep_lock:
            gc = self._group_commit
            if gc is not None:  # replaced afterwards: its durable offset would outlive the cut
                gc.stop()
            try:
                with self.commitlog.quiesced():
                    return self._truncate_locked(offset)
            finally:
                if gc is not None:
                    self._start_group_commit(self.commitlog.files.flushed_where)

    def _truncate_locked(self, offset: int) -> int:
        cl = self.commitlog
        end = cl.end
        if not cl.min_offset <= offset <= end:
            raise InvalidArgumentError(
                field="offset",
                rule=f"must be within the log [{cl.min_offset}, {end}], got {offset}",
            )
        if offset == end:
            return 0
        if not cl.starts_record(offset):
            raise InvalidArgumentError(
                field="offset", rule=f"must be where a record starts; {offset} is inside one"
            )
        if not self.dispatcher.wait_dispatched(end, _TRUNCATE_DISPATCH_WAIT_S):
            raise StoreFailedError(
                path=str(self.root),
                reason=f"the dispatcher did not reach the log's end ({end}) within "
                f"{_TRUNCATE_DISPATCH_WAIT_S:.0f}s; nothing was cut",
            )
        hook = TRUNCATE_HOOK
        self._truncate_marker.write(offset)
        if hook is not None:
            hook("marked")
        cl.cut_locked(offset)
        if hook is not None:
            hook("log cut")
        cut_queues(offset, self.cqs, self.index)
        set_queue_offsets(cl, self.cqs, self._queue_starts)
        self.dispatcher.dispatched = offset
        self.index.flush()
        self.cqs.flush()
        durable = cl.files.flush()
        self.checkpoint.write(Checkpoint(durable, min(offset, durable), self.clock.time_ms()))
        self._truncate_marker.remove()
        log.warning("%s: truncated the log from %d back to %d", self.root, end, offset)
        return end - offset

    def start_over(
        self, offset: int, queue_starts: Mapping[tuple[str, int], int] | None = None
    ) -> int:
        """Discard everything and continue the log at ``offset``; returns the bytes of log
        discarded. For a follower whose whole log its leader has no use for: it ends below the
        leader's first offset (retention deleted the rest there), so it begins again at that
        offset, empty, and copies the leader's log from there (:meth:`append_replica`: the
        first record of each queue anchors the queue at its queue offset; readers see each
        queue from there). It is meant to run while nothing else appends.

        ``offset`` must be a multiple of ``commitlog_file_size`` (where one of the leader's
        files begins). Runs under :meth:`truncate`'s locks, and is crash-safe like it: a marker
        holding ``offset`` is made durable first (:class:`~apogee.store.recovery.StartOverMarker`);
        then every CommitLog file, every ConsumeQueue and every index file is removed, the
        table of queue offsets emptied, an empty CommitLog file made at ``offset``, the
        dispatch point and the checkpoint moved there; only then is the marker removed. An open
        that finds the marker does it all again before recovery
        (:attr:`RecoveryReport.start_over_redone_at`).

        ``queue_starts``: the leader's :meth:`queue_min_offsets` as its log began at
        ``offset``: the next queue offset of each of its queues there. A queue none of whose
        records is left then still continues at its offset (its first copied record may
        anchor it at or past it); kept in ``<root>/queue-starts`` until the next start over
        (:class:`~apogee.store.recovery.QueueStarts`). Without it such a queue would begin
        again at 0 here."""
        self._check_open()
        fsize = self.cfg.commitlog_file_size
        if offset < 0 or offset % fsize:
            raise InvalidArgumentError(
                field="offset",
                rule="must be a non-negative multiple of the CommitLog file size "
                f"({fsize}): where a file of the leader's log begins; got {offset}",
            )
        with self._upkeep_lock:
            gc = self._group_commit
            if gc is not None:  # replaced afterwards: its durable offset would outlive the log
                gc.stop()
            try:
                with self.commitlog.quiesced():
                    return self._start_over_locked(offset, queue_starts)
            finally:
                if gc is not None:
                    self._start_group_commit(self.commitlog.files.flushed_where)

    def _start_over_locked(
        self, offset: int, queue_starts: Mapping[tuple[str, int], int] | None
    ) -> int:
        cl = self.commitlog
        end = cl.end
        if not self.dispatcher.wait_dispatched(end, _TRUNCATE_DISPATCH_WAIT_S):
            raise StoreFailedError(
                path=str(self.root),
                reason=f"the dispatcher did not reach the log's end ({end}) within "
                f"{_TRUNCATE_DISPATCH_WAIT_S:.0f}s; nothing was discarded",
            )
        held = end - cl.min_offset
        hook = START_OVER_HOOK
        starts = dict(queue_starts or {})
        self._queue_starts_file.write_next(starts)
        self._start_over_marker.write(offset)
        if hook is not None:
            hook("marked")
        discard_all(offset, cl, self.cqs, self.index, hook)
        self._queue_starts_file.install()
        self._queue_starts = starts
        set_queue_offsets(cl, self.cqs, starts)
        self.dispatcher.dispatched = offset
        durable = cl.files.flush()
        self.checkpoint.write(Checkpoint(durable, offset, self.clock.time_ms()))
        if hook is not None:
            hook("checkpoint written")
        self._start_over_marker.remove()
        log.warning(
            "%s: started over at offset %d: discarded the log [%d, %d) (%d bytes), its queues "
            "and index",
            self.root,
            offset,
            end - held,
            end,
            held,
        )
        return held

    # -- reading --------------------------------------------------------------------------------

    def get(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_count: int = 32,
        tags: Collection[str] | None = None,
    ) -> GetResult:
        """Read up to ``max_count`` messages of a queue from ``offset``. With ``tags``, only
        messages whose tag is one of them (filtered by tag hash first, then exactly)."""
        cq = self._start_read(topic, queue_id, offset, max_count)
        if isinstance(cq, RecordsResult):
            return GetResult(cq.status, [], cq.next_offset, cq.min_offset, cq.max_offset)
        out, next_offset = self._reader.messages(cq, offset, max_count, tags)
        return GetResult(
            _status(out, next_offset, offset), out, next_offset, cq.min_offset, cq.max_offset
        )

    def get_records(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_count: int,
        max_bytes: int,
        tags: frozenset[str] | None = None,
        where: PropertyFilter | None = None,
    ) -> RecordsResult:
        """Whole CommitLog records of a queue from ``offset``, back to back in queue order: up
        to ``max_count`` messages and ``max_bytes`` bytes, but always at least one message when
        there is one (even if larger). With ``tags``, only messages whose tag is one of them
        (filtered by tag hash first, then exactly); with ``where``, only messages whose
        properties match it (an SQL92 condition). The statuses are :meth:`get`'s. The records
        are not CRC-checked here: whoever decodes them checks each (see
        :mod:`apogee.store.reading`)."""
        cq = self._start_read(topic, queue_id, offset, max_count)
        if max_bytes <= 0:
            raise InvalidArgumentError(field="max_bytes", rule=f"must be positive, got {max_bytes}")
        if isinstance(cq, RecordsResult):
            return cq
        records, count, next_offset = self._reader.records(
            cq, offset, max_count, max_bytes, tags, where
        )
        return RecordsResult(
            _status(count, next_offset, offset),
            records,
            count,
            next_offset,
            cq.min_offset,
            cq.max_offset,
        )

    def _start_read(
        self, topic: str, queue_id: int, offset: int, max_count: int
    ) -> ConsumeQueue | RecordsResult:
        """The queue to read, or the answer when there is nothing to read at ``offset``."""
        self._check_queue(topic, queue_id)
        if max_count <= 0:
            raise InvalidArgumentError(field="max_count", rule=f"must be positive, got {max_count}")
        cq = self.cqs.get(topic, queue_id)
        if cq is None:
            return RecordsResult(GetStatus.NO_SUCH_QUEUE, b"", 0, 0, 0, 0)
        lo, hi = cq.min_offset, cq.max_offset
        if offset < lo:
            return RecordsResult(GetStatus.OFFSET_TOO_SMALL, b"", 0, lo, lo, hi)
        if offset == hi:
            return RecordsResult(GetStatus.NO_NEW_MESSAGE, b"", 0, hi, lo, hi)
        if offset > hi:
            return RecordsResult(GetStatus.OFFSET_OVERFLOW, b"", 0, hi, lo, hi)
        return cq

    def bytes_behind(self, topic: str, queue_id: int, offset: int) -> int | None:
        """How many CommitLog bytes lie from the record at queue offset ``offset`` to the end of
        the log (a read that close to the tail is likely in the page cache); None when the
        queue has no entry there."""
        cq = self.cqs.get(topic, queue_id)
        if cq is None or not cq.min_offset <= offset < cq.max_offset:
            return None
        entry = cq.entry(offset)
        return None if entry is None else max(0, self.commitlog.max_offset - entry[0])

    def min_offset(self, topic: str, queue_id: int) -> int:
        cq = self.cqs.get(topic, queue_id)
        return cq.min_offset if cq is not None else self._queue_starts.get((topic, queue_id), 0)

    def max_offset(self, topic: str, queue_id: int) -> int:
        """One past the last readable entry of the queue (0 when it has none; where it began
        when the store started over and none of its records is left)."""
        cq = self.cqs.get(topic, queue_id)
        return cq.max_offset if cq is not None else self._queue_starts.get((topic, queue_id), 0)

    def offset_for_timestamp(self, topic: str, queue_id: int, ts_ms: int) -> int:
        """The first offset whose message was stored at or after ``ts_ms``; the max offset when
        every message is older."""
        self._check_queue(topic, queue_id)
        cq = self.cqs.get(topic, queue_id)
        if cq is None:
            return 0
        return cq.offset_for_timestamp(ts_ms, self._store_ts_at)

    def _store_ts_at(self, phys: int) -> int | None:
        try:
            return self.commitlog.message_at(phys, verify_crc=False).store_timestamp
        except (OffsetDeletedError, CorruptRecordError):
            return None

    def queue_max_offsets(self) -> dict[tuple[str, int], int]:
        """Every queue's max offset (one past its last readable entry)."""
        out = dict(self._queue_starts)
        out.update({(cq.topic, cq.queue_id): cq.max_offset for cq in self.cqs})
        return out

    def log_start(self) -> tuple[int, dict[tuple[str, int], int]]:
        """Where the log begins, and :meth:`queue_min_offsets` there, taken together between
        two retention rounds: what a follower that starts over at this log's beginning needs
        (:meth:`start_over`)."""
        with self._upkeep_lock:
            return self.commitlog.min_offset, self.queue_min_offsets()

    def queue_min_offsets(self) -> dict[tuple[str, int], int]:
        """Every queue's min offset: its first entry still readable, or its max offset when
        retention left none (the next queue offset of every queue where the log now begins:
        what a follower that starts over here passes to :meth:`start_over`)."""
        out = dict(self._queue_starts)
        out.update({(cq.topic, cq.queue_id): cq.min_offset for cq in self.cqs})
        return out

    def message_at(self, phys_offset: int) -> StoredMessage:
        """The message stored at ``phys_offset``."""
        return self.commitlog.message_at(phys_offset, self.cfg.verify_crc_on_read)

    def by_unique_id(self, unique_id: str) -> StoredMessage | None:
        """The message with this unique id (the newest, should an id repeat), or None."""
        found = self.all_by_unique_id(unique_id, 1)
        return found[0] if found else None

    def all_by_unique_id(self, unique_id: str, max_count: int = 32) -> list[StoredMessage]:
        """Every message stored with this unique id (sends are at-least-once: a retried send
        may be stored twice), newest first, at most ``max_count``."""
        limit = 64
        while True:  # hits are hash matches: widen the lookup until enough check or none is left
            hits = self.index.lookup(unique_id, 0, 2**62, limit)
            found: list[StoredMessage] = []
            for phys in hits:
                msg = self._checked(phys)
                if msg is not None and msg.unique_id == unique_id:
                    found.append(msg)
                    if len(found) >= max_count:
                        return found
            if len(hits) < limit:
                return found
            limit *= 4

    def by_key(
        self, topic: str, key: str, begin_ms: int = 0, end_ms: int = 2**62, max_count: int = 64
    ) -> list[StoredMessage]:
        """Messages of ``topic`` with ``key`` stored within ``[begin_ms, end_ms]``, newest first."""
        validate_topic(topic, self.cfg.max_topic_length)
        limit = max_count * 4
        while True:  # hits are hash matches: widen the lookup until enough check or none is left
            hits = self.index.lookup(f"{topic}#{key}", begin_ms, end_ms, limit)
            out: list[StoredMessage] = []
            seen: set[int] = set()
            for phys in hits:
                if phys in seen:
                    continue
                seen.add(phys)
                msg = self._checked(phys)
                if (
                    msg is not None
                    and msg.topic == topic
                    and key in msg.keys
                    and begin_ms <= msg.store_timestamp <= end_ms
                ):
                    out.append(msg)
                    if len(out) >= max_count:
                        break
            if len(out) >= max_count or len(hits) < limit:
                return out
            limit *= 4

    def by_time(
        self, topic: str, begin_ms: int, end_ms: int, max_count: int = 64
    ) -> tuple[list[StoredMessage], bool]:
        """Messages of ``topic`` stored within ``[begin_ms, end_ms]``, newest first, at most
        ``max_count``; and whether the window holds more than that. Each queue's window is
        found by binary search on store times (:meth:`offset_for_timestamp`); a record that
        cannot be read (retention removed it under the lookup, or it is damaged) is left out."""
        validate_topic(topic, self.cfg.max_topic_length)
        found: list[StoredMessage] = []
        more = False
        for cq in [q for q in self.cqs if q.topic == topic]:
            lo = cq.offset_for_timestamp(begin_ms, self._store_ts_at)
            hi = cq.offset_for_timestamp(end_ms + 1, self._store_ts_at)
            if hi - lo > max_count:
                more = True
                lo = hi - max_count
            for phys, _, _ in cq.entries(lo, hi - lo) if hi > lo else ():
                msg = self._checked(phys)
                if msg is not None and begin_ms <= msg.store_timestamp <= end_ms:
                    found.append(msg)
        found.sort(key=lambda m: (m.store_timestamp, m.phys_offset), reverse=True)
        return found[:max_count], more or len(found) > max_count

    def _checked(self, phys: int) -> StoredMessage | None:
        try:
            return self.commitlog.message_at(phys, self.cfg.verify_crc_on_read)
        except OffsetDeletedError:
            return None
        except CorruptRecordError as exc:
            log.warning("index points at a bad record: %s", exc)
            return None

    # -- waiting --------------------------------------------------------------------------------

    def wait_for(self, topic: str, queue_id: int, offset: int, timeout: float) -> bool:
        """Block until queue ``(topic, queue_id)`` has an entry at ``offset`` or beyond, at most
        ``timeout`` seconds; returns whether it has."""
        return self.notifier.wait_for(topic, queue_id, offset, timeout)

    def watch(self, topic: str, queue_id: int, offset: int, callback: Callable[[], None]) -> Watch:
        """Call ``callback`` once when the queue has an entry at ``offset`` or beyond (from the
        thread that indexed it: the dispatcher's, or the appending thread for a small batch);
        cancel with :meth:`cancel_watch`."""
        return self.notifier.watch(topic, queue_id, offset, callback)

    def cancel_watch(self, w: Watch) -> None:
        self.notifier.cancel(w)

    def wait_dispatched(self, timeout: float = 10.0) -> bool:
        """Block until everything appended so far is readable through its queue."""
        return self.dispatcher.wait_dispatched(self.commitlog.max_offset, timeout)

    # -- upkeep ---------------------------------------------------------------------------------

    def flush(self) -> int:
        """Flush everything now; returns the durable CommitLog offset."""
        return self._flush_step()

    def _flush_step(self) -> int:
        with self._upkeep_lock:
            dispatched = self.dispatcher.dispatched
            self.index.flush()
            self.cqs.flush()
            durable = self.commitlog.flush()
            self.checkpoint.write(
                Checkpoint(durable, min(dispatched, durable), self.clock.time_ms())
            )
            return durable

    def _retention_step(self) -> None:
        with self._upkeep_lock:
            self.retention.run_once()

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(path=str(self.root))
        if self.dispatcher.failure is not None:  # refuse before writing anything
            raise StoreFailedError(
                path=str(self.root), reason=f"dispatch failed: {self.dispatcher.failure!r}"
            )

    def _check_queue(self, topic: str, queue_id: int) -> None:
        self.encoder.topic_bytes(topic)
        if not 0 <= queue_id < self.cfg.max_queues_per_topic:
            raise InvalidQueueIdError(
                value=queue_id,
                rule=f"must be between 0 and {self.cfg.max_queues_per_topic - 1} "
                "(max_queues_per_topic)",
            )

    def close(self) -> None:
        """Stop appends, dispatch and flush what is pending, write the checkpoint, remove the
        abort marker and release the directory. Safe to call twice."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        with self.commitlog.lock:
            self.commitlog.closed = True
        self._retention_loop.stop()
        if self._group_commit is not None:
            self._group_commit.stop()  # drains: every waiting append is answered
        try:
            self.commitlog.flush()  # anything still staged reaches the log and the dispatcher
        except Exception:
            log.exception("flush of %s at close failed; the next open will recover", self.root)
        self.dispatcher.stop()
        self._periodic.stop()
        clean = self.dispatcher.failure is None
        try:
            self._flush_step()
        except Exception:
            clean = False
            log.exception("final flush of %s failed; the next open will recover", self.root)
        if clean:
            (self.root / "abort").unlink(missing_ok=True)
            fsync_dir(self.root)
        self._release()

    def _release(self) -> None:
        for closer in (self.index.close, self.cqs.close, self.commitlog.files.close):
            with contextlib.suppress(Exception):
                closer()
        with contextlib.suppress(Exception):
            self.checkpoint.close()
        with contextlib.suppress(Exception):
            os.close(self._lock_fd)

    def __enter__(self) -> MessageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def consume_queue(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        return self.cqs.get(topic, queue_id)
