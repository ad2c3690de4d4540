"""The broker's half of delivering delayed and timer messages: what the schedule service calls.

- :meth:`ScheduleService.state`: the layout (delay table, wheel), each schedule queue's bounds
  and the progress last committed here.
- :meth:`ScheduleService.scan`: ConsumeQueue entries of several schedule queues (no bodies: the
  delivery time is in each entry), held like a long-polling pull when there are none.
- :meth:`ScheduleService.resolve`: the broker reads each entry's record and stores it in its
  real topic (DELIVER) or again in the slot its time now calls for (PARK), in one append; a
  tracing schedule service also asks for each message's trace context (:class:`TraceInfo`),
  read from the record the broker reads anyway.
- :meth:`ScheduleService.commit_progress`: per queue, the first unresolved offset, written to
  ``scheduleProgress.json`` (atomically, :mod:`.progress`) before the call returns, so a
  restarted schedule service resumes there. Everything before it was resolved; what came after
  may be resolved again after a crash (at-least-once).
- :meth:`ScheduleService.waiting`: what the metrics count of the messages still waiting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple

from apogee.codec import (
    PROP_ATTEMPTS,
    PROP_DELIVER_AT,
    PROP_DLQ_ORIGIN_TOPIC,
    PROP_DLQ_REASON,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_TIMER_DELIVER,
    PROP_TRACEPARENT,
    PROP_TRACESTATE,
    PROP_UNIQ_KEY,
)
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import (
    ApogeeError,
    CorruptRecordError,
    InvalidArgumentError,
    NotFoundError,
    OffsetDeletedError,
)
from apogee.common.topics import (
    SCHEDULE_DEAD_TOPIC,
    SCHEDULE_RECALLED_REASON,
    SCHEDULE_TOPIC,
    is_retry_topic,
)
from apogee.service.longpoll import HeldWaits
from apogee.store import Message, MessageStore, StoredMessage
from apogee_broker.core.holds import within_deadline
from apogee_broker.core.schedule.layout import (
    FIRST_SLOT_QUEUE,
    SCHEDULE_PROPERTIES,
    ScheduleLayout,
    to_scheduled,
)
from apogee_broker.core.schedule.progress import ScheduleProgress
from apogee_broker.core.schedule.recalls import Recalls
from apogee_broker.core.storage.writer import StoreWriter
from apogee_broker.core.topics import TopicManager

log = logging.getLogger(__name__)

DEFAULT_SCAN_ENTRIES: Final = 1024
MAX_SCAN_ENTRIES: Final = 8192
MAX_SCAN_QUEUES: Final = 4096
MAX_RESOLVE_ITEMS: Final = 4096


class Entry(NamedTuple):
    queue_id: int
    queue_offset: int
    phys_offset: int
    size: int
    deliver_at_ms: int


class ScanQueue(NamedTuple):
    queue_id: int
    offset: int
    due_before_ms: int = 0


class QueueScan(NamedTuple):
    queue_id: int
    next_offset: int
    skipped: int


class ScanResult(NamedTuple):
    entries: list[Entry]
    queues: list[QueueScan]
    now_ms: int


@dataclass(frozen=True, slots=True)
class QueueState:
    queue_id: int
    min_offset: int
    max_offset: int
    progress: int


@dataclass(frozen=True, slots=True)
class ScheduleState:
    layout: ScheduleLayout
    queues: list[QueueState]
    progress_updated_ms: int
    now_ms: int


class TraceInfo(NamedTuple):
    """What a tracing schedule service needs of a resolved message to join its trace: its
    trace context, when its schedule-topic copy was stored, its id and real topic."""

    traceparent: str
    tracestate: str
    store_timestamp_ms: int
    unique_id: str
    real_topic: str


class Outcome(NamedTuple):
    """RESOLVED (stored: ``topic``, ``queue_id``, ``queue_offset``), DROPPED or FAILED;
    ``trace`` when asked for and the message carries a trace context."""

    outcome: str
    reason: str = ""
    topic: str = ""
    queue_id: int = 0
    queue_offset: int = 0
    trace: TraceInfo | None = None


class ScheduleService:
    """Scan, resolve and progress over this broker's schedule topic; methods run on the loop."""

    def __init__(
        self,
        store: MessageStore,
        topics: TopicManager,
        writer: StoreWriter,
        layout: ScheduleLayout,
        data_dir: Path,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.topics = topics
        self.writer = writer
        self.layout = layout
        self.clock = clock
        self.progress = ScheduleProgress(data_dir, clock)
        #: messages recalled before they were due: dropped when they are
        self.recalls = Recalls(data_dir, clock)
        self._holds = HeldWaits()
        self._commit_lock = asyncio.Lock()
        #: a replica group's leader: each progress written goes into the log too
        #: (:mod:`apogee_broker.replication.state`); raises when it is not replicated
        self.replicate: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        #: a replica group leader's: a recall into the log (answered once replicated)
        self.replicate_recall: Callable[[str, int], Awaitable[None]] | None = None

    def load(self) -> None:
        self.progress.load()
        self.recalls.load()

    def stop(self) -> None:
        """Answer held scans now."""
        self._holds.stop()

    # -- state ----------------------------------------------------------------------------------

    def state(self) -> ScheduleState:
        """Every schedule queue that holds entries or progress."""
        maxes = {
            q: m for (t, q), m in self.store.queue_max_offsets().items() if t == SCHEDULE_TOPIC
        }
        queues: list[QueueState] = []
        for q in sorted(set(maxes) | set(self.progress.offsets)):
            queues.append(
                QueueState(
                    q,
                    self.store.min_offset(SCHEDULE_TOPIC, q) if q in maxes else 0,
                    maxes.get(q, 0),
                    self.progress.offsets.get(q, -1),
                )
            )
        return ScheduleState(self.layout, queues, self.progress.updated_ms, self.clock.time_ms())

    def waiting(self) -> dict[str, int]:
        """Messages not passed yet, by delay level (``"1"`` .. ``"N"``; ``"timer"``: the timer
        wheel's slots); levels with no queue are left out."""
        by_level: dict[str, int] = {}
        layout = self.layout
        for q in self.state().queues:
            start = max(q.progress, q.min_offset)
            if layout.is_level_queue(q.queue_id):
                level = str(q.queue_id + 1)
            elif layout.is_slot_queue(q.queue_id):
                level = "timer"
            else:
                continue
            by_level[level] = by_level.get(level, 0) + max(0, q.max_offset - start)
        return by_level

    # -- scan -----------------------------------------------------------------------------------

    async def scan(
        self,
        queues: Sequence[ScanQueue],
        max_entries: int,
        hold_ms: int,
        time_remaining_s: float | None = None,
    ) -> ScanResult:
        """Entries of ``queues``; when there are none, held up to ``hold_ms`` for one to land
        (``time_remaining_s``: how long until the call's deadline, as for a pull)."""
        self._check_scan(queues)
        limit = DEFAULT_SCAN_ENTRIES if max_entries == 0 else min(max_entries, MAX_SCAN_ENTRIES)
        result = self._scan_once(queues, limit)
        hold_s = within_deadline(hold_ms / 1000, time_remaining_s)  # before the caller gives up
        if result.entries or hold_s <= 0 or self._holds.stopping:
            return result

        # Nothing: wait for an entry at the next offset of any queue, then look once more.
        def arm(wake: Callable[[], None]) -> Callable[[], None]:
            watches = [
                self.store.watch(SCHEDULE_TOPIC, q.queue_id, self._watch_from(q, asked), wake)
                for q, asked in zip(result.queues, queues, strict=True)
            ]

            def disarm() -> None:
                for w in watches:
                    self.store.cancel_watch(w)

            return disarm

        if not await self._holds.hold(hold_s, arm):
            return result._replace(now_ms=self.clock.time_ms())
        moved = [
            ScanQueue(q.queue_id, s.next_offset, q.due_before_ms)
            for q, s in zip(queues, result.queues, strict=True)
        ]
        again = self._scan_once(moved, limit)
        skipped = {s.queue_id: s.skipped for s in result.queues}
        return again._replace(
            queues=[
                s._replace(skipped=s.skipped + skipped.get(s.queue_id, 0)) for s in again.queues
            ]
        )

    def _watch_from(self, q: QueueScan, asked: ScanQueue) -> int:
        """Where a held scan waits in a queue: its next offset, except in a queue read up to a
        time whose next entry exists but is not due yet - there only a new entry counts."""
        if not asked.due_before_ms:
            return q.next_offset
        cq = self.store.consume_queue(SCHEDULE_TOPIC, q.queue_id)
        return max(q.next_offset, cq.max_offset if cq is not None else 0)

    def stranded_levels(self) -> dict[int, int]:
        """Delay levels beyond the current table whose queue still holds undelivered entries
        (level -> entries), as after removing levels from ``delay_levels``."""
        out: dict[int, int] = {}
        for (topic, q), high in self.store.queue_max_offsets().items():
            if topic != SCHEDULE_TOPIC or not self.layout.levels <= q < FIRST_SLOT_QUEUE:
                continue
            done = max(self.progress.offsets.get(q, 0), self.store.min_offset(topic, q))
            if high > done:
                out[q + 1] = high - done
        return out

    def _check_scan(self, queues: Sequence[ScanQueue]) -> None:
        if not queues:
            raise InvalidArgumentError(field="queues", rule="must name at least one queue")
        if len(queues) > MAX_SCAN_QUEUES:
            raise InvalidArgumentError(
                field="queues", rule=f"{len(queues)} queues; at most {MAX_SCAN_QUEUES} per scan"
            )
        seen: set[int] = set()
        for i, q in enumerate(queues):
            self._check_queue(q.queue_id, f"queues[{i}].queue_id")
            if q.queue_id in seen:
                raise InvalidArgumentError(
                    field=f"queues[{i}].queue_id", rule=f"queue {q.queue_id} is named twice"
                )
            seen.add(q.queue_id)
            if q.offset < 0:
                raise InvalidArgumentError(
                    field=f"queues[{i}].offset", rule=f"must not be negative, got {q.offset}"
                )

    def _check_queue(self, queue_id: int, field: str) -> None:
        if not (self.layout.is_level_queue(queue_id) or self.layout.is_slot_queue(queue_id)):
            raise InvalidArgumentError(
                field=field,
                rule=f"{queue_id} is not a schedule queue of this broker: levels are queues 0 to "
                f"{self.layout.levels - 1}, timer slots {FIRST_SLOT_QUEUE} to "
                f"{FIRST_SLOT_QUEUE + self.layout.slots - 1}",
            )

    def _scan_once(self, queues: Sequence[ScanQueue], limit: int) -> ScanResult:
        entries: list[Entry] = []
        out: list[QueueScan] = []
        for q in queues:
            cq = self.store.consume_queue(SCHEDULE_TOPIC, q.queue_id)
            if cq is None:
                out.append(QueueScan(q.queue_id, q.offset, 0))
                continue
            offset, skipped = q.offset, 0
            low, high = cq.min_offset, cq.max_offset
            if offset < low:
                offset, skipped = low, low - offset
            elif offset > high:
                offset = high  # beyond the end (a reset store): continue from what exists
            room = limit - len(entries)
            if room > 0 and offset < high:
                due_before = q.due_before_ms
                for phys, size, due in cq.entries(offset, min(room, high - offset)):
                    if due_before and due >= due_before:
                        break
                    entries.append(Entry(q.queue_id, offset, phys, size, due))
                    offset += 1
            out.append(QueueScan(q.queue_id, offset, skipped))
        return ScanResult(entries, out, self.clock.time_ms())

    # -- resolve --------------------------------------------------------------------------------

    async def resolve(
        self, items: Sequence[tuple[Entry, bool]], trace_context: bool = False
    ) -> list[Outcome]:
        """``items``: (entry, deliver?) - deliver to the real topic, else park again;
        ``trace_context``: add each message's :class:`TraceInfo` to its outcome."""
        if not items:
            raise InvalidArgumentError(field="items", rule="must not be empty")
        if len(items) > MAX_RESOLVE_ITEMS:
            raise InvalidArgumentError(
                field="items", rule=f"{len(items)} items; at most {MAX_RESOLVE_ITEMS} per call"
            )
        outcomes: list[Outcome | None] = [None] * len(items)
        batch: list[Message] = []
        where: list[int] = []
        traces: dict[int, TraceInfo] = {}
        now = self.clock.time_ms()
        for i, (entry, deliver) in enumerate(items):
            self._check_queue(entry.queue_id, f"items[{i}].entry.queue_id")
            for name, value in (
                ("queue_offset", entry.queue_offset),
                ("phys_offset", entry.phys_offset),
            ):
                if value < 0:
                    raise InvalidArgumentError(
                        field=f"items[{i}].entry.{name}", rule=f"must not be negative, got {value}"
                    )
            try:
                stored = self._record(entry)
                if self.recalls and stored.unique_id in self.recalls:
                    raise _Dropped(SCHEDULE_RECALLED_REASON, lost=False, recalled=True)
                if trace_context and PROP_TRACEPARENT in stored.properties_raw:
                    traces[i] = _trace_info(stored)
                msg = self._delivered(stored) if deliver else self._parked(stored, now)
            except _Dropped as gone:
                if gone.lost:
                    log.error("schedule entry %s lost: %s", entry, gone)
                elif gone.recalled:
                    log.info("schedule entry %s dropped: %s", entry, gone)
                else:
                    log.warning("schedule entry %s dropped: %s", entry, gone)
                outcomes[i] = Outcome("DROPPED", str(gone))
                continue
            batch.append(msg)
            where.append(i)
        if batch:
            stored_outcomes = await self.writer.append_internal(batch)
            for i, m, o in zip(where, batch, stored_outcomes, strict=True):
                r = o.result
                if r is None:
                    outcomes[i] = Outcome("FAILED", str(o.error))
                else:
                    # stored; a flush timeout only leaves durability unconfirmed. A dead letter
                    # (its topic gone) says why in the reason.
                    dead = r.topic == SCHEDULE_DEAD_TOPIC
                    why = (m.properties or {}).get(PROP_DLQ_REASON, "") if dead else ""
                    outcomes[i] = Outcome("RESOLVED", why, r.topic, r.queue_id, r.queue_offset)
        for i, info in traces.items():
            resolved = outcomes[i]
            if resolved is not None:
                outcomes[i] = resolved._replace(trace=info)
        return [o if o is not None else Outcome("FAILED", "not processed") for o in outcomes]

    async def recall(self, topic: str, unique_id: str, due_ms: int) -> None:
        """Cancel the message ``unique_id`` of ``topic`` due at ``due_ms``:
        :class:`NotFoundError` when no such message waits here, or its time has come."""
        now = self.clock.time_ms()
        what = f"delay message {unique_id!r} of topic {topic!r}"
        if due_ms <= now:
            raise NotFoundError(
                what=what, detail=f"was due {(now - due_ms) / 1000:.1f} s ago: it is delivered"
            )
        found = self.store.all_by_unique_id(unique_id)
        if not any(
            m.topic == SCHEDULE_TOPIC and m.properties.get(PROP_REAL_TOPIC) == topic for m in found
        ):
            raise NotFoundError(what=what, detail="does not wait on this broker")
        self.recalls.add(unique_id, due_ms)
        if self.replicate_recall is not None:
            await self.replicate_recall(unique_id, due_ms)
        log.info("%s recalled (it was due in %.1f s)", what, (due_ms - now) / 1000)

    def _record(self, entry: Entry) -> StoredMessage:
        """The record of a schedule entry that its queue holds. An entry the queue does not
        hold (a stale or made-up request) names no message: dropped, not lost."""
        cq = self.store.consume_queue(SCHEDULE_TOPIC, entry.queue_id)
        high = cq.max_offset if cq is not None else 0
        if cq is None or entry.queue_offset >= high:
            raise _Dropped(
                f"no schedule entry {entry.queue_id}/{entry.queue_offset}: the queue holds "
                f"offsets below {high}",
                lost=False,
            )
        held = cq.entry(entry.queue_offset) if entry.queue_offset >= cq.min_offset else None
        if held is None:
            raise _Dropped("its entry was removed by retention before it was due")
        if held[0] != entry.phys_offset:
            raise _Dropped(
                f"no schedule entry {entry.queue_id}/{entry.queue_offset} at phys offset "
                f"{entry.phys_offset} (the queue's entry is at {held[0]})",
                lost=False,
            )
        try:
            stored = self.store.message_at(entry.phys_offset)
        except OffsetDeletedError:
            raise _Dropped("its record was removed by retention before it was due") from None
        except (CorruptRecordError, ApogeeError) as exc:
            raise _Dropped(f"its record cannot be read: {exc}") from None
        if (
            stored.topic != SCHEDULE_TOPIC
            or stored.queue_id != entry.queue_id
            or stored.queue_offset != entry.queue_offset
        ):
            raise _Dropped(
                f"no schedule entry {entry.queue_id}/{entry.queue_offset} at phys offset "
                f"{entry.phys_offset} (found {stored.topic}/{stored.queue_id}/"
                f"{stored.queue_offset})",
                lost=False,
            )
        return stored

    def _delivered(self, stored: StoredMessage) -> Message:
        props = stored.properties
        real = props.get(PROP_REAL_TOPIC, "")
        topic = self.topics.get(real)
        if topic is None:
            return self._dead(stored, real, f"its topic {real!r} no longer exists on this broker")
        if topic.system:
            return self._dead(stored, real, f"its topic {real!r} is a system topic")
        raw_qid = props.get(PROP_REAL_QID, "0")
        qid = int(raw_qid) if raw_qid.isdigit() else 0
        if qid >= topic.write_queues:
            qid %= topic.write_queues  # the topic lost queues meanwhile
        kept = {k: v for k, v in props.items() if k not in SCHEDULE_PROPERTIES}
        due = props.get(PROP_DELIVER_AT, "")
        if due.isdigit() and not is_retry_topic(topic.name):  # when it was due, for consumers
            kept[PROP_TIMER_DELIVER] = due
        return stored.copy_to(topic.name, qid, kept)

    def _dead(self, stored: StoredMessage, real: str, why: str) -> Message:
        """A due message that cannot go to its topic: kept, readable and redrivable, as a dead
        letter in :data:`~apogee.common.topics.SCHEDULE_DEAD_TOPIC` (never dropped in silence)."""
        dead = self.topics.ensure(SCHEDULE_DEAD_TOPIC).name
        log.error(
            "delayed message %s cannot be delivered (%s); kept in %s", stored.unique_id, why, dead
        )
        kept = {k: v for k, v in stored.properties.items() if k not in SCHEDULE_PROPERTIES}
        kept[PROP_DLQ_ORIGIN_TOPIC] = real
        kept[PROP_DLQ_REASON] = f"not delivered when due: {why}"
        kept[PROP_ATTEMPTS] = "0"
        return stored.copy_to(dead, 0, kept)

    def _parked(self, stored: StoredMessage, now: int) -> Message:
        props = stored.properties
        raw = props.get(PROP_DELIVER_AT, "")
        due = int(raw) if raw.isdigit() else now
        msg = stored.copy_to(SCHEDULE_TOPIC, 0, props)
        to_scheduled(msg, self.layout.slot_queue(due, now), due)
        return msg

    # -- progress -------------------------------------------------------------------------------

    async def commit_progress(self, offsets: Mapping[int, int]) -> None:
        for q, off in offsets.items():
            self._check_queue(q, f"offsets[{q}]")
            if off < 0:
                raise InvalidArgumentError(
                    field=f"offsets[{q}]", rule=f"must not be negative, got {off}"
                )
        async with self._commit_lock:
            content = await asyncio.to_thread(self.progress.commit, offsets)
            if self.replicate is not None:  # a replica group's leader: into the log too
                await self.replicate(content)


def _trace_info(stored: StoredMessage) -> TraceInfo:
    props = stored.properties
    return TraceInfo(
        props.get(PROP_TRACEPARENT, ""),
        props.get(PROP_TRACESTATE, ""),
        stored.store_timestamp,
        props.get(PROP_UNIQ_KEY, ""),
        props.get(PROP_REAL_TOPIC, ""),
    )


class _Dropped(Exception):
    """An entry with nothing left to deliver: its message is ``lost`` (removed by retention
    or unreadable), or the entry named no message (a stale or bad request)."""

    def __init__(self, why: str, lost: bool = True, recalled: bool = False) -> None:
        super().__init__(why)
        self.lost = lost
        self.recalled = recalled
