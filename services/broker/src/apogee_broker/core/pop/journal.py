"""The POP journal: one append-only file per broker (``<data_dir>/pop/journal``) from which the
POP state (:mod:`.table`) is rebuilt at start-up.

Every change of the state is appended before the call that made it is answered: a delivery
(or a re-arm) writes a POP record, an ack or a dead-lettering a DONE record, a queue's cursor
moving past the messages it handed out (or filtered out) a CURSOR record. A ``kill -9`` loses
nothing written (the page cache keeps it); the file is fsynced when it is compacted and when the
broker stops, so a machine crash may lose the last second of changes: acked messages may then
come back, and handed-out ones come back sooner (at-least-once either way, never a loss).

Layout of one record (big-endian)::

    +----------+----------+------------------------------------------------------------+
    | len  u32 | crc  u32 | payload (len bytes; crc = CRC32 of the payload)             |
    +----------+----------+------------------------------------------------------------+
    payload:  kind u8 | group_len u16 | group | topic_len u16 | topic | queue_id i32 | offset i64
              kind 1 POP:    | phys_offset i64 | size i32 | attempt u16 | visible_at_ms i64
                             | nonce u32
              kind 2 DONE:   (nothing more: the message at offset was acked or dead-lettered)
              kind 3 CURSOR: (offset is the queue's cursor: the next offset to hand out)

A record cut short at the end (a crash in the middle of a write) or failing its CRC ends the
replay there; the file is truncated to the last whole record and what was cut is reported.

Compaction: when the file has grown past ``compact_bytes`` and four times what the live state
needs, the live state is written to ``journal.new`` (fsynced), renamed over the journal, and the
directory fsynced: a crash leaves the old file or the new one, never a mix.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple

from apogee.common.files import fsync_dir

log = logging.getLogger(__name__)

FRAME: Final = struct.Struct(">II")
NAME_LEN: Final = struct.Struct(">H")
QUEUE_OFFSET: Final = struct.Struct(">iq")
POP_TAIL: Final = struct.Struct(">qiHqI")

KIND_POP: Final = 1
KIND_DONE: Final = 2
KIND_CURSOR: Final = 3

FILE_NAME: Final = "journal"


class Entry(NamedTuple):
    """One journal record, decoded (``phys``..``nonce`` only for POP)."""

    kind: int
    group: str
    topic: str
    queue_id: int
    offset: int
    phys: int = 0
    size: int = 0
    attempt: int = 0
    visible_at_ms: int = 0
    nonce: int = 0


def encode(e: Entry) -> bytes:
    g = e.group.encode()
    t = e.topic.encode()
    parts = [
        bytes([e.kind]),
        NAME_LEN.pack(len(g)),
        g,
        NAME_LEN.pack(len(t)),
        t,
        QUEUE_OFFSET.pack(e.queue_id, e.offset),
    ]
    if e.kind == KIND_POP:
        parts.append(POP_TAIL.pack(e.phys, e.size, e.attempt, e.visible_at_ms, e.nonce))
    payload = b"".join(parts)
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _decode_payload(p: bytes) -> Entry:
    kind = p[0]
    pos = 1
    (n,) = NAME_LEN.unpack_from(p, pos)
    pos += 2
    group = p[pos : pos + n].decode()
    pos += n
    (n,) = NAME_LEN.unpack_from(p, pos)
    pos += 2
    topic = p[pos : pos + n].decode()
    pos += n
    queue_id, offset = QUEUE_OFFSET.unpack_from(p, pos)
    pos += QUEUE_OFFSET.size
    if kind == KIND_POP:
        phys, size, attempt, visible_at, nonce = POP_TAIL.unpack_from(p, pos)
        pos += POP_TAIL.size
        entry = Entry(kind, group, topic, queue_id, offset, phys, size, attempt, visible_at, nonce)
    elif kind in (KIND_DONE, KIND_CURSOR):
        entry = Entry(kind, group, topic, queue_id, offset)
    else:
        raise ValueError(f"unknown record kind {kind}")
    if pos != len(p):
        raise ValueError(f"{len(p) - pos} bytes left over in a record of kind {kind}")
    return entry


@dataclass(slots=True)
class Replayed:
    """What a replay read: its records, and what it cut from a damaged tail."""

    records: int = 0
    truncated_bytes: int = 0


def read(path: Path) -> tuple[list[Entry], Replayed]:
    """Every whole record of ``path`` (none when it does not exist), truncating the file after
    the last good one."""
    report = Replayed()
    if not path.exists():
        return [], report
    data = path.read_bytes()
    out: list[Entry] = []
    pos = 0
    while pos < len(data):
        if pos + FRAME.size > len(data):
            break
        length, crc = FRAME.unpack_from(data, pos)
        start = pos + FRAME.size
        payload = data[start : start + length]
        if len(payload) != length or zlib.crc32(payload) != crc:
            break
        try:
            out.append(_decode_payload(payload))
        except (ValueError, struct.error, UnicodeDecodeError, IndexError):
            break
        pos = start + length
    if pos < len(data):
        report.truncated_bytes = len(data) - pos
        log.warning(
            "POP journal %s: %d bytes after offset %d are not a whole record (a crash during a "
            "write): cut",
            path,
            report.truncated_bytes,
            pos,
        )
        with open(path, "r+b") as f:
            f.truncate(pos)
            os.fsync(f.fileno())
    report.records = len(out)
    return out, report


class Journal:
    """The open journal: appends, and compaction into a snapshot of the live state."""

    def __init__(self, directory: Path, compact_bytes: int = 16 << 20) -> None:
        self.directory = Path(directory)
        self.path = self.directory / FILE_NAME
        self.compact_bytes = compact_bytes
        self._fd = -1
        self.size = 0

    def open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.size = os.fstat(self._fd).st_size

    def append(self, entries: Iterable[Entry]) -> bytes:
        """Append ``entries``; returns them as written (whole records)."""
        blob = b"".join(encode(e) for e in entries)
        self.append_bytes(blob)
        return blob

    def append_bytes(self, blob: bytes) -> None:
        """Append whole records, encoded (a replica's copy of its leader's)."""
        if not blob:
            return
        view = memoryview(blob)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.size += len(blob)

    def wants_compaction(self, live_records: int) -> bool:
        return self.size > self.compact_bytes and self.size > 4 * 64 * max(live_records, 1)

    def compact(self, live: Iterator[Entry]) -> bytes:
        """Replace the file with ``live`` (the state as records); returns them as written."""
        blob = b"".join(encode(e) for e in live)
        self.replace(blob)
        return blob

    def replace(self, blob: bytes) -> None:
        """Replace the file with ``blob`` (whole records), durably: a crash leaves the old
        file or the new one."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / (FILE_NAME + ".new")
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.directory)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND, 0o644)
        before, self.size = self.size, len(blob)
        log.info("POP journal rewritten whole: %d bytes -> %d", before, self.size)

    def sync(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
