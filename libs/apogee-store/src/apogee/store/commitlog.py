"""The CommitLog: every message of a broker, appended to one log of fixed-size files.

Record layout: see :mod:`apogee.store.records`. An append takes the append lock, assigns each
message its queue offset (from the table of next offsets per queue) and physical offset, encodes
the whole batch into one block per file and copies it into the map; when the next record does not
fit in the current file, a blank record marks the rest of the file and the log rolls to the next.
Files needed by a batch are created before anything is written, so a full disk fails the whole
batch and leaves the log as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from apogee.common.clock import Clock
from apogee.common.errors import CorruptRecordError, OffsetDeletedError, StoreClosedError

from apogee.store.config import StoreConfig
from apogee.store.mapped_file import MappedFile, MappedFileQueue
from apogee.store.records import (
    BLANK,
    BLANK_MAGIC,
    HEAD,
    HEADER_SIZE,
    MESSAGE_MAGIC,
    MIN_BLANK,
    Encoder,
    Message,
    StoredMessage,
    decode,
)


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

#: Called with each appended batch, in log order, while the append lock is held.
Sink = Callable[[list[AppendResult], int], None]


class CommitLog:
    def __init__(
        self, directory: Path, config: StoreConfig, encoder: Encoder, clock: Clock
    ) -> None:
        self.cfg = config
        self.files = MappedFileQueue(directory, config.commitlog_file_size)
        self.encoder = encoder
        self.clock = clock
        #: next queue offset of every (topic, queue_id); set by recovery, advanced by appends
        self.queue_offsets: dict[tuple[str, int], int] = {}
        self.lock = threading.Lock()
        self.sink: Sink | None = None
        self.closed = False

    @property
    def min_offset(self) -> int:
        return self.files.min_offset

    @property
    def max_offset(self) -> int:
        return self.files.max_offset

    def put(self, msgs: Sequence[Message]) -> tuple[list[AppendResult], int]:
        """Append ``msgs`` in order; returns their results and the log offset after the last."""
        enc = self.encoder
        prepared = [enc.prepare(m) for m in msgs]  # validation first: a bad message writes nothing
        fsize = self.files.file_size
        with self.lock:
            if self.closed:
                raise StoreClosedError(path=str(self.files.dir))
            store_ts = self.clock.time_ms()
            mf = self.files.last or self.files.create(0)
            pos = mf.wrote
            sizes = [HEADER_SIZE + len(m.body) + len(p[0]) + len(p[1]) for m, p in zip(msgs, prepared)]
            # Create every file the batch will need before changing anything.
            rolls = 0
            p = pos
            for size in sizes:
                if p + size + MIN_BLANK > fsize:
                    rolls += 1
                    p = 0
                p += size
            target = mf
            for _ in range(rolls):
                nxt = self.files.find(target.start + fsize)
                target = nxt if nxt is not None else self.files.create(target.start + fsize)

            offsets = self.queue_offsets
            results: list[AppendResult] = []
            parts: list[bytes] = []
            seg_start = pos
            tag_code = enc.tag_code_of
            for msg, (topic_b, props, uid), size in zip(msgs, prepared, sizes):
                if pos + size + MIN_BLANK > fsize:
                    if pos < fsize:  # a file filled by recovery's end already has its marker
                        parts.append(BLANK.pack(fsize - pos, BLANK_MAGIC))
                    self._write_locked(mf, seg_start, parts, fsize)
                    nxt = self.files.find(mf.start + fsize)
                    assert nxt is not None
                    mf, pos, seg_start, parts = nxt, 0, 0, []
                key = (msg.topic, msg.queue_id)
                qoff = offsets.get(key, 0)
                offsets[key] = qoff + 1
                phys = mf.start + pos
                enc.encode(msg, topic_b, props, qoff, phys, store_ts, parts)
                results.append(
                    _new_result(
                        AppendResult,
                        (
                            msg.topic,
                            msg.queue_id,
                            qoff,
                            phys,
                            size,
                            tag_code(msg, store_ts),
                            msg.keys,
                            uid,
                            store_ts,
                        ),
                    )
                )
                pos += size
            self._write_locked(mf, seg_start, parts, pos)
            end = mf.start + pos
            if self.sink is not None:
                self.sink(results, end)
        return results, end

    @staticmethod
    def _write_locked(mf: MappedFile, start: int, parts: list[bytes], new_wrote: int) -> None:
        if parts:
            data = b"".join(parts)
            mf.mm[start : start + len(data)] = data
        mf.wrote = new_wrote

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
            return mf.mm[pos : pos + size]
        except ValueError:  # the file was closed by retention under us
            raise OffsetDeletedError(
                what="physical offset", offset=phys, earliest=self.files.min_offset
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
        """fdatasync everything written; returns the log offset now durable."""
        return self.files.flush()

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self.files.close()
