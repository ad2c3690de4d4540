"""Receive, ack, re-arm and dead-letter for POP consumers (the official RocketMQ 5 clients'
SimpleConsumer and PushConsumer), over the broker's store and its POP table.

Receive, for a group and a topic: every readable queue of the topic on this broker is looked at,
from a rotating start (a client names a queue only as a hint). First the messages whose
invisible time ran out come back, with their delivery attempt one higher, the same topic name
and message id; one whose attempt would pass the group's maximum goes to ``%DLQ%<group>``
instead (with the attempts it had, as send-back does). Then new messages from the queue's
cursor, filtered by the request's tag or SQL92 selection (what it passes over is consumed:
the cursor moves past it). Each message handed out is in flight for the requested invisible
time, with a receipt handle (:mod:`.handles`). When nothing is found, the receive is held until
a message arrives in one of the queues, one in flight becomes visible, or the hold runs out.

FIFO (``orderly``): a queue hands out nothing while one of its messages is in flight and not
yet visible; what became visible again comes first, in offset order; and one receive takes at
most one message of each message group (it stops at the first message of a group it already
took). Sends with one message group go to one queue, so each group's messages reach the
consumers one after the other, in order, and the next only after the previous was acked or
dead-lettered. An ack (or a dead-lettering) that frees a queue wakes the receives held on it.

A group's starting point is decided at its first contact (its first receive, or the Settings a
consumer sends when it starts), for every queue of the topic at once: a queue whose messages
are all still near the end of the CommitLog (within :data:`~apogee_broker.core.consume.reads.
INLINE_READ_WINDOW`, in memory: a young topic) starts at its first message, any other at its
end. A queue that appears later (the topic grew) starts at its first message.

The group's consumed offset (what ``group describe`` counts lag from) is the first offset not
yet acked of each queue; it is committed as it moves.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from apogee.codec import PROP_SHARDING_KEY, decode
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    NotFoundError,
    OffsetDeletedError,
    UnavailableError,
    UnsupportedError,
)
from apogee.common.filtering import Selection
from apogee.service.longpoll import HeldWaits
from apogee.store import GetStatus, MessageStore, StoredMessage
from apogee_broker.core.consume.offsets import ConsumerOffsets
from apogee_broker.core.consume.reads import INLINE_READ_WINDOW, read_records
from apogee_broker.core.consume.send_back import BackItem, SendBackService
from apogee_broker.core.pop.handles import Handle, decode_handle
from apogee_broker.core.pop.journal import KIND_CURSOR, KIND_DONE, KIND_POP, Entry
from apogee_broker.core.pop.table import Inflight, PopTable, QueuePop
from apogee_broker.core.topics import TopicManager

log = logging.getLogger(__name__)

#: Most messages one receive hands out.
MAX_BATCH: Final = 32
#: Most bytes one receive reads from a queue.
MAX_READ_BYTES: Final = 4 << 20


@dataclass(frozen=True, slots=True)
class Popped:
    """One message handed out: the record, its handle, its delivery attempt (1: first) and
    how long it stays invisible (ms)."""

    message: StoredMessage
    handle: str
    attempt: int
    invisible_ms: int


class PopService:
    """POP consumption at one broker; every method runs on the broker's event loop."""

    def __init__(
        self,
        store: MessageStore,
        topics: TopicManager,
        table: PopTable,
        send_back: SendBackService,
        offsets: ConsumerOffsets,
        *,
        broker_name: str,
        max_attempts: int = 17,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.topics = topics
        self.table = table
        self.send_back = send_back
        self.offsets = offsets
        self.broker_name = broker_name
        self.max_attempts = max_attempts
        self.clock = clock
        self._rng = rng or random.Random()
        self._holds = HeldWaits()
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        #: the wake-ups of the receives held per group and topic: a re-armed message may be
        #: due before what their hold waits for
        self._waiting: dict[tuple[str, str], set[Callable[[], None]]] = {}
        #: called with (group, topic, how many) as messages are handed out / expire
        self.on_expired: Callable[[str, str, int], None] | None = None
        self.on_dead_lettered: Callable[[str, str, int], None] | None = None

    def stop(self) -> None:
        """Answer every held receive now, and hold no more."""
        self._holds.stop()

    @property
    def held(self) -> int:
        return self._holds.held

    # -- first contact ------------------------------------------------------------------------

    def touch(self, group: str, topic: str) -> None:
        """Decide where ``group`` starts on every queue of ``topic`` here that it has not met
        (nothing when the topic is not on this broker)."""
        config = self.topics.get(topic)
        if config is None:
            return
        known = self.table.queues(group, topic) or {}
        entries: list[Entry] = []
        for q in range(config.read_queues):
            if q in known:
                continue
            entries.append(
                Entry(KIND_CURSOR, group, topic, q, self._start(group, topic, q, bool(known)))
            )
        self.table.write(entries)

    def _start(self, group: str, topic: str, q: int, met_before: bool) -> int:
        committed = self.offsets.committed(group, topic, q)
        if committed is not None:
            return committed
        low = self.store.min_offset(topic, q)
        if met_before:  # a queue the topic gained since: everything in it is new to the group
            return low
        behind = self.store.bytes_behind(topic, q, low)
        if low == 0 and (behind is None or behind <= INLINE_READ_WINDOW):
            return low
        return self.store.max_offset(topic, q)

    # -- receive ------------------------------------------------------------------------------

    async def receive(
        self,
        group: str,
        topic: str,
        sel: Selection,
        batch: int,
        invisible_ms: int,
        *,
        orderly: bool,
        hold_s: float,
        first_queue: int = -1,
    ) -> list[Popped]:
        """Up to ``batch`` messages of ``topic`` for ``group`` (held up to ``hold_s`` seconds
        when there are none yet)."""
        config = self.topics.require(topic)
        if not config.readable:
            raise UnsupportedError(
                what=f"topic {topic!r}", detail=f"is not readable on broker {self.broker_name}"
            )
        batch = max(1, min(batch, MAX_BATCH))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(hold_s, 0.0)
        while True:
            got = await self._pop(group, topic, sel, batch, invisible_ms, orderly, first_queue)
            remaining = deadline - loop.time()
            if got or remaining <= 0:
                return got
            if not await self._hold(group, topic, remaining, orderly):
                return await self._pop(group, topic, sel, batch, invisible_ms, orderly, first_queue)

    async def _pop(
        self,
        group: str,
        topic: str,
        sel: Selection,
        batch: int,
        invisible_ms: int,
        orderly: bool,
        first_queue: int,
    ) -> list[Popped]:
        lock = self._locks.setdefault((group, topic), asyncio.Lock())
        async with lock:
            self.touch(group, topic)
            queues = self.table.queues(group, topic) or {}
            config = self.topics.get(topic)
            readable = [q for q in sorted(queues) if config is not None and q < config.read_queues]
            if not readable:
                return []
            start = (
                first_queue
                if 0 <= first_queue < len(readable)
                else self._rng.randrange(len(readable))
            )
            order = readable[start:] + readable[:start]
            out: list[Popped] = []
            for q in order:
                if len(out) >= batch:
                    break
                await self._pop_queue(
                    group, topic, q, queues[q], sel, batch - len(out), invisible_ms, orderly, out
                )
            return out

    async def _pop_queue(
        self,
        group: str,
        topic: str,
        q: int,
        qp: QueuePop,
        sel: Selection,
        room: int,
        invisible_ms: int,
        orderly: bool,
        out: list[Popped],
    ) -> None:
        now = self.clock.time_ms()
        first_out = len(out)
        expired = qp.expired(now)
        if orderly and len(expired) < len(qp.inflight):
            # one of the queue's messages is still out: nothing more until it is settled (the
            # expired ones were taken off the due list: put them back)
            for e in expired:
                qp.arm(e)
            return
        entries: list[Entry] = []
        dead: list[Inflight] = []
        blocked = False
        for e in expired:
            if e.attempt >= self.max_attempts:
                dead.append(e)
                continue
            if room <= 0:
                qp.arm(e)  # no room in this answer: due again at once
                blocked = True
                continue
            try:
                msg = self.store.message_at(e.phys)
            except ApogeeError as exc:
                log.warning(
                    "POP %s/%d offset %d of group %s can no longer be read (%s): dropped",
                    topic,
                    q,
                    e.offset,
                    group,
                    exc,
                )
                entries.append(Entry(KIND_DONE, group, topic, q, e.offset))
                continue
            nonce = self._nonce()
            attempt = e.attempt + 1
            entries.append(
                Entry(
                    KIND_POP,
                    group,
                    topic,
                    q,
                    e.offset,
                    e.phys,
                    e.size,
                    attempt,
                    now + invisible_ms,
                    nonce,
                )
            )
            handle = Handle(self.broker_name, q, e.offset, nonce).encode()
            out.append(Popped(msg, handle, attempt, invisible_ms))
            room -= 1
        # written before any await: an ack with the old handle must find it re-armed
        self.table.write(entries)
        if expired and self.on_expired is not None:
            self.on_expired(group, topic, len(expired))
        if dead:
            done, failed = await self._dead_letter(
                group, topic, q, qp, dead, "maximum delivery attempts reached"
            )
            self.table.write(done)
            blocked = blocked or failed > 0
        if room > 0 and not (orderly and blocked):
            out_groups = frozenset(
                p.message.properties.get(PROP_SHARDING_KEY, "") for p in out[first_out:]
            )
            self.table.write(
                await self._read_new(
                    group, topic, q, qp, sel, room, invisible_ms, now, out, orderly, out_groups
                )
            )
        self._commit(group, topic, q, qp)

    async def _read_new(
        self,
        group: str,
        topic: str,
        q: int,
        qp: QueuePop,
        sel: Selection,
        room: int,
        invisible_ms: int,
        now: int,
        out: list[Popped],
        orderly: bool = False,
        in_flight_groups: frozenset[str] = frozenset(),
    ) -> list[Entry]:
        cursor = qp.cursor
        got = await read_records(
            self.store, INLINE_READ_WINDOW, topic, q, cursor, room, MAX_READ_BYTES, sel
        )
        if got.status is GetStatus.OFFSET_TOO_SMALL or got.status is GetStatus.OFFSET_OVERFLOW:
            # retention removed what the cursor pointed at, or the tail it pointed past was lost
            log.warning(
                "POP cursor of group %s on %s/%d moved from %d to %d (%s)",
                group,
                topic,
                q,
                cursor,
                got.next_offset,
                got.status.name,
            )
            return [Entry(KIND_CURSOR, group, topic, q, got.next_offset)]
        entries: list[Entry] = []
        records = got.records
        next_offset = got.next_offset
        groups: set[str] = set(in_flight_groups)
        pos = 0
        while pos < len(records):
            size = int.from_bytes(records[pos : pos + 4], "little")
            msg = decode(records, f"{topic}/{q}", True, pos, size)
            pos += size
            if orderly:
                # one message of a message group out at a time: the next waits for this one
                mg = msg.properties.get(PROP_SHARDING_KEY, "")
                if mg in groups:
                    next_offset = msg.queue_offset
                    break
                groups.add(mg)
            nonce = self._nonce()
            entries.append(
                Entry(
                    KIND_POP,
                    group,
                    topic,
                    q,
                    msg.queue_offset,
                    msg.phys_offset,
                    msg.size,
                    1,
                    now + invisible_ms,
                    nonce,
                )
            )
            out.append(
                Popped(
                    msg,
                    Handle(self.broker_name, q, msg.queue_offset, nonce).encode(),
                    1,
                    invisible_ms,
                )
            )
        if next_offset != cursor:
            entries.insert(0, Entry(KIND_CURSOR, group, topic, q, next_offset))
        return entries

    async def _hold(self, group: str, topic: str, timeout: float, orderly: bool = False) -> bool:
        """Wait for a message in one of the topic's queues past the group's cursor, or for one
        in flight to become visible; False when the time ran out or the broker stops."""
        queues = self.table.queues(group, topic) or {}
        now = self.clock.time_ms()
        soonest = min(
            (t for qp in queues.values() if (t := qp.next_visible_ms()) is not None),
            default=None,
        )
        if soonest is not None:
            timeout = min(timeout, max(0.0, (soonest - now) / 1000))
            if timeout <= 0:
                return True

        key = (group, topic)

        def arm(wake: Callable[[], None]) -> Callable[[], None]:
            # a FIFO queue with a message out waits for its ack or its time, not for arrivals
            watches = [
                self.store.watch(topic, q, qp.cursor, wake)
                for q, qp in queues.items()
                if not (orderly and qp.inflight)
            ]
            self._waiting.setdefault(key, set()).add(wake)

            def disarm() -> None:
                for w in watches:
                    self.store.cancel_watch(w)
                waiting = self._waiting.get(key)
                if waiting is not None:
                    waiting.discard(wake)
                    if not waiting:
                        del self._waiting[key]

            return disarm

        woken = await self._holds.hold(timeout, arm)
        return woken or (soonest is not None and not self._holds.stopping)

    # -- ack, re-arm, dead-letter ---------------------------------------------------------------

    def _find(
        self, group: str, topic: str, receipt: str, field: str
    ) -> tuple[Handle, QueuePop, Inflight]:
        h = decode_handle(receipt, field)
        if h.broker != self.broker_name:
            raise InvalidArgumentError(
                field=field,
                rule=f"was handed out by broker {h.broker}; send it to that broker, not to "
                f"{self.broker_name}",
            )
        queues = self.table.queues(group, topic) or {}
        qp = queues.get(h.queue_id)
        e = qp.inflight.get(h.offset) if qp is not None else None
        if qp is None or e is None or e.nonce != h.nonce:
            raise StaleHandleError(
                what=f"receipt handle of {topic}/{h.queue_id} offset {h.offset} for group {group}",
                detail="matches no message in flight: it was acked, or its invisible time ran "
                "out and it was handed out again with a new handle",
            )
        return h, qp, e

    def ack(self, group: str, topic: str, receipt: str, field: str = "receipt_handle") -> None:
        h, qp, _ = self._find(group, topic, receipt, field)
        self.table.write([Entry(KIND_DONE, group, topic, h.queue_id, h.offset)])
        self._commit(group, topic, h.queue_id, qp)
        if not qp.inflight:
            self._wake(group, topic)  # a FIFO queue this held back is free again

    def _wake(self, group: str, topic: str) -> None:
        """Held receives of ``group`` on ``topic`` look again (what they wait for changed)."""
        for wake in list(self._waiting.get((group, topic), ())):
            wake()

    def change_invisible(
        self, group: str, topic: str, receipt: str, invisible_ms: int, field: str = "receipt_handle"
    ) -> str:
        """Re-arm a message in flight: invisible for ``invisible_ms`` from now; returns its new
        handle (the old one no longer matches)."""
        h, _, e = self._find(group, topic, receipt, field)
        self._wake(group, topic)  # this one may now be due before their wait ends
        nonce = self._nonce()
        self._rearm(group, topic, h.queue_id, e, invisible_ms, nonce)
        return Handle(self.broker_name, h.queue_id, h.offset, nonce).encode()

    def extend(self, group: str, topic: str, receipt: str, invisible_ms: int) -> bool:
        """Keep a message in flight ``invisible_ms`` longer from now with the same handle (an
        auto-renewing consumer is still at work on it); False when the handle no longer
        matches (acked, or handed out again)."""
        try:
            h, _, e = self._find(group, topic, receipt, "receipt_handle")
        except ApogeeError:
            return False
        self._rearm(group, topic, h.queue_id, e, invisible_ms, e.nonce)
        return True

    def _rearm(
        self, group: str, topic: str, q: int, e: Inflight, invisible_ms: int, nonce: int
    ) -> None:
        """Write ``e`` in flight again: invisible ``invisible_ms`` from now, with ``nonce``."""
        visible_at = self.clock.time_ms() + invisible_ms
        self.table.write(
            [
                Entry(
                    KIND_POP,
                    group,
                    topic,
                    q,
                    e.offset,
                    e.phys,
                    e.size,
                    e.attempt,
                    visible_at,
                    nonce,
                )
            ]
        )

    async def forward_to_dlq(
        self,
        group: str,
        topic: str,
        receipt: str,
        attempts: int,
        reason: str,
        field: str = "receipt_handle",
    ) -> None:
        """Move a message in flight to ``%DLQ%<group>`` now (a FIFO consumer gave up on it)."""
        h, qp, e = self._find(group, topic, receipt, field)
        e.attempt = max(e.attempt, attempts)
        done, failed = await self._dead_letter(group, topic, h.queue_id, qp, [e], reason)
        self.table.write(done)
        self._commit(group, topic, h.queue_id, qp)
        if not qp.inflight:
            self._wake(group, topic)
        if failed:
            raise UnavailableError(
                what=f"dead-letter topic %DLQ%{group}",
                detail="the message could not be stored there; it stays in flight, try again",
            )

    async def _dead_letter(
        self, group: str, topic: str, q: int, qp: QueuePop, items: Sequence[Inflight], reason: str
    ) -> tuple[list[Entry], int]:
        """Copy ``items`` to ``%DLQ%<group>``; the DONE records of those stored, and how many
        failed (those stay in flight, due again at once)."""
        back = []
        for e in items:
            try:
                uid = self.store.message_at(e.phys).unique_id
            except ApogeeError:
                uid = ""
            back.append(BackItem(topic, q, e.offset, e.phys, uid, reason, True, e.attempt))
        outcomes = await self.send_back.send_back(group, back)
        done: list[Entry] = []
        stored = failed = 0
        for e, o in zip(items, outcomes, strict=True):
            if o.error is None or isinstance(o.error, (OffsetDeletedError, NotFoundError)):
                done.append(Entry(KIND_DONE, group, topic, q, e.offset))
                stored += o.error is None
            else:
                log.warning(
                    "dead-lettering %s/%d offset %d of group %s failed: %s",
                    topic,
                    q,
                    e.offset,
                    group,
                    o.error,
                )
                e.visible_at_ms = self.clock.time_ms()
                qp.arm(e)  # due again at once: the next receive tries again
                failed += 1
        if stored and self.on_dead_lettered is not None:
            self.on_dead_lettered(group, topic, stored)
        return done, failed

    def _commit(self, group: str, topic: str, q: int, qp: QueuePop) -> None:
        offset = qp.committed()
        if self.offsets.committed(group, topic, q) == offset:
            return
        try:
            self.offsets.commit(group, topic, q, offset, "pop")
        except ApogeeError as exc:  # a queue the topic no longer has: nothing to count
            log.debug("POP offset of %s on %s/%d not committed: %s", group, topic, q, exc)

    def _nonce(self) -> int:
        return self._rng.getrandbits(31)


class StaleHandleError(NotFoundError):
    """A receipt handle that matches no message in flight (the v2 protocol's
    ``INVALID_RECEIPT_HANDLE``)."""
