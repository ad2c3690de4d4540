"""The CommitLog: every message of a broker, appended to one log of fixed-size files.

Record layout: see :mod:`apogee.codec.layout`. An append takes the append lock, assigns each
message its queue offset (from the table of next offsets per queue) and physical offset, encodes
the whole batch into one block per file and copies it into the map; when the next record does not
fit in the current file, a blank record marks the rest of the file and the log rolls to the next.
Files needed by a batch are created before anything is written, so a full disk fails the whole
batch and leaves the log as it was.

A follower of a replica group appends its leader's bytes unchanged (:meth:`CommitLog.put_replica`,
read there with :meth:`CommitLog.read_records`): each record is checked by the same
:func:`parse_record` recovery's scan uses, at the offset it names, and lands there. A log is cut
back with :meth:`CommitLog.cut_locked` (see ``MessageStore.truncate``), or begun again at a later
offset with :meth:`CommitLog.begin_at_locked` (see ``MessageStore.start_over``).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from apogee.codec import (
    BLANK,
    BLANK_MAGIC,
    CRC_FROM,
    EMPTY_HOST,
    HEAD,
    HEADER,
    HEADER_SIZE,
    MESSAGE_MAGIC,
    MIN_BLANK,
    PROP_KEYS,
    PROP_TAGS,
    PROP_UNIQ_KEY,
    TAIL,
    Message,
    StoredMessage,
    crc32,
    decode,
    decode_properties,
    encode_host,
)
from apogee.codec import layout as _layout
from apogee.codec.layout import (
    BODY_LENGTH,
    PHYS_OFFSET,
    PROPERTIES_LENGTH,
    QUEUE_ID,
    QUEUE_OFFSET,
    STORE_TIMESTAMP,
    TOPIC_LENGTH,
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
from apogee.common.errors import (
    CorruptRecordError,
    InvalidArgumentError,
    OffsetDeletedError,
    StoreClosedError,
)
from apogee.common.files import fsync_dir
from apogee.store.config import FlushMode, StoreConfig
from apogee.store.mapped_file import MappedFile, MappedFileQueue
from apogee.store.records import Encoder, TagCode, validate_topic


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
#: A chunk of a file's tail looked at, at a time, when a cut zeroes it.
_ZERO_CHUNK = 1 << 20


class RecordInvalid(Exception):
    """What :func:`parse_record` found instead of a record: ``reason`` says what is wrong, and is
    empty for zero bytes (where a log's written part ends)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse_record(
    buf: memoryview, pos: int, phys: int, room: int, tag_code: TagCode | None
) -> tuple[int, AppendResult | None]:
    """Check the record at ``buf[pos:]``, which sits (or is to sit) at log offset ``phys`` with
    ``room`` bytes of its file left from there: its magic, its size (it must leave room for the
    blank end marker), its stored physical offset (it must be ``phys``), its lengths and CRC.

    Returns its size and, with ``tag_code``, its :class:`AppendResult` (the dispatcher's work
    item, topic and properties decoded from the record); without, no text is decoded. A blank
    end marker spans the rest of its file, so its size is ``room`` (no message record can be
    that long) and no result comes with it. Raises :class:`RecordInvalid` otherwise. Recovery's
    scan and replica appends both check records here."""
    if room < MIN_BLANK:
        raise RecordInvalid("no end marker before the end of its file")
    if pos + MIN_BLANK > len(buf):
        raise RecordInvalid(f"only {len(buf) - pos} bytes where a record should start")
    size, magic = BLANK.unpack_from(buf, pos)
    if magic == BLANK_MAGIC and size == room:
        return room, None
    if magic != MESSAGE_MAGIC:
        raise RecordInvalid("" if not size and not magic else "no record starts here")
    if size < HEADER_SIZE or size + MIN_BLANK > room:
        raise RecordInvalid(f"impossible size {size}")
    if pos + size > len(buf):
        raise RecordInvalid(f"a {size}-byte record cut short at {len(buf) - pos} bytes")
    f = HEADER.unpack_from(buf, pos)
    blen, tlen, plen = f[BODY_LENGTH], f[TOPIC_LENGTH], f[PROPERTIES_LENGTH]
    if f[PHYS_OFFSET] != phys:
        raise RecordInvalid(f"header says physical offset {f[PHYS_OFFSET]}")
    if size != HEADER_SIZE + blen + tlen + plen:
        raise RecordInvalid(f"size {size} does not match the lengths in the header")
    if crc32(buf[pos + CRC_FROM : pos + size]) != f[_layout.CRC]:
        raise RecordInvalid("CRC mismatch")
    if tag_code is None:
        return size, None
    tstart = pos + HEADER_SIZE + blen
    try:
        topic = str(buf[tstart : tstart + tlen], "utf-8")
        props = decode_properties(str(buf[tstart + tlen : pos + size], "utf-8"))
    except UnicodeDecodeError:
        raise RecordInvalid("undecodable text") from None
    keys = props.get(PROP_KEYS)
    store_ts = f[STORE_TIMESTAMP]
    return size, _new_result(
        AppendResult,
        (
            topic,
            f[QUEUE_ID],
            f[QUEUE_OFFSET],
            phys,
            size,
            tag_code(topic, props.get(PROP_TAGS), props, store_ts),
            keys.split(" ") if keys else (),
            props.get(PROP_UNIQ_KEY, ""),
            store_ts,
        ),
    )


def _zero_rest(mf: MappedFile, pos: int) -> int:
    """Zero every byte of ``mf`` from ``pos`` to its end that is not zero; returns how many
    changed. All of it: bytes left past a run of zeros could be read as records again once
    appends reach them (they sit at the very offsets they name). Zero chunks are only read, so
    a sparse file stays sparse, and its holes, which read as zeros, are skipped
    (:func:`_data_ranges`): a cut near the start of a 1 GiB file of async flush reads what was
    written, not the whole gigabyte."""
    changed = 0
    for start, stop in _data_ranges(mf.fd, pos, mf.size):
        for at in range(start, stop, _ZERO_CHUNK):
            end = min(at + _ZERO_CHUNK, stop)
            chunk = mf.mm[at:end]
            zeros = chunk.count(0)
            if zeros != len(chunk):
                mf.write(at, bytes(end - at))
                changed += len(chunk) - zeros
    return changed


def _data_ranges(fd: int, pos: int, size: int) -> Iterator[tuple[int, int]]:
    """The ranges of the file from ``pos`` to ``size`` that may hold bytes other than zero: all
    of it but the holes its filesystem reports (``SEEK_DATA`` / ``SEEK_HOLE``; one that cannot
    tell reports no hole but the end). The file is synced first, so that what was written lately
    lies where the filesystem says."""
    os.fdatasync(fd)
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # a hole from ``pos`` to the end
                return
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # cannot tell: all of it
                yield pos, size
                return
            raise
        if start >= size:
            return
        stop = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, stop
        pos = stop


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
        #: queues whose next offset came from a leader's table at a start over and that no
        #: record of the log has shown since: a copied record may anchor them at or past it
        self.unanchored: set[tuple[str, int]] = set()
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
        """The end of what is written into the files (in SYNC mode, staged appends are not)."""
        return self.files.max_offset

    @property
    def end(self) -> int:
        """The end of the log, staged appends included: where the next append goes."""
        tail = self._tail
        return tail[0].start + tail[1] if tail is not None else self.files.max_offset

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
        sizes: Sequence[int] | None,
        place: Callable[[MappedFile, int, int], _Placed],
    ) -> tuple[list[AppendResult], int]:
        """One batch of records of ``sizes`` for ``queues``, laid out by ``place(file, position,
        store timestamp)`` under the lock: the files it needs are made first (by ``place``
        itself when ``sizes`` is None), and if anything fails nothing of the batch counts
        (later appends overwrite what did get written)."""
        with self.lock:
            if self.closed:
                raise StoreClosedError(path=str(self.files.dir))
            store_ts = self.clock.time_ms()
            if self._tail is None:
                last = self.files.last or self.files.create(0)
                self._tail = (last, last.wrote)
            mf, pos = self._tail
            if sizes is not None:
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
            if self.unanchored:
                self.unanchored.difference_update(queues)
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

    def put_replica(
        self, phys: int, data: bytes, tag_code: TagCode, max_queues: int
    ) -> tuple[list[AppendResult], int]:
        """Append ``data``, bytes of another log copied unchanged, at log offset ``phys``, which
        must be this log's end; returns a result per record and the log offset after them.

        ``data`` is whole records back to back; a blank end marker in it (its 8 bytes, not the
        zeros of the rest of its file) ends a file, and what follows it lands at the start of
        the next. Every record is checked where it is to land (:func:`parse_record`), and
        against its queue (its queue offset must be the queue's next) before anything is
        written: a bad one raises :class:`CorruptRecordError` naming its offset and nothing is
        written. In a log that starts past offset 0 (:meth:`begin_at_locked`), the first record
        of a queue not in :attr:`queue_offsets` may have any queue offset, and that of a queue
        in :attr:`unanchored` any at or past its entry: it anchors the queue. The bytes are
        then laid out as :meth:`put`'s are: written (or staged, in SYNC
        mode) file by file, the queue offsets advanced and the batch handed to the sink."""
        end = self.end  # checked again under the lock; here so a wrong phys is named as such
        if phys != end:
            raise InvalidArgumentError(
                field="phys", rule=f"must be the end of the log ({end}), got {phys}"
            )
        fsize = self.files.file_size
        results: list[AppendResult] = []
        cuts: list[tuple[int, int, int, bool]] = []  # log offset, data from, data to, ends file
        at = seg_from = 0
        where = seg_phys = phys
        topics: set[str] = set()
        with memoryview(data) as mv:
            while at < len(data):
                room = fsize - where % fsize
                try:
                    size, result = parse_record(mv, at, where, room, tag_code)
                    if result is not None:
                        if result.topic not in topics:
                            validate_topic(result.topic, self.cfg.max_topic_length)
                            topics.add(result.topic)
                        if not 0 <= result.queue_id < max_queues:
                            raise RecordInvalid(
                                f"queue id {result.queue_id} is not below max_queues_per_topic "
                                f"({max_queues})"
                            )
                except RecordInvalid as exc:
                    raise CorruptRecordError(
                        where=f"physical offset {where}",
                        detail=exc.reason or "zero bytes where a record should start",
                    ) from None
                except InvalidArgumentError as exc:  # the topic name
                    raise CorruptRecordError(
                        where=f"physical offset {where}", detail=str(exc)
                    ) from None
                if result is None:  # a blank end marker: the next record starts the next file
                    cuts.append((seg_phys, seg_from, at + MIN_BLANK, True))
                    at += MIN_BLANK
                    where += room
                    seg_from, seg_phys = at, where
                else:
                    results.append(result)
                    at += size
                    where += size
        if at > seg_from:
            cuts.append((seg_phys, seg_from, at, False))
        return self._append(
            {(r.topic, r.queue_id) for r in results},
            None,
            lambda mf, pos, _: self._place_replica_locked(phys, data, results, cuts, mf, pos),
        )

    def _place_replica_locked(
        self,
        phys: int,
        data: bytes,
        results: list[AppendResult],
        cuts: list[tuple[int, int, int, bool]],
        mf: MappedFile,
        pos: int,
    ) -> _Placed:
        """Check that ``phys`` is the log's end and each record continues its queue, advance
        the queue offsets, make the files the bytes go to and cut ``data`` into them."""
        end = mf.start + pos
        if phys != end:
            raise InvalidArgumentError(
                field="phys", rule=f"must be the end of the log ({end}), got {phys}"
            )
        offsets = self.queue_offsets
        # a log that starts past 0 (a store that started over) meets each queue first at some
        # record of its: that record's queue offset anchors the queue (at or past the start
        # the leader's table gave it, if any: that table may be a retention round older)
        anchor = self.files.min_offset > 0
        unanchored = self.unanchored
        anchored: set[tuple[str, int]] = set()
        for r in results:
            key = (r.topic, r.queue_id)
            expected = offsets.get(key)
            if expected is None:
                expected = r.queue_offset if anchor else 0
            elif key in unanchored and key not in anchored and r.queue_offset >= expected:
                expected = r.queue_offset
                anchored.add(key)
            if r.queue_offset != expected:
                raise CorruptRecordError(
                    where=f"physical offset {r.phys_offset}",
                    detail=f"queue offset {r.queue_offset} of {r.topic}/{r.queue_id} does not "
                    f"continue its queue here (its next offset is {expected})",
                )
            offsets[key] = expected + 1
        fsize = self.files.file_size
        segments: list[tuple[MappedFile, int, list[bytes], int]] = []
        for seg_phys, a, b, ends_file in cuts:
            if seg_phys >= mf.start + fsize:
                start = mf.start + fsize
                mf = self.files.find(start) or self.files.create(start)
            pos = seg_phys - mf.start
            seg_end = fsize if ends_file else pos + b - a
            segments.append((mf, pos, [data[a:b]], seg_end))
            pos = seg_end
        return results, segments, mf, pos

    def read_records(self, phys: int, limit: int, max_bytes: int) -> bytes:
        """Whole records from log offset ``phys`` (where one must start) up to ``limit`` and
        about ``max_bytes`` bytes, but at least one when there is one: the bytes as they are in
        the files, a blank end marker as its 8 bytes, after which the records of the next file
        follow. b"" at ``limit``; raises :class:`OffsetDeletedError` below the log."""
        files = self.files
        fsize = files.file_size
        out: list[bytes] = []
        total = 0
        at = phys
        while at < limit:
            mf = files.find(at)
            if mf is None or at < mf.start:
                if out:
                    break
                raise OffsetDeletedError(
                    what="physical offset", offset=phys, earliest=files.min_offset
                )
            base = mf.start
            pos = run = at - base
            stop = min(limit - base, fsize)
            full = rolled = False
            try:
                mm = mf.mm
                while pos < stop:
                    size, magic = BLANK.unpack_from(mm, pos)
                    if magic == BLANK_MAGIC and size == fsize - pos:
                        full = total + MIN_BLANK > max_bytes and total > 0
                        if not full:
                            pos += MIN_BLANK
                            total += MIN_BLANK
                            rolled = True
                        break
                    if magic != MESSAGE_MAGIC or size < HEADER_SIZE or pos + size > stop:
                        if at == phys and pos == run:
                            raise InvalidArgumentError(
                                field="phys", rule=f"must be where a record starts; {phys} is not"
                            )
                        raise CorruptRecordError(
                            where=f"physical offset {base + pos}", detail="no whole record here"
                        )
                    if (
                        at == phys
                        and pos == run
                        and HEADER.unpack_from(mm, pos)[PHYS_OFFSET] != phys
                    ):
                        raise InvalidArgumentError(
                            field="phys", rule=f"must be where a record starts; {phys} is not"
                        )
                    if total + size > max_bytes and total > 0:
                        full = True
                        break
                    pos += size
                    total += size
                if pos > run:
                    out.append(mm[run:pos])
            except ValueError:  # the file was closed by retention under us
                if out:
                    break
                raise OffsetDeletedError(
                    what="physical offset", offset=phys, earliest=files.min_offset
                ) from None
            if full or not rolled:
                break
            at = base + fsize
        return b"".join(out)

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
            return self._write_staged(staged, batches)

    def _write_staged(
        self,
        staged: list[tuple[MappedFile, int, bytes, int]],
        batches: list[tuple[list[AppendResult], int]],
    ) -> int:
        """Write staged segments, fdatasync, hand their batches to the sink; the flush lock is
        held. Returns the durable log offset."""
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

    # -- cutting back -----------------------------------------------------------------------------

    @contextmanager
    def quiesced(self) -> Iterator[None]:
        """Hold the flush lock and the append lock (in that order) for the block: no append and
        no flush runs meanwhile. Staged appends are written, made durable and handed to the
        sink first, so the files hold the whole log."""
        with self._flush_lock, self.lock:
            if self._staged or self._staged_batches:
                staged, self._staged = self._staged, []
                batches, self._staged_batches = self._staged_batches, []
                self._write_staged(staged, batches)
            yield

    def starts_record(self, offset: int) -> bool:
        """Whether a record (or a file's blank end marker) starts at ``offset``, which is within
        the written log."""
        mf = self.files.find(offset)
        if mf is None or offset < mf.start:
            return False
        pos = offset - mf.start
        fsize = self.files.file_size
        if pos + MIN_BLANK > fsize:
            return False
        size, magic = BLANK.unpack_from(mf.mm, pos)
        if magic == BLANK_MAGIC:
            return bool(size == fsize - pos)
        if magic != MESSAGE_MAGIC or pos + HEADER_SIZE > fsize:
            return False
        return bool(HEADER.unpack_from(mf.mm, pos)[PHYS_OFFSET] == offset)

    def cut_locked(self, offset: int) -> int:
        """Cut the log back to ``offset`` durably: zero the rest of the file holding it (every
        byte, see :func:`_zero_rest`) and fdatasync it, delete every later file and fsync the
        directory. Appends go on at ``offset``. Returns the bytes zeroed. The caller holds the
        locks (:meth:`quiesced`), or the log is not open yet."""
        zeroed = 0
        mf = self.files.find(offset)
        if mf is not None and offset >= mf.start:
            zeroed = _zero_rest(mf, offset - mf.start)
            os.fdatasync(mf.fd)
        more, _ = self.files.truncate(offset)
        fsync_dir(self.files.dir)
        self._tail = None
        self._flushed_to = min(self._flushed_to, offset)
        return zeroed + more

    def begin_at_locked(self, offset: int) -> None:
        """Begin the log, which holds no file (:meth:`MappedFileQueue.remove_all`), again at
        ``offset`` (a multiple of the file size) with an empty file, durably: appends go on
        there, and the table of queue offsets is empty (the caller may seed it). The caller
        holds the locks (:meth:`quiesced`), or the log is not open yet."""
        if self.files.files or offset % self.files.file_size:
            raise ValueError(
                f"cannot begin {self.files.dir} at {offset}: not empty, or not a file start"
            )
        self.files.create(offset)
        fsync_dir(self.files.dir)
        self.files.flushed_where = offset
        self.queue_offsets = {}
        self.unanchored = set()
        self._tail = None
        self._flushed_to = offset

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self.files.close()
