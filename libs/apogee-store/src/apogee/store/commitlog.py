"""The CommitLog: every message of a broker, appended to one log of fixed-size files.

Record layout: see :mod:`apogee.codec.layout`. An append takes the append lock, assigns each
message its queue offset (from the table of next offsets per queue) and physical offset, encodes
the whole batch into one block per file and copies it into the map; when the next record does not
fit in the current file, a blank record marks the rest of the file and the log rolls to the next.
Files needed by a batch are created before anything is written, so a full disk fails the whole
batch and leaves the log as it was.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from apogee.codec import (
    BLANK,
    BLANK_MAGIC,
    CRC_FROM,
    EMPTY_HOST,
    HEAD,
    HEADER_SIZE,
    MESSAGE_MAGIC,
    MIN_BLANK,
    TAIL,
    Message,
    StoredMessage,
    crc32,
    decode,
    encode_host,
)
from apogee.codec.send import (
    BORN,
    BORN_AT,
    CRC,
    CRC_AT,
    PLACED,
    PLACED_AT,
    STAMPED,
    RecordRef,
    check_send_records,
)
from apogee.common.clock import Clock
from apogee.common.errors import CorruptRecordError, OffsetDeletedError, StoreClosedError
from apogee.store.config import FlushMode, StoreConfig
from apogee.store.mapped_file import MappedFile, MappedFileQueue
from apogee.store.records import Encoder


class AppendResult(NamedTuple):
    """Where one appended message went. The same tuple is the dispatcher's work item."""

    topic: str
    queue_id: int
    queue_offset: int
    phys_offset: int
    size: int
    tag_code: int
    keys: Sequence[str]
    unique_id: str
    store_timestamp: int


_new_result = tuple.__new__
#: Reads at least this large use pread (the kernel copies from the page cache); smaller ones
#: slice the map. Measured here: a map faults once per fresh page, which dominates big reads.
_PREAD_MIN = 64 * 1024

#: Called with each appended batch, in log order, while the append lock is held.
Sink = Callable[[list[AppendResult], int], None]
#: What laying a batch out returns: its results, one list of parts per file it touches (file,
#: position, parts, end), and the file and position after it.
_Placed = tuple[list[AppendResult], list[tuple[MappedFile, int, list[bytes], int]], MappedFile, int]


class CommitLog:
    def __init__(
        self, directory: Path, config: StoreConfig, encoder: Encoder, clock: Clock
    ) -> None:
        self.cfg = config
        self.files = MappedFileQueue(
            directory,
            config.commitlog_file_size,
            zero_fill=config.flush_mode is FlushMode.SYNC,
        )
        self.encoder = encoder
        self.clock = clock
        #: next queue offset of every (topic, queue_id); set by recovery, advanced by appends
        self.queue_offsets: dict[tuple[str, int], int] = {}
        self.lock = threading.Lock()
        self.sink: Sink | None = None
        #: Called (on the flushing thread) with the seconds of each flush that made more of the
        #: log durable: the broker's flush latency metric.
        self.flush_observer: Callable[[float], None] | None = None
        self._flushed_to = -1
        self.closed = False
        #: SYNC mode stages appends in memory; the flush writes, fdatasyncs, then dispatches
        self.staged = config.flush_mode is FlushMode.SYNC
        self._staged: list[tuple[MappedFile, int, bytes, int]] = []
        self._staged_batches: list[tuple[list[AppendResult], int]] = []
        self._tail: tuple[MappedFile, int] | None = None
        self._flush_lock = threading.Lock()

    @property
    def min_offset(self) -> int:
        return self.files.min_offset

    @property
    def max_offset(self) -> int:
        return self.files.max_offset

    def put(self, msgs: Sequence[Message]) -> tuple[list[AppendResult], int]:
        """Append ``msgs`` in order; returns their results and the log offset after the last."""
        enc = self.encoder
        prepared = enc.prepare(msgs)  # validation first: a bad message writes nothing
        sizes = [
            HEADER_SIZE + len(m.body) + len(p[0]) + len(p[1])
            for m, p in zip(msgs, prepared, strict=True)
        ]
        return self._append(
            {(m.topic, m.queue_id) for m in msgs},
            sizes,
            lambda mf, pos, store_ts: self._encode_locked(msgs, prepared, sizes, mf, pos, store_ts),
        )

    def _append(
        self,
        queues: set[tuple[str, int]],
        sizes: Sequence[int],
        place: Callable[[MappedFile, int, int], _Placed],
    ) -> tuple[list[AppendResult], int]:
        """One batch of records of ``sizes`` for ``queues``, laid out by ``place(file, position,
        store timestamp)`` under the lock: the files it needs are made first, and if anything
        fails nothing of the batch counts (later appends overwrite what did get written)."""
        with self.lock:
            if self.closed:
                raise StoreClosedError(path=str(self.files.dir))
            store_ts = self.clock.time_ms()
            if self._tail is None:
                last = self.files.last or self.files.create(0)
                self._tail = (last, last.wrote)
            mf, pos = self._tail
            self._reserve_locked(mf, pos, sizes)
            offsets = self.queue_offsets
            saved = {k: offsets.get(k) for k in queues}
            try:
                results, segments, mf, pos = place(mf, pos, store_ts)
                end = mf.start + pos
                if self.staged:
                    staged = [(f, at, b"".join(parts), e) for f, at, parts, e in segments]
                else:
                    for seg_file, seg_pos, seg_parts, _ in segments:
                        if seg_parts:
                            seg_file.write(seg_pos, b"".join(seg_parts))
            except BaseException:
                for k, v in saved.items():
                    if v is None:
                        offsets.pop(k, None)
                    else:
                        offsets[k] = v
                raise
            self._tail = (mf, pos)
            if self.staged:
                self._staged += staged
                self._staged_batches.append((results, end))
                return results, end
            for seg_file, _, _, seg_end in segments:
                seg_file.wrote = seg_end
            if self.sink is not None:
                self.sink(results, end)
        return results, end

    def _reserve_locked(self, mf: MappedFile, pos: int, sizes: Sequence[int]) -> None:
        """Create every file a batch of records of ``sizes`` will need, from ``pos`` in ``mf``,
        before anything is changed (a full disk then fails the whole batch)."""
        fsize = self.files.file_size
        target = mf
        at = pos
        for size in sizes:
            if at + size + MIN_BLANK > fsize:
                nxt = self.files.find(target.start + fsize)
                target = nxt if nxt is not None else self.files.create(target.start + fsize)
                at = 0
            at += size

    def put_records(
        self, block: bytes, refs: Sequence[RecordRef], born_host: str = ""
    ) -> tuple[list[AppendResult], int]:
        """Append records already encoded by their sender (:mod:`apogee.codec.send`), back to
        back in ``block``, one ``refs`` entry each; returns their results and the log offset
        after the last. Only what the log assigns is written into them
        (queue and physical offsets, store timestamp and host, a born timestamp and host
        where the sender left them zero, the CRC): no record is decoded or encoded again.

        The caller has checked each record's fields against its rules (the broker does, with
        its own errors); the store checks each record's frame (magic, sizes, topic, queue id)
        against its ref before anything is written."""
        buf = bytearray(block)
        check_send_records(buf, refs, self.cfg.max_queues_per_topic)
        host = encode_host(born_host) if born_host else EMPTY_HOST
        sizes = [r[2] for r in refs]
        return self._append(
            {(r[0], r[1]) for r in refs},
            sizes,
            lambda mf, pos, store_ts: self._place_locked(buf, refs, mf, pos, store_ts, host),
        )

    def _place_locked(
        self,
        buf: bytearray,
        refs: Sequence[RecordRef],
        mf: MappedFile,
        pos: int,
        store_ts: int,
        born_host: bytes,
    ) -> _Placed:
        """Fill in what the log assigns to each record of ``buf`` and cut it into one list of
        parts per file it touches."""
        fsize = self.files.file_size
        store_host = self.encoder.store_host
        offsets = self.queue_offsets
        results: list[AppendResult] = []
        append_result = results.append
        segments: list[tuple[MappedFile, int, list[bytes], int]] = []
        parts: list[bytes] = []
        seg_start = pos
        seg_from = 0  # where the current segment starts in buf
        at = 0  # the current record in buf
        pack_placed = PLACED.pack_into
        pack_stamped = STAMPED.pack_into
        pack_crc = CRC.pack_into
        unpack_born = BORN.unpack_from
        mv = memoryview(buf)
        try:
            for topic, qid, size, tag_code, keys, uid in refs:
                if pos + size + MIN_BLANK > fsize:
                    if at > seg_from:
                        parts.append(bytes(mv[seg_from:at]))
                    if pos < fsize:
                        parts.append(BLANK.pack(fsize - pos, BLANK_MAGIC))
                    segments.append((mf, seg_start, parts, fsize))
                    nxt = self.files.find(mf.start + fsize)
                    assert nxt is not None
                    mf, pos, seg_start, parts, seg_from = nxt, 0, 0, [], at
                key = (topic, qid)
                qoff = offsets.get(key, 0)
                offsets[key] = qoff + 1
                phys = mf.start + pos
                pack_placed(buf, at + PLACED_AT, qoff, phys)
                born_ts, born = unpack_born(buf, at + BORN_AT)
                pack_stamped(
                    buf,
                    at + BORN_AT,
                    born_ts or store_ts,
                    store_ts,
                    born_host if born == EMPTY_HOST else born,
                    store_host,
                )
                pack_crc(buf, at + CRC_AT, crc32(mv[at + CRC_FROM : at + size]))
                append_result(
                    _new_result(
                        AppendResult, (topic, qid, qoff, phys, size, tag_code, keys, uid, store_ts)
                    )
                )
                pos += size
                at += size
            if at > seg_from:
                parts.append(bytes(mv[seg_from:at]) if seg_from else bytes(buf))
        finally:
            mv.release()
        segments.append((mf, seg_start, parts, pos))
        return results, segments, mf, pos

    def _encode_locked(
        self,
        msgs: Sequence[Message],
        prepared: list[tuple[bytes, bytes, str, int]],
        sizes: list[int],
        mf: MappedFile,
        pos: int,
        store_ts: int,
    ) -> _Placed:
        """Assign offsets and encode the batch into one list of parts per file it touches."""
        enc = self.encoder
        fsize = self.files.file_size
        store_host = enc.store_host
        offsets = self.queue_offsets
        results: list[AppendResult] = []
        append_result = results.append
        parts: list[bytes] = []
        segments: list[tuple[MappedFile, int, list[bytes], int]] = []
        seg_start = pos
        pack_tail = TAIL.pack
        pack_head = HEAD.pack
        for msg, (topic_b, props, uid, code), size in zip(msgs, prepared, sizes, strict=True):
            if pos + size + MIN_BLANK > fsize:
                if pos < fsize:  # a file filled by recovery's end already has its marker
                    parts.append(BLANK.pack(fsize - pos, BLANK_MAGIC))
                segments.append((mf, seg_start, parts, fsize))
                nxt = self.files.find(mf.start + fsize)
                assert nxt is not None
                mf, pos, seg_start, parts = nxt, 0, 0, []
            topic = msg.topic
            qid = msg.queue_id
            key = (topic, qid)
            qoff = offsets.get(key, 0)
            offsets[key] = qoff + 1
            phys = mf.start + pos
            body = msg.body
            born_host = msg.born_host
            tail = pack_tail(
                qid,
                msg.flag,
                qoff,
                phys,
                msg.sys_flag,
                msg.born_timestamp or store_ts,
                store_ts,
                encode_host(born_host) if born_host else EMPTY_HOST,
                store_host,
                msg.reconsume_times,
                msg.prepared_txn_offset,
                len(body),
                len(topic_b),
                len(props),
            )
            crc = crc32(props, crc32(topic_b, crc32(body, crc32(tail))))
            parts += (pack_head(size, MESSAGE_MAGIC, crc), tail, body, topic_b, props)
            tag_code = code if code >= 0 else enc.tag_code_of(msg, store_ts)
            append_result(
                _new_result(
                    AppendResult,
                    (topic, qid, qoff, phys, size, tag_code, msg.keys, uid, store_ts),
                )
            )
            pos += size
        segments.append((mf, seg_start, parts, pos))
        return results, segments, mf, pos

    # -- reading --------------------------------------------------------------------------------

    def read(self, phys: int, size: int) -> bytes:
        """The ``size`` bytes at ``phys``; raises :class:`OffsetDeletedError` below the log."""
        mf = self.files.find(phys)
        if mf is None or phys < mf.start:
            raise OffsetDeletedError(
                what="physical offset", offset=phys, earliest=self.files.min_offset
            )
        pos = phys - mf.start
        try:
            if size < _PREAD_MIN:
                return mf.mm[pos : pos + size]
            data = os.pread(mf.fd, size, pos)
            if mf.mm.closed:  # closed (its descriptor maybe reused) while we read
                raise ValueError("closed")
            return data
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise
            raise OffsetDeletedError(
                what="physical offset", offset=phys, earliest=self.files.min_offset
            ) from None
        except ValueError:  # the file was closed by retention under us
            raise OffsetDeletedError(
                what="physical offset", offset=phys, earliest=self.files.min_offset
            ) from None

    def read_spans(self, spans: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(start, end)`` span, all within one file, sliced from its map
        (for many small records: one call instead of one :meth:`read` each); raises
        :class:`OffsetDeletedError` when the file is gone."""
        first = spans[0][0]
        mf = self.files.find(first)
        if mf is None or first < mf.start or spans[-1][1] > mf.start + mf.size:
            raise OffsetDeletedError(
                what="physical offset", offset=first, earliest=self.files.min_offset
            )
        base = mf.start
        mm = mf.mm
        try:
            return [mm[a - base : b - base] for a, b in spans]
        except ValueError:  # the file was closed by retention under us
            raise OffsetDeletedError(
                what="physical offset", offset=first, earliest=self.files.min_offset
            ) from None

    def message_at(self, phys: int, verify_crc: bool = True) -> StoredMessage:
        """Decode the record that starts at ``phys``."""
        if not self.files.min_offset <= phys < self.files.max_offset:
            if phys < self.files.min_offset:
                raise OffsetDeletedError(
                    what="physical offset", offset=phys, earliest=self.files.min_offset
                )
            raise CorruptRecordError(
                where=f"physical offset {phys}",
                detail=f"beyond the end of the log ({self.files.max_offset})",
            )
        head = self.read(phys, HEAD.size)
        size, magic, _ = HEAD.unpack(head)
        if magic != MESSAGE_MAGIC or not HEADER_SIZE <= size <= self.files.file_size:
            raise CorruptRecordError(
                where=f"physical offset {phys}", detail="no message record starts here"
            )
        return decode(self.read(phys, size), f"physical offset {phys}", verify_crc)

    def flush(self) -> int:
        """:meth:`_flush`, timed for :attr:`flush_observer` when it made more data durable."""
        began = time.perf_counter()
        durable = self._flush()
        if durable > self._flushed_to:
            first = self._flushed_to < 0
            self._flushed_to = durable
            observer = self.flush_observer
            if observer is not None and not first:
                observer(time.perf_counter() - began)
        return durable

    def _flush(self) -> int:
        """Write what is staged, fdatasync, then hand staged batches to the dispatcher (so in
        SYNC mode consumers only ever see durable messages); returns the durable log offset.

        Staging exists because a write into a page that is being written back waits for it:
        appends written straight to the file while an fdatasync runs stall behind it, and group
        commit then groups nothing (measured here: 90 us per 1 KiB pwrite during fsyncs)."""
        with self._flush_lock:
            if not self.staged:
                return self.files.flush()
            with self.lock:
                staged, self._staged = self._staged, []
                batches, self._staged_batches = self._staged_batches, []
            i = 0
            while i < len(staged):  # one write per run of contiguous segments in one file
                mf, pos, data, end = staged[i]
                chunks = [data]
                j = i + 1
                while j < len(staged) and staged[j][0] is mf and staged[j][1] == end:
                    chunks.append(staged[j][2])
                    end = staged[j][3]
                    j += 1
                mf.write(pos, b"".join(chunks) if len(chunks) > 1 else data)
                mf.wrote = end
                i = j
            durable = self.files.flush()
            if self.sink is not None:
                for results, end in batches:
                    self.sink(results, end)
            return durable

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self.files.close()
