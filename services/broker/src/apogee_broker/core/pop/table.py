"""The POP state of one broker: per group, topic and queue, a cursor (the next offset to hand
out) and the messages in flight (handed out, not yet acked), each with its delivery attempt,
the time it becomes visible again and the nonce of its current receipt handle.

Every change goes through :class:`PopTable`, which appends it to the journal (:mod:`.journal`)
before it changes memory, and the table is rebuilt from the journal at start-up. What the
journal says is in flight when the broker starts stays in flight until its time: a message
handed out before a ``kill -9`` comes back when its invisible time runs out, and an acked one
never does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from apogee_broker.core.pop.journal import (
    KIND_CURSOR,
    KIND_DONE,
    KIND_POP,
    Entry,
    Journal,
    Replayed,
    encode,
    read,
)


@dataclass(slots=True)
class Inflight:
    """A message handed out and not acked: where it is, which delivery this is (1: the first),
    when it is visible again (ms) and its handle's nonce."""

    offset: int
    phys: int
    size: int
    attempt: int
    visible_at_ms: int
    nonce: int


@dataclass(slots=True)
class QueuePop:
    """One queue of one group and topic."""

    cursor: int
    inflight: dict[int, Inflight] = field(default_factory=dict)
    #: (visible_at_ms, offset, nonce) of every arming; those that no longer match the message
    #: in flight (acked, re-armed, extended) are skipped when popped
    _due: list[tuple[int, int, int]] = field(default_factory=list)

    def arm(self, e: Inflight) -> None:
        self.inflight[e.offset] = e
        heapq.heappush(self._due, (e.visible_at_ms, e.offset, e.nonce))

    def expired(self, now_ms: int) -> list[Inflight]:
        """The messages in flight whose time ran out, by offset (they stay in flight: the
        caller hands them out again or dead-letters them)."""
        out: list[Inflight] = []
        due = self._due
        while due and due[0][0] <= now_ms:
            visible_at, offset, nonce = heapq.heappop(due)
            e = self.inflight.get(offset)
            if e is not None and e.nonce == nonce and e.visible_at_ms == visible_at:
                out.append(e)
        out.sort(key=lambda e: e.offset)
        return out

    def next_visible_ms(self) -> int | None:
        """When the next message in flight becomes visible (None: none in flight)."""
        due = self._due
        while due:
            visible_at, offset, nonce = due[0]
            e = self.inflight.get(offset)
            if e is not None and e.nonce == nonce and e.visible_at_ms == visible_at:
                return visible_at
            heapq.heappop(due)
        return None

    def committed(self) -> int:
        """The offset before which everything was acked (or filtered out): the group's
        consumed offset, as lag counts it."""
        return min(self.inflight, default=self.cursor)


Key = tuple[str, str]  # (group, topic)


class PopTable:
    """The POP state, persisted in the journal under ``directory``."""

    def __init__(self, directory: Path, compact_bytes: int = 16 << 20) -> None:
        self.journal = Journal(directory, compact_bytes)
        self._state: dict[Key, dict[int, QueuePop]] = {}
        #: a replica group leader's: called with every change as journal records, and with
        #: ``whole`` True when they are the whole state (a compaction), so that followers
        #: keep the same journal (:mod:`apogee_broker.replication.state`)
        self.ship: Callable[[bytes, bool], None] | None = None

    def load(self) -> Replayed:
        entries, report = read(self.journal.path)
        for e in entries:
            self._apply(e)
        self.journal.open()
        return report

    def close(self) -> None:
        self.journal.close()

    # -- reading ------------------------------------------------------------------------------

    def queues(self, group: str, topic: str) -> dict[int, QueuePop] | None:
        return self._state.get((group, topic))

    def groups(self) -> set[str]:
        return {g for g, _ in self._state}

    def topics_of(self, group: str) -> list[str]:
        return sorted(t for g, t in self._state if g == group)

    def keys(self) -> list[Key]:
        return list(self._state)

    def inflight_count(self, group: str, topic: str | None = None) -> int:
        return sum(
            len(qp.inflight)
            for (g, t), queues in self._state.items()
            if g == group and (topic is None or t == topic)
            for qp in queues.values()
        )

    # -- changing (journal first, then memory) -------------------------------------------------

    def write(self, entries: list[Entry]) -> None:
        """Append ``entries`` and apply them."""
        if not entries:
            return
        blob = self.journal.append(entries)
        for e in entries:
            self._apply(e)
        if self.ship is not None:
            self.ship(blob, False)
        if self.journal.wants_compaction(self._live_count()):
            self.compact()

    def drop_group(self, group: str) -> None:
        """Forget a group's state (it was deleted): compacts the journal without it."""
        for key in [k for k in self._state if k[0] == group]:
            del self._state[key]
        self.compact()

    def compact(self) -> None:
        """Rewrite the journal as the live state (and ship it whole)."""
        blob = self.journal.compact(self._live())
        if self.ship is not None:
            self.ship(blob, True)

    def whole(self) -> bytes:
        """The live state as journal records (what a compaction would write)."""
        return b"".join(encode(e) for e in self._live())

    def _apply(self, e: Entry) -> None:
        queues = self._state.setdefault((e.group, e.topic), {})
        qp = queues.get(e.queue_id)
        if e.kind == KIND_CURSOR:
            if qp is None:
                queues[e.queue_id] = QueuePop(e.offset)
            else:
                qp.cursor = e.offset
            return
        if qp is None:
            qp = queues[e.queue_id] = QueuePop(e.offset + 1 if e.kind == KIND_POP else 0)
        if e.kind == KIND_POP:
            qp.arm(Inflight(e.offset, e.phys, e.size, e.attempt, e.visible_at_ms, e.nonce))
        elif e.kind == KIND_DONE:
            qp.inflight.pop(e.offset, None)

    def _live_count(self) -> int:
        return sum(1 + len(qp.inflight) for qs in self._state.values() for qp in qs.values())

    def _live(self) -> Iterator[Entry]:
        for (group, topic), queues in self._state.items():
            for q, qp in queues.items():
                yield Entry(KIND_CURSOR, group, topic, q, qp.cursor)
                for i in qp.inflight.values():
                    yield Entry(
                        KIND_POP,
                        group,
                        topic,
                        q,
                        i.offset,
                        i.phys,
                        i.size,
                        i.attempt,
                        i.visible_at_ms,
                        i.nonce,
                    )
