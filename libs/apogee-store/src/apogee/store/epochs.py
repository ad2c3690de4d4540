"""The epoch checkpoint: at which CommitLog offset each leader epoch of a replica group began.

A replica group's leader appends under an epoch number that grows with every change of leader.
Each replica keeps one entry per epoch it holds records of, as RocketMQ's ``EpochFileCache`` and
Kafka's ``leader-epoch-checkpoint`` do: ``(epoch, start offset)``, where ``start offset`` is the
CommitLog offset of the epoch's first record. Both grow from entry to entry: epochs strictly,
start offsets never backwards (an epoch that appended nothing starts where the next one does).

The file is text, one value or entry a line (Kafka's layout)::

    0                <- format version
    3                <- number of entries
    1 0              <- epoch, start offset
    2 1048576
    5 2097152

It is rewritten whole at every change: to ``<name>.tmp``, fsynced, renamed over the file, and the
directory fsynced, so a crash leaves the old content or the new, never a mix.

:func:`consistent_point` compares two replicas' epochs: how far their logs are known to be
equal, the offset a follower cuts its log back to before it copies the leader's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from apogee.common.errors import InvalidArgumentError, StoreConfigError
from apogee.common.files import fsync_dir

VERSION = 0
#: What :meth:`EpochFile.end_of` answers when no epoch of the file is at or below the one asked
#: for (the file is empty, or the epoch is older than its first): Kafka's
#: ``UNDEFINED_EPOCH`` and ``UNDEFINED_EPOCH_OFFSET``.
UNDEFINED = (-1, -1)


class EpochEntry(NamedTuple):
    epoch: int
    start_offset: int


class EpochFile:
    """The epochs of one replica's CommitLog, kept in ``path``. Call :meth:`load` first; every
    method is thread-safe and every change is durable when it returns."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._entries: list[EpochEntry] = []
        self._lock = threading.Lock()

    # -- reading --------------------------------------------------------------------------------

    def load(self) -> None:
        """Read the file; a missing one holds no epochs. A damaged one raises
        :class:`StoreConfigError` naming the file and the line."""
        try:
            text = self.path.read_text("utf-8")
        except FileNotFoundError:
            entries: list[EpochEntry] = []
        except UnicodeDecodeError as exc:
            raise StoreConfigError(
                field=str(self.path), rule=f"must be UTF-8 text ({exc.reason})"
            ) from None
        else:
            entries = _parse(self.path, text)
        with self._lock:
            self._entries = entries

    @property
    def entries(self) -> list[EpochEntry]:
        """Every entry, oldest first (a copy)."""
        with self._lock:
            return list(self._entries)

    @property
    def last(self) -> EpochEntry | None:
        with self._lock:
            return self._entries[-1] if self._entries else None

    def end_of(self, epoch: int, log_end: int) -> tuple[int, int]:
        """Kafka's ``OffsetsForLeaderEpoch``: the largest epoch of the file at or below
        ``epoch``, and the offset where it ends: the start of the entry after it, or
        ``log_end`` when it is the last. :data:`UNDEFINED` ``(-1, -1)`` when there is none."""
        with self._lock:
            return _end_of(self._entries, epoch, log_end)

    # -- changing -------------------------------------------------------------------------------

    def begin(self, epoch: int, start_offset: int) -> None:
        """Record that ``epoch`` begins at log offset ``start_offset``. The epoch must be greater
        than the last one, the offset not below the last start (equal is fine: the epoch before
        appended nothing)."""
        if epoch < 0:
            raise InvalidArgumentError(field="epoch", rule=f"must not be negative, got {epoch}")
        if start_offset < 0:
            raise InvalidArgumentError(
                field="start_offset", rule=f"must not be negative, got {start_offset}"
            )
        with self._lock:
            if self._entries:
                last = self._entries[-1]
                if epoch <= last.epoch:
                    raise InvalidArgumentError(
                        field="epoch",
                        rule=f"must be greater than the last epoch ({last.epoch}), got {epoch}",
                    )
                if start_offset < last.start_offset:
                    raise InvalidArgumentError(
                        field="start_offset",
                        rule=f"must not be below the last epoch's start ({last.start_offset}), "
                        f"got {start_offset}",
                    )
            entries = [*self._entries, EpochEntry(epoch, start_offset)]
            self._write(entries)
            self._entries = entries

    def truncate_from(self, offset: int) -> int:
        """Drop the entries that start at or past log ``offset`` (after the log was cut back to
        it); returns how many were dropped."""
        with self._lock:
            entries = [e for e in self._entries if e.start_offset < offset]
            dropped = len(self._entries) - len(entries)
            if dropped:
                self._write(entries)
                self._entries = entries
            return dropped

    def _write(self, entries: list[EpochEntry]) -> None:
        lines = [str(VERSION), str(len(entries))]
        lines += [f"{e.epoch} {e.start_offset}" for e in entries]
        data = ("\n".join(lines) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)


def consistent_point(
    leader: list[tuple[int, int]],
    leader_end: int,
    mine: list[tuple[int, int]],
    my_end: int,
) -> int:
    """The log offset up to which the leader's log and mine are known to hold the same records.

    Both lists are ``(epoch, start offset)`` entries, oldest first; ``leader_end`` and
    ``my_end`` are where each log ends. The newest epoch both have, starting at the same offset,
    was written by one leader into both logs; the logs agree up to where the first of the two
    copies of it ends (the next epoch's start, or the log's end). Epochs that only one of them
    has, or that start elsewhere, are where they part. 0 when they share no epoch."""
    theirs = set(leader)
    for i in range(len(mine) - 1, -1, -1):
        epoch, start = mine[i]
        if (epoch, start) in theirs:
            _, leader_stop = _end_of(leader, epoch, leader_end)
            my_stop = mine[i + 1][1] if i + 1 < len(mine) else my_end
            return max(start, min(leader_stop, my_stop))
    return 0


def _end_of(entries: Sequence[tuple[int, int]], epoch: int, log_end: int) -> tuple[int, int]:
    found = -1
    for i, (e, _) in enumerate(entries):
        if e > epoch:
            break
        found = i
    if found < 0:
        return UNDEFINED
    nxt = found + 1
    return entries[found][0], entries[nxt][1] if nxt < len(entries) else log_end


def _parse(path: Path, text: str) -> list[EpochEntry]:
    lines = text.splitlines()

    def bad(line: int, rule: str) -> StoreConfigError:
        return StoreConfigError(field=f"{path} line {line}", rule=rule)

    def number(line: int, raw: str, what: str) -> int:
        if not raw.isascii() or not raw.isdigit():
            raise bad(line, f"{what} must be a whole number that is not negative, got {raw!r}")
        return int(raw)

    if len(lines) < 2:
        raise bad(len(lines) + 1, "the file must start with a version line and a count line")
    version = number(1, lines[0], "the version")
    if version != VERSION:
        raise bad(1, f"the version must be {VERSION}, got {version}")
    count = number(2, lines[1], "the number of entries")
    if len(lines) - 2 != count:
        raise bad(2, f"says {count} entries but the file holds {len(lines) - 2}")
    entries: list[EpochEntry] = []
    for n, raw in enumerate(lines[2:], start=3):
        parts = raw.split(" ")
        if len(parts) != 2:
            raise bad(n, f"an entry is '<epoch> <start offset>', got {raw!r}")
        entry = EpochEntry(number(n, parts[0], "the epoch"), number(n, parts[1], "the offset"))
        if entries and entry.epoch <= entries[-1].epoch:
            raise bad(n, f"epoch {entry.epoch} must be greater than the one before it")
        if entries and entry.start_offset < entries[-1].start_offset:
            raise bad(n, f"start offset {entry.start_offset} is below the one before it")
        entries.append(entry)
    return entries
