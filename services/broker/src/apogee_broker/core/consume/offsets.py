"""Consumer offsets: where each group stands in each queue, kept in ``consumerOffset.json`` and
its journal ``consumerOffset.journal``.

A committed offset is the queue offset of the group's next message to consume, as in RocketMQ.
Commits land in memory (a pull may carry one, so they are cheap) and are persisted every
``persist_interval_s`` when something changed, and at stop; a crash of the broker loses at most
that much progress, which the group then consumes again (at-least-once).

A persistence writes only what changed since the last one: the queues committed since are
appended to ``<data_dir>/consumerOffset.journal`` (:mod:`apogee_broker.core.journal` draws the
record) and the file is fsynced, so its cost follows the commits, not the number of groups.
``consumerOffset.json`` is the base snapshot, written atomically (:mod:`apogee.store.metadata`)
by the first persistence after a start that found no snapshot of this shape, and whenever the
journal would grow past the snapshot's size (at least 64 KiB), after which the journal starts
anew::

    {"version": 1, "seq": 41,
     "offsets": {"Orders@billing": {"0": 1520, "1": 1498}, ...}}

Keys are ``<topic>@<group>`` (RocketMQ's; neither name can hold ``@``). ``seq`` numbers the last
persistence the snapshot holds; loading applies the journal's records numbered above it. A
snapshot without ``seq`` (an earlier version's) has no journal: one found beside it is not
applied. A replica group's followers keep the same two files from the group's state records
(:mod:`apogee_broker.replication.state`). :func:`read_offsets` gives the content with the
journal applied, as one file.

At start the files are read back; a damaged snapshot falls back to its ``.bak`` (the snapshot
before it, with the journal records above its number); when both are unreadable the broker
starts with no offsets rather than not at all, logs it as an error and keeps the damaged files
aside as ``consumerOffset.json.damaged`` (and ``.bak.damaged``, ``consumerOffset.journal.damaged``)
for inspection. A damaged journal record ends its replay (see :mod:`apogee_broker.core.journal`).

Rules of a commit: the group name is valid, the topic exists here, the queue is one of its read
queues, and ``0 <= offset <= max offset of the queue``. Offsets below the queue's earliest offset
(removed by retention) are accepted: a pull from there is answered OFFSET_TOO_SMALL.

Resets (earliest, latest, a time) move every read queue of a topic on this broker.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from apogee.common.aio import PeriodicLoop
from apogee.common.errors import ApogeeError, CorruptRecordError, InvalidArgumentError
from apogee.common.topics import validate_topic
from apogee.store import MessageStore
from apogee.store.metadata import read_json
from apogee_broker.core import journal
from apogee_broker.core.checks import check_read_queue, validate_group
from apogee_broker.core.topics import TopicManager

log = logging.getLogger(__name__)

FILE_NAME: Final = "consumerOffset.json"
FILE_VERSION: Final = 1
JOURNAL_NAME: Final = "consumerOffset.journal"
#: what the journal's records hold their changes under, and what warnings call it
JOURNAL_KEY: Final = "offsets"
JOURNAL_WHAT: Final = "consumer offsets journal"
#: a replica group's leader replicates a whole snapshot at least this often (seconds) while
#: offsets change
SNAPSHOT_SHIP_S: Final = 600.0

#: group -> (topic, queue id) -> offset
Table = dict[str, dict[tuple[str, int], int]]


class ResetTo(enum.Enum):
    EARLIEST = "earliest"
    LATEST = "latest"
    TIMESTAMP = "timestamp"


@dataclass(frozen=True, slots=True)
class QueueOffsets:
    """A group's committed offset of one queue (-1: nothing committed) and the queue's bounds."""

    queue_id: int
    committed: int
    min_offset: int
    max_offset: int


class ConsumerOffsets:
    """The committed offsets of every group at this broker; methods run on the event loop."""

    def __init__(
        self,
        data_dir: Path,
        store: MessageStore,
        topics: TopicManager,
        *,
        persist_interval_s: float = 5.0,
    ) -> None:
        self.path = Path(data_dir) / FILE_NAME
        self.journal_path = Path(data_dir) / JOURNAL_NAME
        self.files = journal.JournaledFile(self.path, self.journal_path, JOURNAL_KEY, JOURNAL_WHAT)
        self.store = store
        self.topics = topics
        self._offsets: Table = {}
        self._version = 0
        #: the version last written to the files, and the last persisted (written, and
        #: replicated when :attr:`replicate` is set)
        self._written = 0
        self._persisted = 0
        #: (group, topic, queue id) changed since the last write
        self._dirty: set[tuple[str, str, int]] = set()
        #: a replica group's leader: the snapshot not replicated yet, and when the last was
        self._unshipped: dict[str, Any] | None = None
        self._shipped_at: float | None = None
        self._persist_lock = asyncio.Lock()
        #: a replica group's leader: replicates a snapshot (None: waits until the commits
        #: shipped so far are replicated; :mod:`apogee_broker.replication.state`)
        self.replicate: Callable[[dict[str, Any] | None], Awaitable[None]] | None = None
        #: a replica group's leader: each commit, as it is made, as (group, items changed)
        self.on_commit: Callable[[str, list[tuple[str, int, int]]], None] | None = None
        self._loop = PeriodicLoop("apogee-broker-offsets", persist_interval_s, self.persist)

    # -- life -----------------------------------------------------------------------------------

    def load(self) -> int:
        """Read the snapshot (or its backup) and apply the journal; returns how many queue
        offsets that made. Never raises for damaged files: see the module docstring."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replay = self.files.journal.read()
        try:
            data = read_json(self.path)
            seq = journal.snapshot_seq(data)
            applied = journal.apply_replay(data, JOURNAL_KEY, replay, seq, apply_changes)
            offsets = _parse(data) if data is not None else {}
        except (CorruptRecordError, ValueError) as exc:
            offsets, seq, applied = self._recover(exc, replay)
        if seq is None and replay.records:
            log.warning(
                "consumer offsets journal %s not applied: the snapshot %s has no sequence number "
                "(an earlier version's, or a replica group's copy); the next persistence writes "
                "both anew",
                self.journal_path,
                self.path,
            )
        self._offsets = offsets
        self.files.loaded(seq, replay, applied)
        stale = len(replay.records) - applied
        count = sum(len(q) for q in offsets.values())
        log.info(
            "%d consumer offsets of %d groups loaded from %s and %d records of %s (%d skipped "
            "as held by the snapshot%s)",
            count,
            len(offsets),
            self.path,
            applied,
            self.journal_path,
            stale,
            "" if replay.damaged_at is None else f", damaged from byte {replay.damaged_at}",
        )
        return count

    def _recover(self, exc: Exception, replay: journal.Replay) -> tuple[Table, int | None, int]:
        """The offsets, snapshot number and records applied when the snapshot is damaged."""
        bak = self.path.with_name(self.path.name + ".bak")
        if not isinstance(exc, CorruptRecordError) and bak.exists():
            try:  # the file parsed but its content is wrong: the backup may be right
                backup = read_json(bak)
                if backup is not None:
                    seq = journal.snapshot_seq(backup)
                    applied = journal.apply_replay(backup, JOURNAL_KEY, replay, seq, apply_changes)
                    offsets = _parse(backup)
                    log.warning("%s is damaged (%s); its backup %s was used", self.path, exc, bak)
                    return offsets, seq, applied
            except (CorruptRecordError, ValueError) as bak_exc:
                exc = ValueError(f"{exc}; backup: {bak_exc}")
        for damaged in (self.path, bak, self.journal_path):
            if damaged.exists():
                shutil.copyfile(damaged, damaged.with_name(damaged.name + ".damaged"))
        log.error(
            "consumer offsets in %s are unreadable (%s); starting without committed offsets "
            "(groups restart from their consume-from policy); the damaged files are kept as "
            "*.damaged",
            self.path,
            exc,
        )
        self._version += 1  # write a good file at the next persist
        return {}, None, 0

    def start(self) -> None:
        """Start persisting in the background."""
        self._loop.start()

    async def stop(self) -> None:
        """Stop the background loop and persist what changed since its last round."""
        await self._loop.stop()
        try:
            await self.persist()
        except Exception:
            log.exception("persisting consumer offsets at stop failed")

    async def persist(self) -> bool:
        """Write what changed since the last write, if anything did; returns whether it wrote.

        With :attr:`replicate` set (a replica group's leader), the persistence counts once it
        is replicated too (else it is tried again next time). The commits already travel to
        the followers as they are made (:attr:`on_commit`), so what it hands to
        :attr:`replicate` is, most times, None: wait until the commits made so far are
        replicated. A whole snapshot goes only when this broker wrote one (its journal was
        compacted), at the first persistence of a term, and when the last one shipped is
        older than :data:`SNAPSHOT_SHIP_S`: the followers' journals are compacted by it, and
        the state records retention keeps always hold one."""
        async with self._persist_lock:
            version = self._version
            if version == self._persisted:
                return False
            if self._written != version:
                whole = await self._write()
                self._written = version
                if whole is not None:
                    self._unshipped = whole
            if self.replicate is not None:
                now = time.monotonic()
                if self._unshipped is None and (
                    self._shipped_at is None or now - self._shipped_at > SNAPSHOT_SHIP_S
                ):
                    self._unshipped = _to_json(self._offsets)
                try:
                    await self.replicate(self._unshipped)
                except ApogeeError as exc:
                    log.warning("consumer offsets written but not replicated yet: %s", exc)
                    return False
                if self._unshipped is not None:
                    self._unshipped = None
                    self._shipped_at = now
            self._persisted = version
            return True

    async def _write(self) -> dict[str, Any] | None:
        """Append the changes since the last write to the journal, or write a whole snapshot
        when the journal is due for compaction; returns the snapshot's content when it wrote
        one."""
        dirty, self._dirty = self._dirty, set()
        try:
            record = self.files.record(_changes(self._offsets, dirty))
            if record is not None:
                await asyncio.to_thread(self.files.append, record)
                return None
            whole = _to_json(self._offsets)  # on the loop: commits change the table there
            await asyncio.to_thread(self.files.write_snapshot, whole)
            return whole
        except BaseException:
            self._dirty |= dirty
            raise

    # -- commits --------------------------------------------------------------------------------

    def commit(
        self, group: str, topic: str, queue_id: int, offset: int, field: str = "offset"
    ) -> None:
        """Move the group's offset of one queue (see the module docstring for the rules)."""
        validate_group(group)
        self._check(topic, queue_id, offset, field)
        self._set(group, [(topic, queue_id, offset)])

    def commit_many(
        self, group: str, items: Sequence[tuple[str, int, int]], field: str = "offsets"
    ) -> None:
        """Commit ``(topic, queue_id, offset)`` items: all of them, or none when one is bad
        (the error names it as ``offsets[i]``)."""
        validate_group(group)
        for i, (topic, queue_id, offset) in enumerate(items):
            self._check(topic, queue_id, offset, f"{field}[{i}]")
        self._set(group, items)

    def _check(self, topic: str, queue_id: int, offset: int, field: str) -> None:
        config = self.topics.require(topic)
        check_read_queue(self.topics, config, queue_id)
        if offset < 0:
            raise InvalidArgumentError(field=field, rule=f"must not be negative, got {offset}")
        high = self.store.max_offset(topic, queue_id)
        if offset > high:
            raise InvalidArgumentError(
                field=field,
                rule=f"{offset} is beyond the max offset {high} of queue {topic}/{queue_id}",
            )

    def _set(self, group: str, items: Iterable[tuple[str, int, int]]) -> None:
        table = self._offsets.get(group)
        if table is None:
            table = self._offsets[group] = {}
        changed: list[tuple[str, int, int]] = []
        for topic, queue_id, offset in items:
            key = (topic, queue_id)
            if table.get(key) != offset:
                table[key] = offset
                self._dirty.add((group, topic, queue_id))
                changed.append((topic, queue_id, offset))
        if changed:
            self._version += 1
            if self.on_commit is not None:
                self.on_commit(group, changed)

    # -- reading --------------------------------------------------------------------------------

    def committed(self, group: str, topic: str, queue_id: int) -> int | None:
        table = self._offsets.get(group)
        return None if table is None else table.get((topic, queue_id))

    def group_offsets(self, group: str) -> dict[tuple[str, int], int]:
        """Every committed offset of ``group``: (topic, queue id) -> offset."""
        return dict(self._offsets.get(group, {}))

    def groups(self) -> set[str]:
        """Groups with at least one committed offset."""
        return {g for g, table in self._offsets.items() if table}

    def query(self, group: str, topic: str, queue_ids: Sequence[int]) -> list[QueueOffsets]:
        """The group's offsets of ``queue_ids`` of ``topic`` (empty: every read queue) with
        each queue's earliest and max offset."""
        validate_group(group)
        config = self.topics.require(topic)
        ids = list(queue_ids) or list(range(config.read_queues))
        for q in ids:
            check_read_queue(self.topics, config, q)
        table = self._offsets.get(group, {})
        return [
            QueueOffsets(
                q,
                table.get((topic, q), -1),
                self.store.min_offset(topic, q),
                self.store.max_offset(topic, q),
            )
            for q in ids
        ]

    # -- resets ---------------------------------------------------------------------------------

    async def reset(
        self, group: str, topic: str, to: ResetTo, timestamp_ms: int = 0
    ) -> list[tuple[int, int]]:
        """Move the group's offsets of every read queue of ``topic`` on this broker to the
        earliest, the latest, or the first message stored at or after ``timestamp_ms``;
        returns ``(queue_id, offset)`` per queue."""
        validate_group(group)
        config = self.topics.require(topic)
        if to is ResetTo.TIMESTAMP and timestamp_ms < 0:
            raise InvalidArgumentError(
                field="timestamp_ms", rule=f"must not be negative, got {timestamp_ms}"
            )
        queues = range(config.read_queues)

        def where(q: int) -> int:
            if to is ResetTo.EARLIEST:
                return self.store.min_offset(topic, q)
            if to is ResetTo.LATEST:
                return self.store.max_offset(topic, q)
            return self.store.offset_for_timestamp(topic, q, timestamp_ms)

        # the timestamp search reads the log: off the event loop
        found = await asyncio.to_thread(lambda: [(q, where(q)) for q in queues])
        self._set(group, [(topic, q, off) for q, off in found])
        log.info(
            "offsets of group %s on topic %s reset to %s: %s",
            group,
            topic,
            to.value if to is not ResetTo.TIMESTAMP else f"time {timestamp_ms}",
            found,
        )
        return found


def read_offsets(data_dir: Path) -> dict[str, Any] | None:
    """The content of ``<data_dir>/consumerOffset.json`` with its journal applied, in the
    file's shape without ``seq`` (the shape of a replicated snapshot); None when there is no
    file (or it holds no JSON object). Raises :class:`CorruptRecordError` when the file and
    its backup are unreadable."""
    path = Path(data_dir) / FILE_NAME
    return journal.read_journaled(path, _journal(path.with_name(JOURNAL_NAME)), apply_changes)


def apply_changes(table: dict[str, Any], changes: journal.Changes) -> None:
    """Apply one journal record's (or replicated commits record's) ``changes`` to the offsets
    table ``table`` (``"<topic>@<group>" -> {"<queue id>": offset}``): an offset replaces the
    queue's, None removes it, and a group's entry left with no queue goes."""
    for key, queues in changes.items():
        if not isinstance(queues, dict):
            log.warning("consumer offsets journal: entry %r skipped: not an object", key)
            continue
        entry = table.get(key)
        if not isinstance(entry, dict):
            entry = table[key] = {}
        for qid, offset in queues.items():
            if offset is None:
                entry.pop(qid, None)
            else:
                entry[qid] = offset
        if not entry:
            del table[key]


def _parse(data: Any) -> Table:
    """The offsets of a file's content; ValueError when its shape is wrong. Entries with bad
    names or values are skipped with a warning (the rest is kept)."""
    if not isinstance(data, dict) or data.get("version") != FILE_VERSION:
        raise ValueError(f"expected {{'version': {FILE_VERSION}, 'offsets': {{...}}}}")
    raw = data.get("offsets")
    if not isinstance(raw, dict):
        raise ValueError("'offsets' is not an object")
    out: Table = {}
    for key, queues in raw.items():
        topic, at, group = str(key).rpartition("@")
        try:
            if not at or not isinstance(queues, dict):
                raise ValueError("expected '<topic>@<group>': {'<queue id>': offset}")
            validate_topic(topic)
            validate_group(group)
            table = out.setdefault(group, {})
            for qid, offset in queues.items():
                if not str(qid).isdigit() or type(offset) is not int or offset < 0:
                    raise ValueError(f"queue {qid!r}: offset {offset!r} is not a queue offset")
                table[(topic, int(qid))] = offset
        except (ValueError, InvalidArgumentError) as exc:
            log.warning("consumer offsets: entry %r skipped: %s", key, exc)
    return out


def _changes(offsets: Table, dirty: Iterable[tuple[str, str, int]]) -> journal.Changes:
    """The current offsets of the ``dirty`` queues, None for one that has none any more."""
    out: journal.Changes = {}
    for group, topic, q in dirty:
        table = offsets.get(group)
        out.setdefault(f"{topic}@{group}", {})[str(q)] = (
            None if table is None else table.get((topic, q))
        )
    return out


def _to_json(offsets: Table) -> dict[str, Any]:
    by_key: dict[str, dict[str, int]] = {}
    for group, table in offsets.items():
        for (topic, q), off in table.items():
            by_key.setdefault(f"{topic}@{group}", {})[str(q)] = off
    return {"version": FILE_VERSION, "offsets": by_key}


def _journal(path: Path) -> journal.Journal:
    return journal.Journal(path, JOURNAL_KEY, JOURNAL_WHAT)
