"""Reading a queue: decoded messages for ``MessageStore.get``, raw records for ``get_records``.

Both walk the ConsumeQueue from an offset with one scan (:meth:`QueueReader._scan`): entries
whose tag code is not selected (tag filter) or whose record retention removed are passed over,
the rest are grouped into runs of records that lie back to back in the CommitLog, each run is
read with one call and handed to a *sink*: ``get`` decodes the run (every record checked, CRC
included unless ``verify_crc_on_read`` is off); ``get_records`` passes the bytes through.

Tag filtering is two-step, as in RocketMQ: the tag code in the queue entry (CRC-32 of the tag)
selects candidates without touching the CommitLog; then each candidate's tag is compared
exactly, since different tags can share a CRC-32. A property filter (an SQL92 condition, see
:mod:`apogee.common.selector`) has no such index: every candidate's properties are decoded from
its record and the condition evaluated on them (``get_records`` only).

``get_records`` is the consumer's path (a pull answers whole records, which the client checks
record by record: CRC, topic, queue and queue offset), so an unfiltered read does as little per
message as it can: the entries come from the ConsumeQueue in one ``struct`` call, records lying
back to back are read in one slice, records interleaved with other queues' (a producer's batch
for several queues) are read as one span and cut out of it when they are dense enough, else
sliced from the file's map run by run in one call, and only
the first and last record of each read have their header compared with their queue entries
(magic, size, queue id, queue offset, physical offset), which catches a queue that points at the
wrong place. A filtered read looks at every candidate's header anyway (to find its tag) and
checks each.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Final, Protocol

from apogee.codec import (
    HEADER,
    HEADER_SIZE,
    MESSAGE_MAGIC,
    NAME_SEP,
    PROP_SEP,
    PROP_TAGS,
    StoredMessage,
    decode_properties,
    decode_run,
)
from apogee.codec.layout import (
    BODY_LENGTH,
    FIELDS,
    MAGIC,
    PHYS_OFFSET,
    QUEUE_ID,
    QUEUE_OFFSET,
    SIZE,
    TOPIC_LENGTH,
    header_struct,
)
from apogee.common.errors import CorruptRecordError, OffsetDeletedError
from apogee.store.commitlog import CommitLog
from apogee.store.consumequeue import ConsumeQueue
from apogee.store.records import tag_hash

#: How many queue entries a filtered read looks at, at most, to fill one batch.
FILTER_SCAN_MAX: Final = 8192
#: Contiguous records are read from the log in runs of up to this many bytes (filtered reads).
READ_CHUNK: Final = 1 << 20
#: An interleaved window is read as one span when the span is at most twice the records' bytes
#: plus this much; sparser windows are read run by run.
DENSE_SLACK: Final = 64 * 1024
#: No single read of the log is larger than this (the records' bytes excepted: one message
#: larger than a pull's budget is still answered whole).
SPAN_MAX: Final = 16 << 20
#: The header fields a cheap check compares: size, magic, queue id, queue offset, phys offset.
_CHECK = header_struct(FIELDS[: PHYS_OFFSET + 1], skip=("crc", "flag"))
_TAG_FIRST = (PROP_TAGS + NAME_SEP).encode()
_TAG_INSIDE = (PROP_SEP + PROP_TAGS + NAME_SEP).encode()
_SEP = PROP_SEP.encode()
_NO_LIMIT = 1 << 62


@dataclass(frozen=True, slots=True)
class Window:
    """Queue entries from one offset, flattened (phys, size, tag, ...), cut to ``count``
    entries that fit a byte budget (at least one); ``total`` is their records' bytes."""

    flat: tuple[int, ...]
    count: int
    sizes: tuple[int, ...]
    total: int

    @property
    def first_phys(self) -> int:
        return self.flat[0]

    @property
    def end_phys(self) -> int:
        last = 3 * (self.count - 1)
        return self.flat[last] + self.flat[last + 1]

    @property
    def contiguous(self) -> bool:
        # queue entries ascend and never overlap: no gap iff the span equals the sizes' sum
        return self.end_phys - self.first_phys == self.total


class PropertyFilter(Protocol):
    """A condition on a message's properties (its tags and keys among them, as ``TAGS`` and
    ``KEYS``), such as :class:`apogee.common.selector.SqlFilter`."""

    def matches(self, properties: Mapping[str, str]) -> bool: ...


class _Sink(Protocol):
    count: int
    nbytes: int

    def take(self, chunk: bytes, sizes: list[int], first: int, first_phys: int) -> int:
        """Consume a run of records read from ``first_phys`` (queue offsets ``first``, ``first +
        1`` ...); returns how many of them it looked at: all, unless it is full."""
        ...


class QueueReader:
    """Reads queues of one CommitLog; thread-safe (it keeps no state between calls)."""

    def __init__(self, commitlog: CommitLog, verify_crc: bool) -> None:
        self.commitlog = commitlog
        self.verify_crc = verify_crc

    # -- get: decoded messages ------------------------------------------------------------------

    def messages(
        self, cq: ConsumeQueue, offset: int, max_count: int, tags: Collection[str] | None
    ) -> tuple[list[StoredMessage], int]:
        """Up to ``max_count`` messages from ``offset`` (``tags``: only those), and the offset
        the next read starts at."""
        if not tags:
            win = window(cq, offset, max_count, _NO_LIMIT)
            if (
                win is not None
                and win.count == min(max_count, cq.max_offset - offset)
                and win.contiguous
                and win.first_phys >= self.commitlog.files.min_offset
                and win.total <= 8 * READ_CHUNK
            ):
                chunk = self._read(win.first_phys, win.total)
                if chunk is not None:
                    run = decode_run(
                        chunk,
                        win.sizes,
                        self.verify_crc,
                        cq.topic,
                        cq.queue_id,
                        offset,
                        win.flat[0],
                    )
                    return run, offset + len(run)
        sink = _DecodeSink(cq, self.verify_crc, tags or None)
        hashes = {tag_hash(t) for t in tags} if tags else None
        next_offset = self._scan(cq, offset, max_count, _NO_LIMIT, hashes, sink, bool(tags))
        return sink.out, next_offset

    # -- get_records: raw records ---------------------------------------------------------------

    def records(
        self,
        cq: ConsumeQueue,
        offset: int,
        max_count: int,
        max_bytes: int,
        tags: frozenset[str] | None,
        where: PropertyFilter | None = None,
    ) -> tuple[bytes, int, int]:
        """Whole records of up to ``max_count`` messages and ``max_bytes`` bytes (at least one
        message) from ``offset``, back to back in queue order (with ``tags`` and ``where``,
        only those that match both); returns them, their count and the offset the next read
        starts at."""
        if not tags and where is None:
            tags = None
            parts: list[bytes] = []
            count = nbytes = 0
            pos = offset
            while count < max_count and pos < cq.max_offset:
                got = self._fast(cq, pos, max_count - count, max_bytes - nbytes, count == 0)
                if got is None or not got[1]:
                    break
                chunk, n = got
                parts.append(chunk)
                count += n
                nbytes += len(chunk)
                pos += n
            if count:
                return (parts[0] if len(parts) == 1 else b"".join(parts)), count, pos
        sink = _RecordSink(cq, tags or None, where, max_bytes)
        hashes = {tag_hash(t) for t in tags} if tags else None
        next_offset = self._scan(cq, offset, max_count, max_bytes, hashes, sink, True)
        return b"".join(sink.parts), sink.count, next_offset

    def _fast(
        self, cq: ConsumeQueue, offset: int, max_count: int, budget: int, first: bool
    ) -> tuple[bytes, int] | None:
        """One window of an unfiltered read (at most one ConsumeQueue file, 512 entries, one
        CommitLog file); ``(b"", 0)`` when the budget is spent, None when the general path must
        take over (records removed by retention, a read racing retention)."""
        win = window(cq, offset, max_count, max(budget, 0))
        if win is None:
            return None
        if win.total > budget and not first:
            return b"", 0
        start = win.first_phys
        if start < self.commitlog.files.min_offset:
            return None
        n = win.count
        phys: tuple[int, ...] = win.flat[0 : 3 * n : 3]
        sizes = win.sizes
        if win.contiguous:
            chunk = self._read(start, win.total)
            if chunk is None:
                return None
            _check_ends(chunk, cq, offset, phys, sizes)
            return chunk, n
        fsize = self.commitlog.files.file_size
        in_file = bisect_left(phys, (start // fsize + 1) * fsize)  # one CommitLog file per read
        if in_file < n:
            n = in_file
            phys = phys[:n]
            sizes = sizes[:n]
        total = sum(sizes)
        span = phys[-1] + sizes[-1] - start
        if span <= min(2 * total + DENSE_SLACK, SPAN_MAX):
            buf = self._read(start, span)
            if buf is None:
                return None
            with memoryview(buf) as mv:
                chunk = b"".join([mv[a - start : b - start] for a, b in _runs(phys, sizes)])
        else:
            try:
                chunk = b"".join(self.commitlog.read_spans(_runs(phys, sizes)))
            except OffsetDeletedError:
                return None
        _check_ends(chunk, cq, offset, phys, sizes)
        return chunk, n

    # -- the shared scan ------------------------------------------------------------------------

    def _scan(
        self,
        cq: ConsumeQueue,
        offset: int,
        max_count: int,
        max_bytes: int,
        hashes: set[int] | None,
        sink: _Sink,
        filtering: bool,
    ) -> int:
        """Feed ``sink`` the runs of selected records from ``offset`` until it holds
        ``max_count`` messages or ``max_bytes`` bytes (at least one message) or the scanned
        entries run out; returns the offset just past the last entry looked at. ``hashes``:
        the tag codes of candidates (None: every entry is one); ``filtering``: the sink passes
        over some, so up to :data:`FILTER_SCAN_MAX` entries are scanned."""
        log_min = self.commitlog.files.min_offset
        head = cq.entry(offset)
        if head is not None and head[0] < log_min:
            # retention removed the records of the entries ahead (the queue's earliest offset
            # is corrected right after): skip them all, not max_count at a time
            offset = _first_kept(cq, offset, log_min)
        scan = max(max_count, FILTER_SCAN_MAX) if filtering else max_count
        entries = cq.entries(offset, scan)
        n = len(entries)
        i = 0
        while i < n and sink.count < max_count and sink.nbytes < max_bytes:
            phys, size, tagc = entries[i]
            if phys < log_min or (hashes is not None and tagc not in hashes):
                i += 1
                continue
            # gather a run of selected records that lie back to back in the log
            j = i + 1
            end = phys + size
            want = max_count - sink.count
            room = max(max_bytes - sink.nbytes, size)
            while j < n and j - i < want and end - phys < READ_CHUNK:
                p2, s2, t2 = entries[j]
                if p2 != end or end + s2 - phys > room or (hashes is not None and t2 not in hashes):
                    break
                end += s2
                j += 1
            chunk = self._read(phys, end - phys)
            if chunk is None:  # removed by retention under us: pass the entry
                i += 1
                log_min = self.commitlog.files.min_offset
                continue
            took = sink.take(chunk, [e[1] for e in entries[i:j]], offset + i, phys)
            i += took
            if i < j:  # the sink is full
                break
        return offset + i

    def _read(self, phys: int, size: int) -> bytes | None:
        try:
            return self.commitlog.read(phys, size)
        except OffsetDeletedError:
            return None


def window(cq: ConsumeQueue, offset: int, max_count: int, budget: int) -> Window | None:
    """The entries from ``offset`` (one ConsumeQueue file, at most 512) whose records fit
    ``budget`` bytes; at least one. None when there is no entry there."""
    flat = cq.entries_flat(offset, max_count)
    if not flat:
        return None
    sizes: tuple[int, ...] = flat[1::3]
    total = sum(sizes)
    count = len(sizes)
    if total > budget:
        acc = list(accumulate(sizes))
        count = max(1, bisect_right(acc, budget))
        total = acc[count - 1]
        sizes = sizes[:count]
    return Window(flat, count, sizes, total)


def _first_kept(cq: ConsumeQueue, offset: int, log_min: int) -> int:
    """The first queue offset from ``offset`` whose record is still in the log (entries point
    at ascending physical offsets, so a binary search finds it)."""
    lo, hi = offset, cq.max_offset
    while lo < hi:
        mid = (lo + hi) // 2
        entry = cq.entry(mid)
        if entry is not None and entry[0] >= log_min:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _runs(phys: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """The records at ``phys`` as (start, end) runs of neighbours."""
    out: list[tuple[int, int]] = []
    run_start = phys[0]
    run_end = run_start + sizes[0]
    for p, s in zip(phys[1:], sizes[1:], strict=True):
        if p != run_end:
            out.append((run_start, run_end))
            run_start = p
        run_end = p + s
    out.append((run_start, run_end))
    return out


def _check_ends(
    chunk: bytes, cq: ConsumeQueue, first: int, phys: tuple[int, ...], sizes: tuple[int, ...]
) -> None:
    """Compare the first and the last record of a read with their queue entries."""
    _check_at(chunk, 0, sizes[0], cq, first, phys[0])
    last = len(sizes) - 1
    if last:
        _check_at(chunk, len(chunk) - sizes[last], sizes[last], cq, first + last, phys[last])


def _check_at(chunk: bytes, pos: int, size: int, cq: ConsumeQueue, qoff: int, phys: int) -> None:
    if len(chunk) - pos >= _CHECK.size:
        got = _CHECK.unpack_from(chunk, pos)
        if got == (size, MESSAGE_MAGIC, cq.queue_id, qoff, phys):
            return
    raise CorruptRecordError(
        where=f"{cq.topic}/{cq.queue_id} offset {qoff} (physical {phys})",
        detail="the record there does not match its queue entry (magic, size, offset or queue)",
    )


def record_tag(props: bytes) -> bytes | None:
    """The ``TAGS`` property of a record's raw properties (written first when present)."""
    if props.startswith(_TAG_FIRST):
        start = len(_TAG_FIRST)
    else:
        at = props.find(_TAG_INSIDE)
        if at < 0:
            return None
        start = at + len(_TAG_INSIDE)
    end = props.find(_SEP, start)
    return props[start:] if end < 0 else props[start:end]


class _DecodeSink:
    """``get``'s sink: decode each run, keep the messages whose tag is selected."""

    def __init__(self, cq: ConsumeQueue, verify_crc: bool, tags: Collection[str] | None) -> None:
        self.cq = cq
        self.verify_crc = verify_crc
        self.tags = tags
        self.out: list[StoredMessage] = []
        self.count = 0
        self.nbytes = 0

    def take(self, chunk: bytes, sizes: list[int], first: int, first_phys: int) -> int:
        run = decode_run(
            chunk, sizes, self.verify_crc, self.cq.topic, self.cq.queue_id, first, first_phys
        )
        if self.tags is None:
            self.out += run
        else:
            tags = self.tags
            self.out += [m for m in run if m.tags in tags]
        self.count = len(self.out)
        return len(sizes)


class _RecordSink:
    """``get_records``' sink: keep raw records (exactly matching the tags and the property
    filter, if any) within the byte budget; the first record is always kept."""

    def __init__(
        self,
        cq: ConsumeQueue,
        tags: frozenset[str] | None,
        where: PropertyFilter | None,
        max_bytes: int,
    ) -> None:
        self.cq = cq
        self.wanted = frozenset(t.encode() for t in tags) if tags is not None else None
        self.where = where
        self.filtered = tags is not None or where is not None
        self.max_bytes = max_bytes
        self.parts: list[bytes] = []
        self.count = 0
        self.nbytes = 0

    def take(self, chunk: bytes, sizes: list[int], first: int, first_phys: int) -> int:
        pos = 0
        keep_from = -1  # start of the current run of kept records in ``chunk``
        looked = 0
        filtered = self.filtered
        for k, size in enumerate(sizes):
            if not filtered:
                keep = True
                if k == 0 or k == len(sizes) - 1:
                    _check_at(chunk, pos, size, self.cq, first + k, first_phys + pos)
            else:
                keep = self._matches(chunk, pos, size, first + k, first_phys + pos)
            if keep and self.count and self.nbytes + size > self.max_bytes:
                break  # full: this record is for the next read
            looked += 1
            if keep:
                if keep_from < 0:
                    keep_from = pos
                self.count += 1
                self.nbytes += size
            elif keep_from >= 0:
                self.parts.append(chunk[keep_from:pos])
                keep_from = -1
            pos += size
        if keep_from >= 0:
            self.parts.append(
                chunk if keep_from == 0 and pos == len(chunk) else chunk[keep_from:pos]
            )
        return looked

    def _matches(self, chunk: bytes, pos: int, size: int, qoff: int, phys: int) -> bool:
        f = HEADER.unpack_from(chunk, pos)
        if (f[SIZE], f[MAGIC], f[QUEUE_ID], f[QUEUE_OFFSET], f[PHYS_OFFSET]) != (
            size,
            MESSAGE_MAGIC,
            self.cq.queue_id,
            qoff,
            phys,
        ):
            _check_at(chunk, pos, size, self.cq, qoff, phys)  # raises, naming the record
        props_at = pos + HEADER_SIZE + f[BODY_LENGTH] + f[TOPIC_LENGTH]
        props = chunk[props_at : pos + size]
        if self.wanted is not None:
            tag = record_tag(props)
            if tag is None or tag not in self.wanted:
                return False
        if self.where is None:
            return True
        try:
            text = props.decode()
        except UnicodeDecodeError:  # a record the CRC check will name to its reader
            return True
        return self.where.matches(decode_properties(text))
