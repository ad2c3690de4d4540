"""The checkpoint: how far the CommitLog and what was dispatched from it are known durable.

Recovery after a crash starts from the file that holds the smaller of the two offsets, so a
stale checkpoint only makes recovery scan more; a torn one (bad CRC) is ignored and recovery scans
every file. One 48-byte record, little-endian, rewritten in place and fdatasynced::

    0       4       8                16               24              32         40   44     48
    +-------+-------+----------------+----------------+---------------+----------+----+------+
    | magic | vers  | log flushed    | dispatch flush | log flushed   | reserved | pad| crc  |
    |       |       | (offset)       | (offset)       | at (ms)       |          |    |      |
    +-------+-------+----------------+----------------+---------------+----------+----+------+

``crc`` is the CRC-32 of the first 44 bytes.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

BODY = struct.Struct("<IIqqqqI")
CRC = struct.Struct("<I")
MAGIC = 0x41504350  # "APCP"
VERSION = 1
SIZE = BODY.size + CRC.size
assert SIZE == 48


@dataclass(frozen=True, slots=True)
class Checkpoint:
    log_flushed: int
    dispatch_flushed: int
    log_flushed_at_ms: int

    @property
    def trusted(self) -> int:
        """Everything below this log offset is durable and dispatched durably."""
        return min(self.log_flushed, self.dispatch_flushed)


class CheckpointFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def read(self) -> Checkpoint | None:
        raw = os.pread(self._fd, SIZE, 0)
        if len(raw) != SIZE:
            return None
        (crc,) = CRC.unpack_from(raw, BODY.size)
        if zlib.crc32(raw[: BODY.size]) != crc:
            return None
        magic, version, log_flushed, dispatch_flushed, at_ms, _, _ = BODY.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            return None
        return Checkpoint(log_flushed, dispatch_flushed, at_ms)

    def write(self, cp: Checkpoint) -> None:
        body = BODY.pack(
            MAGIC, VERSION, cp.log_flushed, cp.dispatch_flushed, cp.log_flushed_at_ms, 0, 0
        )
        os.pwrite(self._fd, body + CRC.pack(zlib.crc32(body)), 0)
        os.fdatasync(self._fd)

    def close(self) -> None:
        os.close(self._fd)
