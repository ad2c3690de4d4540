"""A replica group's state as records in its CommitLog: one replication path for everything.

A lone broker keeps its topic configs in ``topics.json``, its consumer offsets in
``consumerOffset.json``, the schedule service's progress in ``scheduleProgress.json`` and the
transaction checker's in ``transactionProgress.json``. A replica group's leader writes each of
them as it always did, and also appends the same JSON, whole, as a record of the system topic
``APOGEE_SYS_STATE`` (queue 0, property ``APOGEE_STATE`` naming the kind): at every change of
the schedule service's or the checker's progress (their commit is answered once the record
is replicated); and for the topic table and the offsets, whose changes travel as changes
(below), now and then: at the start of a term (the table) or its first persistence (the
offsets), when the leader compacts its own journal into a snapshot, and at least every
:data:`SNAPSHOT_SHIP_S` while they change. The records
travel to the followers with the messages and are acknowledged like them, so a new leader holds
every snapshot the group acknowledged
(RocketMQ #4771 traces failover bugs to state with a replication path of its own; #1094 to
stale offsets taking over after one).

Followers turn the records back into the files (:class:`StateApplier`): after each copy from
the leader, the newest snapshot of each kind read since the last time is written to its file,
and ``state.applied`` remembers how far the records were read. A leader does the same at the
start of its term, before it loads the files. The files are caches: a replica whose log was cut
below ``state.applied`` reads the records again from the start, so a snapshot it holds no more
cannot outlive the cut.

Snapshots are whole, not deltas: the last one is the state, whatever came before (and whatever
retention removed). Offsets committed since the last snapshot are in the offset commits below;
a persistence of the offsets on the leader waits until the commits made before it are
replicated, and a handoff persists them first.

More kinds are changes, applied in order rather than newest-wins:

- **Topic changes.** Each change of the topic table is shipped as it is made, in a
  ``topic-changes`` record (the topics changed since the previous one, each with its entry in
  ``topics.json``'s shape, or null when deleted), in one ordered stream with the whole tables.
  A follower keeps ``topics.json`` and ``topics.journal`` as the leader does (the changes of
  each catch-up appended as one record, a whole table written as the snapshot), so creating a
  topic costs the same with 10 topics or 50,000, on the leader and on its followers.

- **Offset commits.** Each commit is shipped as it is made, in an ``offset-commits`` record
  (the commits since the previous one, newest per queue, in the file's shape), in one ordered
  stream with the offsets snapshots, so a snapshot never overtakes a commit made after it. A
  follower keeps the offsets as the leader does (:mod:`apogee_broker.core.consume.offsets`):
  the commits of each catch-up are appended to ``consumerOffset.journal`` as one record, and
  an offsets snapshot (with the commits read after it) is written as ``consumerOffset.json``,
  which starts the journal anew, as does a journal grown past its bound. So a catch-up costs
  what changed, not the number of groups. The first write after the applier starts, and after
  its log was cut, is a whole snapshot: it replaces what a former term as leader left. A commit is
  answered without waiting for its record: after a failure of the leader the group resumes
  from its commits but the last moment's (at-least-once), not from the last persistence.

- **The POP journal** (``pop/journal``: cursors, messages in flight, acks). Every change the
  leader appends to its journal is also shipped as a ``pop`` record holding the same journal
  records, several changes coalesced into one record while the previous one is being
  replicated; the whole live state goes as ``pop-whole`` at the start of each term and at each
  compaction of the journal. A follower appends ``pop`` records to its journal and replaces it
  with a ``pop-whole`` one (which bounds a follower's journal and drops what a former leader
  wrote that the group never had). A receive or an ack is answered without waiting for its
  record: after a failure of the leader, the last changes before it may be missing, so acked
  messages may come back and handed-out ones come back sooner (at-least-once, as the journal
  promises after a machine crash); cursors are never lost, so a topic is never consumed again
  from its start.
- **Recalls** of delay messages (``recalled.log``): each recall is a ``recall`` record holding
  its line, and the recall is answered once the record is replicated. A follower appends the
  lines to its ``recalled.log``.

Applying a change twice (a crash between writing the file and ``state.applied``) leaves the
same state: a journal replayed with a run of its records repeated ends where it ended, and
recalls are kept by message id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import Any, Final

from apogee.common.errors import ApogeeError, InternalError, NotLeaderError, UnavailableError
from apogee.common.files import append_durably
from apogee.common.topics import STATE_TOPIC
from apogee.store import GetStatus, Message, MessageStore
from apogee.store.metadata import read_json, write_json_atomic
from apogee_broker.core.consume.offsets import FILE_NAME as OFFSETS_FILE
from apogee_broker.core.consume.offsets import FILE_VERSION as OFFSETS_VERSION
from apogee_broker.core.consume.offsets import JOURNAL_KEY as OFFSETS_KEY
from apogee_broker.core.consume.offsets import JOURNAL_NAME as OFFSETS_JOURNAL
from apogee_broker.core.consume.offsets import JOURNAL_WHAT as OFFSETS_WHAT
from apogee_broker.core.consume.offsets import apply_changes as apply_offset_changes
from apogee_broker.core.consume.offsets import read_offsets
from apogee_broker.core.journal import ApplyChanges, Changes, JournaledFile
from apogee_broker.core.pop.journal import FRAME, Journal
from apogee_broker.core.pop.table import PopTable
from apogee_broker.core.schedule.progress import PROGRESS_FILE as SCHEDULE_FILE
from apogee_broker.core.schedule.recalls import FILE_NAME as RECALLS_FILE
from apogee_broker.core.storage.writer import StoreWriter
from apogee_broker.core.topics import FILE_NAME as TOPICS_FILE
from apogee_broker.core.topics import FILE_VERSION as TOPICS_VERSION
from apogee_broker.core.topics import JOURNAL_KEY as TOPICS_KEY
from apogee_broker.core.topics import JOURNAL_NAME as TOPICS_JOURNAL
from apogee_broker.core.topics import JOURNAL_WHAT as TOPICS_WHAT
from apogee_broker.core.topics import apply_changes as apply_topic_changes
from apogee_broker.core.topics import read_topics
from apogee_broker.core.txn.state import PROGRESS_FILE as TRANSACTIONS_FILE

log = logging.getLogger(__name__)

#: The property naming what a state record holds.
PROP_STATE_KIND: Final = "APOGEE_STATE"
TOPICS: Final = "topics"
OFFSETS: Final = "offsets"
SCHEDULE: Final = "schedule"
TRANSACTIONS: Final = "transactions"
#: Each kind of state and the file it is the content of.
FILES: Final = {
    TOPICS: TOPICS_FILE,
    OFFSETS: OFFSETS_FILE,
    SCHEDULE: SCHEDULE_FILE,
    TRANSACTIONS: TRANSACTIONS_FILE,
}
OFFSET_COMMITS: Final = "offset-commits"
TOPIC_CHANGES: Final = "topic-changes"
#: most bytes of one state record of the topic table or the offsets (and at most half the
#: broker's max_message_size): a larger table goes as a part of it and changes holding the rest
STATE_RECORD_BYTES: Final = 1 << 20
#: a leader replicates a whole snapshot of the offsets and of the topic table at least this
#: often (seconds) while they change, besides when it compacts its own files
SNAPSHOT_SHIP_S: Final = 600.0
POP: Final = "pop"
POP_WHOLE: Final = "pop-whole"
RECALL: Final = "recall"
APPLIED_FILE: Final = "state.applied"
POP_DIR: Final = "pop"
_READ_BATCH: Final = 64
#: Most journal bytes in one ``pop`` record (whole journal records: one may be larger).
POP_RECORD_BYTES: Final = 1 << 20
#: Most POP journal bytes waiting to be appended; past it, the whole state replaces them.
POP_BACKLOG_BYTES: Final = 8 << 20
#: A follower's POP journal past this size is compacted (a leader's compacts itself).
POP_COMPACT_BYTES: Final = 16 << 20


def split_records(blob: bytes, most: int) -> list[bytes]:
    """``blob`` (whole journal records) cut into parts of about ``most`` bytes, each of whole
    records."""
    parts: list[bytes] = []
    start = pos = 0
    while pos < len(blob):
        (length, _) = FRAME.unpack_from(blob, pos)
        end = pos + FRAME.size + length
        if end - start > most and pos > start:
            parts.append(blob[start:pos])
            start = pos
        pos = end
    if start < len(blob):
        parts.append(blob[start:])
    return parts


class StateLog:
    """The leader's side: appends snapshots (through the broker's writer, so they wait for the
    in-sync set like any message)."""

    def __init__(self, writer: StoreWriter) -> None:
        self.writer = writer
        #: most bytes of one record of the topic table or the offsets (see _whole_records)
        self.record_bytes = min(STATE_RECORD_BYTES, writer.store.cfg.max_message_size // 2)
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        #: POP journal records not appended yet: (records, whole)
        self._pop: list[tuple[bytes, bool]] = []
        self._pop_task: asyncio.Task[None] | None = None
        self._pop_bytes = 0
        #: offset commits and snapshots not appended yet, in order: a dict of commits
        #: ('<topic>@<group>' -> queue id -> offset), or a snapshot's body (None: no
        #: snapshot, a waiter for what came before) and its waiter
        self._offsets: list[_OffsetsItem] = []
        self._offsets_task: asyncio.Task[None] | None = None
        self._pop_table: PopTable | None = None
        #: topic changes not appended yet, in order: a dict of changes (topic -> its entry,
        #: None when deleted), or _WHOLE: the whole table, as it is when appended
        self._topics: list[dict[str, Any] | object] = []
        self._topics_task: asyncio.Task[None] | None = None
        self._topics_shipped_at: float | None = None
        #: the topic table's whole content (set by the app: ``TopicManager.snapshot``)
        self.topics_snapshot: Callable[[], dict[str, Any]] | None = None

    async def write(self, kind: str, snapshot: dict[str, Any]) -> None:
        """Append ``snapshot`` of ``kind``; raises the writer's error when it is not stored
        and acknowledged."""
        body = json.dumps(snapshot, sort_keys=True, separators=(",", ":")).encode()
        await self._append([(kind, body)])

    async def _append(self, records: list[tuple[str, bytes]]) -> None:
        msgs = [
            Message(STATE_TOPIC, body, queue_id=0, properties={PROP_STATE_KIND: kind})
            for kind, body in records
        ]
        async with self._lock:
            outcomes = await self.writer.append_internal(msgs)
        for outcome in outcomes:
            if outcome.error is not None:
                raise outcome.error

    # -- consumer offsets: commits and snapshots, in one ordered stream --------------------------

    def commit_offsets(self, group: str, items: list[tuple[str, int, int]]) -> None:
        """Commits just made (on the event loop): shipped soon, coalesced per queue."""
        last = self._offsets[-1] if self._offsets else None
        if not isinstance(last, dict):
            last = {}
            self._offsets.append(last)
        for topic, queue_id, offset in items:
            last.setdefault(f"{topic}@{group}", {})[str(queue_id)] = offset
        self._start_offsets()

    async def write_offsets(self, snapshot: dict[str, Any] | None) -> None:
        """Append an offsets snapshot after every commit shipped before it (None: no snapshot,
        only wait for those commits); raises the writer's error when they are not stored and
        acknowledged."""
        records = (
            []
            if snapshot is None
            else _whole_records(OFFSETS, OFFSET_COMMITS, snapshot, "offsets", self.record_bytes)
        )
        done: asyncio.Future[None] = self._loop.create_future()
        self._offsets.append((records, done))
        self._start_offsets()
        await done

    def _start_offsets(self) -> None:
        if self._offsets_task is None:
            self._offsets_task = self._spawn(self._flush_offsets())

    async def _flush_offsets(self) -> None:
        attempt = 0
        batch: list[_OffsetsItem] = []
        try:
            while self._offsets:
                batch, self._offsets = self._offsets, []
                records: list[tuple[str, bytes]] = []
                for item in batch:
                    if isinstance(item, dict):
                        records += _change_records(OFFSET_COMMITS, item, self.record_bytes)
                    else:
                        records += item[0]
                try:
                    if records:
                        await self._append(records)
                except ApogeeError as exc:
                    _settle(batch, exc)
                    if isinstance(exc, NotLeaderError):
                        self._offsets.clear()
                        return  # the term ended: the next leader persists its own
                    if attempt % 25 == 0:
                        log.warning("offset commits not replicated (attempt %d): %s", attempt, exc)
                    attempt += 1
                    self._offsets[:0] = [item for item in batch if isinstance(item, dict)]
                    batch = []
                    await asyncio.sleep(0.2)  # a pause before the next attempt
                    continue
                _settle(batch, None)
                batch = []
                attempt = 0
        finally:
            self._offsets_task = None
            # stopped (the term ends) with snapshots not written: their persists fail
            ended = UnavailableError(what="the replica group's state log", detail="its term ended")
            _settle(batch, ended)
            _settle(self._offsets, ended)

    # -- the topic table: changes and whole snapshots, in one ordered stream --------------------

    def topic_changed(self, name: str, entry: dict[str, Any] | None, compacted: bool) -> None:
        """Topic ``name`` changed (``TopicManager.on_change``, from any thread): shipped soon
        as a change, coalesced with the others waiting; as the whole table when the leader
        wrote its own snapshot for it (``compacted``) or the last one shipped is older than
        :data:`SNAPSHOT_SHIP_S`."""
        if not self._on_loop():
            self._loop.call_soon_threadsafe(self.topic_changed, name, entry, compacted)
            return
        shipped = self._topics_shipped_at
        if compacted or shipped is None or time.monotonic() - shipped > SNAPSHOT_SHIP_S:
            self.topics_whole()
            return
        last = self._topics[-1] if self._topics else None
        if not isinstance(last, dict):
            last = {}
            self._topics.append(last)
        last[name] = entry
        if self._topics_task is None:
            self._topics_task = self._spawn(self._flush_topics())

    def topics_whole(self) -> None:
        """Ship the whole topic table soon (it replaces the changes waiting before it)."""
        if not self._on_loop():
            self._loop.call_soon_threadsafe(self.topics_whole)
            return
        self._topics = [_WHOLE]
        if self._topics_task is None:
            self._topics_task = self._spawn(self._flush_topics())

    async def _flush_topics(self) -> None:
        attempt = 0
        try:
            while self._topics:
                batch, self._topics = self._topics, []
                records = [r for item in batch for r in self._topics_records(item)]
                try:
                    await self._append(records)
                except NotLeaderError:
                    self._topics.clear()
                    return  # the term ended: the next leader ships its own table
                except ApogeeError as exc:
                    if attempt % 25 == 0:
                        log.warning("topic changes not replicated (attempt %d): %s", attempt, exc)
                    attempt += 1
                    if _WHOLE not in self._topics:  # else a whole table since replaces them
                        self._topics[:0] = batch
                    await asyncio.sleep(0.2)  # a pause before the next attempt
                    continue
                if _WHOLE in batch:
                    self._topics_shipped_at = time.monotonic()
                attempt = 0
        finally:
            self._topics_task = None

    def _topics_records(self, item: dict[str, Any] | object) -> list[tuple[str, bytes]]:
        if isinstance(item, dict):
            return _change_records(TOPIC_CHANGES, item, self.record_bytes)
        if self.topics_snapshot is None:
            raise InternalError(detail="the state log has no topic table to ship")
        table = self.topics_snapshot()
        return _whole_records(TOPICS, TOPIC_CHANGES, table, "topics", self.record_bytes)

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def recall(self, unique_id: str, due_ms: int) -> None:
        """Append a recall (its ``recalled.log`` line); raises when it is not replicated."""
        await self._append([(RECALL, f"{due_ms} {unique_id}\n".encode())])

    def attach_pop(self, table: PopTable) -> None:
        """Ship ``table``'s changes from now on, starting with its whole state."""
        self._pop_table = table
        table.ship = self.ship_pop
        self.ship_pop(table.whole(), True)

    def ship_pop(self, records: bytes, whole: bool) -> None:
        """POP journal records to append (on the event loop); ``whole``: they are the whole
        state, and what waits before them is not needed any more."""
        if whole:
            self._pop = [(records, True)]
            self._pop_bytes = len(records)
        elif records:
            self._pop.append((records, False))
            self._pop_bytes += len(records)
            if self._pop_bytes > POP_BACKLOG_BYTES and self._pop_table is not None:
                # the group has not taken them for a while: the whole state replaces them
                records = self._pop_table.whole()
                self._pop, self._pop_bytes = [(records, True)], len(records)
        if self._pop_task is None and self._pop:
            self._pop_task = self._spawn(self._flush_pop())

    async def _flush_pop(self) -> None:
        attempt = 0
        try:
            while self._pop:
                batch, self._pop, self._pop_bytes = self._pop, [], 0
                whole = batch[0][1]
                parts = split_records(b"".join(r for r, _ in batch), POP_RECORD_BYTES)
                kinds = [POP_WHOLE if whole and i == 0 else POP for i in range(len(parts))]
                try:
                    await self._append(list(zip(kinds, parts, strict=True)))
                except NotLeaderError:
                    self._pop.clear()
                    return  # the term ended: the next leader ships its own whole state
                except ApogeeError as exc:
                    if attempt % 25 == 0:
                        log.warning(
                            "POP journal records not replicated (attempt %d): %s", attempt, exc
                        )
                    attempt += 1
                    if not any(w for _, w in self._pop):  # a whole state since replaces it
                        self._pop[:0] = batch
                        self._pop_bytes += sum(len(r) for r, _ in batch)
                    await asyncio.sleep(0.2)  # a pause before the next attempt
                    continue
                attempt = 0
        finally:
            self._pop_task = None

    async def close(self) -> None:
        """Stop appending (the term ends); what is pending is written by the next term's
        first snapshot."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._offsets.clear()
        self._topics.clear()
        self._pop.clear()
        if self._pop_table is not None:
            self._pop_table.ship = None

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until the pending snapshots are appended."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


class StateApplier:
    """Brings ``topics.json`` and ``consumerOffset.json`` of ``data_dir`` up to the state
    records of ``store`` (see the module docstring). Runs on a worker thread."""

    def __init__(self, store: MessageStore, data_dir: Path) -> None:
        self.store = store
        self.dir = Path(data_dir)
        self._applied: int | None = None
        #: the offsets files, written as the leader writes its own: commits appended to the
        #: journal, a snapshot now and then. The first write of each life is a snapshot.
        self._offset_files = JournaledFile(
            self.dir / OFFSETS_FILE, self.dir / OFFSETS_JOURNAL, OFFSETS_KEY, OFFSETS_WHAT
        )
        self._topic_files = JournaledFile(
            self.dir / TOPICS_FILE, self.dir / TOPICS_JOURNAL, TOPICS_KEY, TOPICS_WHAT
        )

    def _read_applied(self) -> int:
        if self._applied is None:
            try:
                data = read_json(self.dir / APPLIED_FILE)
                self._applied = int(data["offset"]) if isinstance(data, dict) else 0
            except (ApogeeError, KeyError, TypeError, ValueError) as exc:
                log.warning("%s is unreadable (%s): reading every state record", APPLIED_FILE, exc)
                self._applied = 0
        return self._applied

    def behind(self) -> bool:
        """Whether state records arrived since the last :meth:`catch_up` (cheap: one look at
        the state queue's end, fit for the event loop)."""
        return self._applied is None or self.store.max_offset(STATE_TOPIC, 0) != self._applied

    def catch_up(self) -> int:
        """Apply the records written since the last call; returns how many files it wrote."""
        applied = self._read_applied()
        end = self.store.max_offset(STATE_TOPIC, 0)
        if end == applied:
            return 0
        if end < applied:  # the log was cut under the files: read it all again
            applied = 0
            self._offset_files.compact_next = True
            self._topic_files.compact_next = True
        newest: dict[str, bytes] = {}
        offsets: dict[str, Any] | None = None  # the newest offsets snapshot read
        commits: dict[str, dict[str, Any]] = {}  # the commits read after it
        topics: dict[str, Any] | None = None  # the newest topic table read
        topic_changes: dict[str, Any] = {}  # the topic changes read after it
        pop: list[bytes] = []
        pop_whole = False
        recalls: list[bytes] = []
        offset = applied
        while offset < end:
            got = self.store.get(STATE_TOPIC, 0, offset, _READ_BATCH)
            if got.status is GetStatus.OFFSET_TOO_SMALL:
                offset = got.next_offset  # removed by retention: newer snapshots follow
                continue
            if got.status is not GetStatus.FOUND:
                break
            for m in got.messages:
                kind = (m.properties or {}).get(PROP_STATE_KIND, "")
                if kind == OFFSETS:
                    offsets, commits = _json(m.body, kind), {}
                elif kind == OFFSET_COMMITS:
                    for key, queues in _json(m.body, kind).items():
                        commits.setdefault(key, {}).update(queues)
                elif kind == TOPICS:
                    topics, topic_changes = _json(m.body, kind), {}
                elif kind == TOPIC_CHANGES:
                    topic_changes.update(_json(m.body, kind))
                elif kind in FILES:
                    newest[kind] = m.body
                elif kind == POP_WHOLE:
                    pop, pop_whole = [m.body], True
                elif kind == POP:
                    pop.append(m.body)
                elif kind == RECALL:
                    recalls.append(m.body)
            offset = got.next_offset
        for kind, body in newest.items():
            write_json_atomic(self.dir / FILES[kind], _json(body, kind))
        if offsets is not None or commits:
            _write_state(
                self._offset_files,
                offsets,
                commits,
                partial(_current, read_offsets, self.dir, "offsets", OFFSETS_VERSION),
                partial(_merge, OFFSETS_KEY, apply_offset_changes),
            )
        if topics is not None or topic_changes:
            _write_state(
                self._topic_files,
                topics,
                topic_changes,
                partial(_current, read_topics, self.dir, "topics", TOPICS_VERSION),
                partial(_merge, TOPICS_KEY, apply_topic_changes),
            )
        if pop:
            self._apply_pop(b"".join(pop), pop_whole)
        if recalls:
            append_durably(self.dir / RECALLS_FILE, b"".join(recalls))
        write_json_atomic(self.dir / APPLIED_FILE, {"offset": offset})
        self._applied = offset
        written = sorted(newest)
        written += [OFFSETS] * (offsets is not None or bool(commits))
        written += [TOPICS] * (topics is not None or bool(topic_changes))
        written += ["POP journal"] * bool(pop) + ["recalls"] * bool(recalls)
        if written:
            log.info("state records read to offset %d: %s written", offset, ", ".join(written))
        return len(written)

    def _apply_pop(self, records: bytes, whole: bool) -> None:
        journal = Journal(self.dir / POP_DIR)
        try:
            if whole:
                journal.replace(records)
                return
            journal.open()
            journal.append_bytes(records)
            journal.sync()
            big = journal.size > POP_COMPACT_BYTES
        finally:
            journal.close()
        if big:  # as a leader's compaction: the live state only
            table = PopTable(self.dir / POP_DIR)
            table.load()
            try:
                table.compact()
            finally:
                table.close()


#: a place in the topic stream for the whole table
_WHOLE: Final = object()

_OffsetsItem = dict[str, dict[str, int]] | tuple[list[tuple[str, bytes]], asyncio.Future[None]]


def _whole_records(
    kind: str, changes_kind: str, content: dict[str, Any], key: str, bound: int
) -> list[tuple[str, bytes]]:
    """A whole table (``content``, its entries under ``key``) as records of at most ``bound``
    bytes: one ``kind`` record, or, when it is larger (the broker refuses a message above
    ``max_message_size``), a ``kind`` record holding the first part of the entries followed by
    ``changes_kind`` records holding the rest, which followers apply over it in order."""
    body = _compact_json(content)
    table = content.get(key)
    if len(body) <= bound or not isinstance(table, dict):
        return [(kind, body)]
    first, *rest = _chunks(table, bound)
    records = [(kind, _compact_json({**content, key: first}))]
    return records + [(changes_kind, _compact_json(part)) for part in rest]


def _change_records(kind: str, changes: dict[str, Any], bound: int) -> list[tuple[str, bytes]]:
    """Changes (entry by entry) as ``kind`` records of at most ``bound`` bytes."""
    body = _compact_json(changes)
    if len(body) <= bound:
        return [(kind, body)]
    return [(kind, _compact_json(part)) for part in _chunks(changes, bound)]


def _chunks(table: dict[str, Any], bound: int) -> list[dict[str, Any]]:
    """``table``'s entries in parts whose JSON takes at most about ``bound`` bytes (an entry
    larger than that alone in its part)."""
    parts: list[dict[str, Any]] = [{}]
    size = 2
    for name, entry in table.items():
        n = len(_compact_json({name: entry}))
        if size + n > bound and parts[-1]:
            parts.append({})
            size = 2
        parts[-1][name] = entry
        size += n
    return parts


def _write_state(
    files: JournaledFile,
    whole: dict[str, Any] | None,
    changes: dict[str, Any],
    current: Callable[[], dict[str, Any]],
    merge: Callable[[dict[str, Any], dict[str, Any]], None],
) -> None:
    """Write the newest ``whole`` snapshot of a journaled state read (None: none) with the
    ``changes`` read after it: the changes alone as a journal record when there was no
    snapshot and the journal has room, else a whole snapshot (``current()`` with the changes
    merged in, when there was none)."""
    if whole is None:
        record = files.record(changes)
        if record is not None:
            files.append(record)
            return
        whole = current()
    if changes:
        merge(whole, changes)
    whole.pop("seq", None)
    files.write_snapshot(whole)


def _merge(key: str, apply: ApplyChanges, content: dict[str, Any], changes: Changes) -> None:
    """Apply ``changes`` to the table under ``key`` of a whole snapshot's ``content``, as the
    state's own loader applies a journal record (``apply``)."""
    table = content.setdefault(key, {})
    if not isinstance(table, dict):
        raise InternalError(detail=f"a {key} state record has no {key!r} object")
    apply(table, changes)


def _settle(items: list[_OffsetsItem], error: BaseException | None) -> None:
    """Answer the snapshots' waiters among ``items``."""
    for item in items:
        if isinstance(item, dict) or item[1].done():
            continue
        if error is None:
            item[1].set_result(None)
        else:
            item[1].set_exception(error)


def _current(
    read: Callable[[Path], dict[str, Any] | None], data_dir: Path, key: str, version: int
) -> dict[str, Any]:
    """A journaled state's file with its journal applied (``read``), or an empty table under
    ``key`` when there is none or it is unreadable: a whole snapshot follows (the offsets at a
    term's first persistence, the topic table at its start)."""
    try:
        data = read(data_dir)
    except ApogeeError as exc:
        log.warning(
            "the %s in %s are unreadable (%s): changes go on an empty table", key, data_dir, exc
        )
        data = None
    if isinstance(data, dict) and isinstance(data.get(key), dict):
        return data
    return {"version": version, key: {}}


def _compact_json(content: object) -> bytes:
    return json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


def _json(body: bytes, kind: str) -> dict[str, Any]:
    try:
        content = json.loads(body)
    except ValueError as exc:
        raise InternalError(detail=f"a {kind} state record is not JSON: {exc}") from exc
    if not isinstance(content, dict):
        raise InternalError(detail=f"a {kind} state record is not a JSON object")
    return content
