"""A state file's journal: what changed since its snapshot, appended as it changes. The consumer
offsets (``consumerOffset.json`` and ``consumerOffset.journal``, :mod:`.consume.offsets`) and
the topic table (``topics.json`` and ``topics.journal``, :mod:`.topics`) are kept this way, so
that a change costs what it changes and not the size of the whole table.

Each persistence appends one record holding only the entries that changed since the previous
one, and fsyncs the file. Every persistence has a sequence number, one more than the last; the
snapshot carries the number of the last persistence it holds (``"seq"``), each record its own.
Loading reads the snapshot and applies, in order, the records whose number is above the
snapshot's: entries are absolute values, so a record the snapshot already holds is never
applied over it (for offsets, that would move them backwards).

Layout of one record (big-endian)::

    +----------+----------+------------------------------------------------------------+
    | len  u32 | crc  u32 | payload (len bytes; crc = CRC32 of the payload)             |
    +----------+----------+------------------------------------------------------------+
    payload: compact UTF-8 JSON, the snapshot's shape with ``null`` for an entry removed:
             {"seq": 42, "<key>": {"<name>": <entry or null>, ...}}
    (offsets: key "offsets", {"<topic>@<group>": {"<queue id>": 1520, ...}};
     topics:  key "topics",  {"<topic>": {"read_queues": 8, ...} or null})

A record cut short (a crash in the middle of a write) or failing its CRC, at the end or in the
middle, ends the replay there with a warning naming the file and the byte offset: what was
persisted before it is kept, and the next persistence writes a new snapshot and starts the
journal anew rather than appending after the damage. Loading never fails because of the
journal.

Compaction: when a record would take the journal past :func:`compact_bound` (the size of the
snapshot, at least :data:`COMPACT_MIN_BYTES`), the persistence writes a whole snapshot instead,
atomically, and then removes the journal. A crash between the two leaves records that are all
at or below the new snapshot's number: they are skipped at load, and the next compaction removes
them. So the journal never holds more than about one snapshot's worth of bytes, and loading
reads at most about twice the snapshot.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from apogee.common.files import append_durably, fsync_dir
from apogee.store.metadata import read_json, write_json_atomic

log = logging.getLogger(__name__)

FRAME: Final = struct.Struct(">II")
#: The journal may always grow to this size before a snapshot replaces it.
COMPACT_MIN_BYTES: Final = 64 << 10

#: The changes of one persistence: name -> entry, or None when the entry was removed.
Changes = dict[str, Any]
#: Applies one record's changes to the table under a journal's key (changed in place); each
#: journaled state has one, used by its loader and by a replica group's followers alike.
ApplyChanges = Callable[[dict[str, Any], Changes], None]


def snapshot_seq(data: Any) -> int | None:
    """A snapshot's change number; None when it has none (no journal follows it)."""
    seq = data.get("seq") if isinstance(data, dict) else None
    return seq if type(seq) is int and seq >= 0 else None


def file_size(path: Path) -> int:
    """The size of ``path``; 0 when there is no such file."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def compact_bound(snapshot_bytes: int) -> int:
    """The most bytes the journal may hold beside a snapshot of ``snapshot_bytes``."""
    return max(snapshot_bytes, COMPACT_MIN_BYTES)


@dataclass(frozen=True, slots=True)
class Journal:
    """The journal at ``path`` whose records hold their changes under ``key``; ``what`` names
    it in warnings."""

    path: Path
    key: str
    what: str

    def encode(self, seq: int, changes: Changes) -> bytes:
        """One record: persistence number ``seq`` and its changes."""
        payload = json.dumps(
            {"seq": seq, self.key: changes}, sort_keys=True, separators=(",", ":")
        ).encode()
        return FRAME.pack(len(payload), zlib.crc32(payload)) + payload

    def read(self) -> Replay:
        """Every whole record up to the first damaged one (a warning names it); the file is
        not changed."""
        return _read(self.path, self.key, self.what)

    def append(self, record: bytes) -> None:
        """Append ``record`` (whole, from :meth:`encode`) and make it durable."""
        append_durably(self.path, record)

    def remove(self) -> None:
        """Remove the journal (after a snapshot that holds all of it), durably."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.path.parent)


class JournaledFile:
    """A snapshot file and its journal, and which write comes next: a record appended to the
    journal, or, when the journal would outgrow :func:`compact_bound` or is not fit to append
    to, a whole snapshot. Its owner serializes the writes (and may make them on a worker
    thread); it computes a record's changes and a snapshot's content itself."""

    def __init__(self, path: Path, journal_path: Path, key: str, what: str) -> None:
        self.path = path
        self.journal = Journal(journal_path, key, what)
        #: the number of the last write (or the highest found in the files)
        self.seq = 0
        self.snapshot_bytes = 0
        self.journal_bytes = 0
        #: the next write is a whole snapshot (none of this shape yet, or the journal may end
        #: in damage)
        self.compact_next = True

    def loaded(self, seq: int | None, replay: Replay, applied: int) -> None:
        """Take the state of the files just read: the snapshot's number ``seq`` (None: it has
        none) and the journal's ``replay``, of which ``applied`` records were applied."""
        self.seq = max(seq or 0, replay.last_seq)
        self.snapshot_bytes = file_size(self.path)
        self.journal_bytes = replay.size
        stale = len(replay.records) - applied
        self.compact_next = seq is None or stale > 0 or replay.damaged_at is not None

    def record(self, changes: Changes) -> bytes | None:
        """The next write's journal record holding ``changes``; None when the next write
        must be a whole snapshot (:meth:`write_snapshot`)."""
        if self.compact_next:
            return None
        record = self.journal.encode(self.seq + 1, changes)
        if self.journal_bytes + len(record) > compact_bound(self.snapshot_bytes):
            return None
        return record

    def append(self, record: bytes) -> None:
        """Append ``record`` (from :meth:`record`) durably."""
        try:
            self.journal.append(record)
        except BaseException:
            self.compact_next = True  # it may end in a part of the record
            raise
        self.journal_bytes += len(record)
        self.seq += 1

    def write_snapshot(self, content: dict[str, Any]) -> None:
        """Write ``content`` as the next write's whole snapshot (atomically, with its number),
        then start the journal anew."""
        seq = self.seq + 1
        try:
            write_json_atomic(self.path, {**content, "seq": seq})
            self.journal.remove()
        except BaseException:
            self.compact_next = True
            raise
        self.seq = seq
        self.snapshot_bytes = file_size(self.path)
        self.journal_bytes = 0
        self.compact_next = False


def apply_replay(data: Any, key: str, replay: Replay, seq: int | None, apply: ApplyChanges) -> int:
    """Apply to ``data`` (a snapshot's content, changed in place) the records of ``replay``
    above ``seq``, each with ``apply`` on the table under ``key``; returns how many. Nothing
    when ``seq`` is None or ``data`` has no such table (the loader then says what is wrong)."""
    table = data.get(key) if isinstance(data, dict) else None
    if seq is None or not isinstance(table, dict):
        return 0
    applied = 0
    for record in replay.after(seq):
        apply(table, record.changes)
        applied += 1
    return applied


def read_journaled(path: Path, journal: Journal, apply: ApplyChanges) -> dict[str, Any] | None:
    """The content of the snapshot at ``path`` with ``journal`` applied, without ``seq``; None
    when there is no file (or it holds no JSON object). Raises what :func:`read_json` raises
    when the file and its backup are unreadable."""
    data = read_json(path)
    if not isinstance(data, dict):
        return None
    apply_replay(data, journal.key, journal.read(), snapshot_seq(data), apply)
    data.pop("seq", None)
    return data


@dataclass(frozen=True, slots=True)
class Record:
    seq: int
    #: as decoded, not checked (the loader checks each entry)
    changes: dict[str, Any]


@dataclass(slots=True)
class Replay:
    """What a read of the journal found: its whole records, in order, and where it stopped."""

    records: list[Record] = field(default_factory=list)
    #: the file's size (0: no file)
    size: int = 0
    #: the byte offset of the first damaged record (None: the file is whole)
    damaged_at: int | None = None

    @property
    def last_seq(self) -> int:
        """The highest persistence number read (0: none)."""
        return max((r.seq for r in self.records), default=0)

    def after(self, seq: int) -> Iterator[Record]:
        """The records above ``seq``, each above the one before (in file order)."""
        for record in self.records:
            if record.seq > seq:
                seq = record.seq
                yield record


def _read(path: Path, key: str, what: str) -> Replay:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Replay()
    except OSError as exc:
        log.warning("%s %s is unreadable (%s): not applied", what, path, exc)
        return Replay(damaged_at=0)
    replay = Replay(size=len(data))
    pos = 0
    while pos < len(data):
        reason = ""
        if pos + FRAME.size > len(data):
            reason = "a record header cut short"
        else:
            length, crc = FRAME.unpack_from(data, pos)
            payload = data[pos + FRAME.size : pos + FRAME.size + length]
            if len(payload) != length:
                reason = f"a record of {length} bytes cut short at {len(payload)}"
            elif zlib.crc32(payload) != crc:
                reason = "a record failing its CRC"
            else:
                try:
                    replay.records.append(_decode(payload, key))
                except ValueError as exc:
                    reason = f"a record that does not decode ({exc})"
        if reason:
            replay.damaged_at = pos
            log.warning(
                "%s %s: %s at byte offset %d; the %d bytes from there are not applied (a crash "
                "during a write, or damage): %d whole records before it are",
                what,
                path,
                reason,
                pos,
                len(data) - pos,
                len(replay.records),
            )
            break
        pos += FRAME.size + length
    return replay


def _decode(payload: bytes, key: str) -> Record:
    content = json.loads(payload)  # a UnicodeDecodeError is a ValueError
    if not isinstance(content, dict):
        raise ValueError("not a JSON object")
    seq, changes = content.get("seq"), content.get(key)
    if type(seq) is not int or seq < 1 or not isinstance(changes, dict):
        raise ValueError(f"expected {{'seq': <positive integer>, '{key}': {{...}}}}")
    return Record(seq, changes)
