"""IndexFile: a hash index from message keys and unique ids to CommitLog offsets, with time bounds.

Files live under ``index/``, named by the 20-digit CommitLog offset of their first entry. One file,
little-endian::

    +--------------------------- header, 40 bytes ----------------------------+
    | begin ts (8) | end ts (8) | begin phys (8) | end phys (8) | slots used (4) | entries (4) |
    +-------------------------------------------------------------------------+
    | slot 0 (4) | slot 1 (4) | ...                    slot_count slots        |
    +-------------------------------------------------------------------------+
    | entry 1 (20) | entry 2 (20) | ...              entry_count entries       |
    +-------------------------------------------------------------------------+

    entry:  0          4                 12            16           20
            +----------+-----------------+-------------+------------+
            | key hash | commitlog off   | time diff s | prev entry |
            +----------+-----------------+-------------+------------+

A key's hash is the CRC-32 of its UTF-8 bytes; its slot is ``hash % slot_count``. A slot holds the
number of the newest entry in its chain (0 for none); each entry holds the number of the one before
it (``prev``), so a lookup walks a chain newest first. ``time diff`` is in seconds from
``begin ts``.
Keys are ``<topic>#<key>`` for message keys and the bare unique id for ids (ids have no ``#``).

Entries are written before the slots that point to them and the header count last, so a reader
never follows a slot to an unwritten entry. A lookup treats any entry number beyond the count,
or a chain longer than the count, as its end: a torn index can lose hits, never hang or crash.
Hash collisions are resolved by the caller, which checks each hit against the record's real keys.
"""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

from apogee.common.files import fsync_dir
from apogee.store.mapped_file import MappedFile, file_name

HEADER = struct.Struct("<qqqqii")
HEADER_SIZE = HEADER.size  # 40
ENTRY = struct.Struct("<Iqii")
ENTRY_SIZE = ENTRY.size  # 20
assert HEADER_SIZE == 40
assert ENTRY_SIZE == 20
assert sys.byteorder == "little", "index slots are read through a native 'I' memoryview"

_packers: dict[int, struct.Struct] = {}


def _packer(n: int) -> struct.Struct:
    s = _packers.get(n)
    if s is None:
        s = _packers[n] = struct.Struct("<" + "Iqii" * n)
    return s


def file_size(slots: int, entries: int) -> int:
    return HEADER_SIZE + slots * 4 + (entries + 1) * ENTRY_SIZE


class IndexFile:
    def __init__(self, path: Path, start_phys: int, slots: int, entries: int, create: bool) -> None:
        self.mf = MappedFile(
            path,
            start_phys,
            file_size(slots, entries),
            create=create,
            zero_prefix=HEADER_SIZE + slots * 4,
        )
        self.slot_count = slots
        self.entry_capacity = entries
        self._entries_at = HEADER_SIZE + slots * 4
        self.slots = memoryview(self.mf.mm)[HEADER_SIZE : self._entries_at].cast("I")
        head: tuple[int, int, int, int, int, int] = HEADER.unpack_from(self.mf.mm, 0)
        self.begin_ts, self.end_ts, self.begin_phys, self.end_phys = head[:4]
        self.slots_used: int = head[4]
        self.count: int = head[5]
        if create:
            self.begin_phys = start_phys
        self.count = max(0, min(self.count, entries))

    def repair_count(self) -> None:
        """After a crash between writing slots and the header, slots may point past the count.
        Entries are written before the slots that point to them, so those entries exist: take
        the count up to the highest slot, or older entries behind such slots would be lost."""
        top = max(self.slots, default=0)
        if self.count < top <= self.entry_capacity:
            self.count = top

    @property
    def full(self) -> bool:
        return self.count >= self.entry_capacity

    def add(self, items: list[tuple[str, int, int]], start: int = 0) -> int:
        """Index ``items[start:]`` (key, commitlog offset, store ts ms) as far as there is room;
        returns how many were added."""
        room = self.entry_capacity - self.count
        take = items[start : start + room]
        if not take:
            return 0
        if self.count == 0:
            self.begin_ts = take[0][2]
        begin = self.begin_ts
        nslots = self.slot_count
        slots = self.slots
        pending: dict[int, int] = {}
        flat: list[int] = []
        n = self.count
        for key, phys, ts in take:
            h = zlib.crc32(key.encode())
            s = h % nslots
            prev = pending.get(s)
            if prev is None:
                prev = slots[s]
            n += 1
            pending[s] = n
            flat += (h, phys, (ts - begin) // 1000, prev)
        pos = self._entries_at + (self.count + 1) * ENTRY_SIZE
        for i in range(0, len(take), 512):
            chunk = flat[i * 4 : (i + 512) * 4]
            data = _packer(len(chunk) // 4).pack(*chunk)
            self.mf.write(pos, data)
            pos += len(data)
        for s, entry_no in pending.items():
            if slots[s] == 0:
                self.slots_used += 1
            slots[s] = entry_no
        self.count = n
        self.end_ts = max(self.end_ts, take[-1][2])
        self.end_phys = max(self.end_phys, take[-1][1])
        HEADER.pack_into(
            self.mf.mm,
            0,
            self.begin_ts,
            self.end_ts,
            self.begin_phys,
            self.end_phys,
            self.slots_used,
            self.count,
        )
        self.mf.wrote = pos
        return len(take)

    def lookup(self, key: str, begin_ms: int, end_ms: int, limit: int) -> list[int]:
        """CommitLog offsets of entries whose hash matches ``key`` and whose time (to the second)
        may fall in ``[begin_ms, end_ms]``, newest first."""
        h = zlib.crc32(key.encode())
        count = self.count
        if count == 0:
            return []
        entry_no = self.slots[h % self.slot_count]
        lo_s = (begin_ms - self.begin_ts) // 1000 - 1
        hi_s = (end_ms - self.begin_ts) // 1000 + 1
        out: list[int] = []
        steps = 0
        mm = self.mf.mm
        base = self._entries_at
        while 0 < entry_no <= count and steps < count and len(out) < limit:
            eh, phys, diff, prev = ENTRY.unpack_from(mm, base + entry_no * ENTRY_SIZE)
            if eh == h and lo_s <= diff <= hi_s:
                out.append(phys)
            if prev >= entry_no:  # chains only point back; anything else is damage
                break
            entry_no = prev
            steps += 1
        return out

    def close(self) -> None:
        self.slots.release()
        self.mf.close()

    def destroy(self) -> None:
        self.close()
        self.mf.path.unlink(missing_ok=True)


class IndexService:
    """The index files of a store; only the dispatcher adds, anyone may look up."""

    def __init__(self, directory: Path, slots: int, entries: int) -> None:
        self.dir = directory
        self.slot_count = slots
        self.entry_capacity = entries
        self.files: tuple[IndexFile, ...] = ()

    def load(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        files = []
        for path in sorted(self.dir.iterdir()):
            if path.is_file() and len(path.name) == 20 and path.name.isdigit():
                if path.stat().st_size != file_size(self.slot_count, self.entry_capacity):
                    path.unlink()  # made with other sizes: rebuilt from the CommitLog
                    continue
                files.append(
                    IndexFile(path, int(path.name), self.slot_count, self.entry_capacity, False)
                )
        if files:
            files[-1].repair_count()
        self.files = tuple(files)

    def add(self, items: list[tuple[str, int, int]]) -> None:
        done = 0
        while done < len(items):
            last = self.files[-1] if self.files else None
            if last is None or last.full:
                start = items[done][1]
                path = self.dir / file_name(start)
                if path.exists():  # an empty file left by a crash right after creation
                    path.unlink()
                last = IndexFile(path, start, self.slot_count, self.entry_capacity, True)
                self.files = (*self.files, last)
            done += last.add(items, done)

    def lookup(self, key: str, begin_ms: int, end_ms: int, limit: int) -> list[int]:
        out: list[int] = []
        for f in reversed(self.files):
            if len(out) >= limit:
                break
            if f.count and f.begin_ts <= end_ms and f.end_ts >= begin_ms:
                try:
                    out.extend(f.lookup(key, begin_ms, end_ms, limit - len(out)))
                except ValueError:  # closed by retention under us
                    continue
        return out

    def delete_below(self, commitlog_min: int) -> int:
        """Delete files whose every entry points below ``commitlog_min`` (never the last)."""
        keep: list[IndexFile] = []
        dropped: list[IndexFile] = []
        files = self.files
        for i, f in enumerate(files):
            if i < len(files) - 1 and f.end_phys < commitlog_min and not keep:
                dropped.append(f)
            else:
                keep.append(f)
        self.files = tuple(keep)
        for f in dropped:
            f.destroy()
        return len(dropped)

    def remove_all(self) -> int:
        """Delete every index file durably (see ``MessageStore.start_over``); returns how many
        there were. A lookup holding one finds it closed and skips it."""
        files, self.files = self.files, ()
        for f in files:
            f.destroy()
        for path in self.dir.iterdir():
            if path.is_file():
                path.unlink(missing_ok=True)
        fsync_dir(self.dir)
        return len(files)

    def flush(self) -> None:
        for f in self.files:
            if f.mf.flushed != f.count:
                f.mf.sync()
                f.mf.flushed = f.count

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = ()
