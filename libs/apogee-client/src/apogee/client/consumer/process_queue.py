"""The messages pulled from one queue and not yet finished (RocketMQ's ProcessQueue).

A consumer keeps one :class:`ProcessQueue` per queue it was given. The pull loop
:meth:`~ProcessQueue.add`\\ s what each pull returns (queue offsets ascend from one pull to the
next); listeners finish messages in any order, and :meth:`~ProcessQueue.remove` answers with the
offset that is safe to commit: the smallest offset still in flight, or one past the highest offset
ever added when nothing is left. So a slow message holds the committed offset back (and a
restart redelivers what came after it: at-least-once), but a finished message is never lost
behind an unfinished one. ``count``, ``bytes`` and ``max_span`` are what flow control reads
before the next pull.

Orderly consumption takes messages in offset order instead: :meth:`~ProcessQueue.take` hands
out the next ones, :meth:`~ProcessQueue.commit_taken` finishes them and
:meth:`~ProcessQueue.rollback_taken` puts them back to be taken again.

Inside, the messages in flight sit in a dict by offset and, in offset order, in a list whose
finished prefix (and suffix) is trimmed lazily: every operation is amortised O(1) per message,
never a scan of the whole queue. Not thread-safe: use it from one event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from apogee.client.consumer.records import ReceivedMessage
from apogee.common.errors import InvalidArgumentError

__all__ = ["ProcessQueue"]

#: The finished prefix of the order list is cut off once it is this long (and half the list).
_COMPACT_AT = 1024


class ProcessQueue:
    """Messages of one queue between their pull and the end of their consumption."""

    def __init__(self, start_offset: int = -1, now: float = 0.0) -> None:
        """``start_offset``: where pulling starts, what :meth:`offset_to_commit` answers before
        anything was added (-1: unknown). ``now``: the monotonic time the queue was taken."""
        #: messages in flight by offset
        self._inflight: dict[int, ReceivedMessage] = {}
        #: every message added and maybe still in flight, in offset order, from ``_head``
        self._order: list[ReceivedMessage] = []
        self._head = 0
        #: orderly: the next position of ``_order`` to take from, and where the taken began
        self._cursor = 0
        self._taken: list[ReceivedMessage] = []
        self._next = start_offset  # one past the highest offset added (or skipped to)
        self._bytes = 0
        self._dropped = False
        self.last_pull_time = now
        self.last_consume_time = now
        self.last_lock_time = now
        #: orderly: this client holds the queue's lock at its broker
        self.locked = False
        #: orderly: a listener call is working on this queue
        self.consuming = False

    # -- what flow control reads ---------------------------------------------------------------

    @property
    def count(self) -> int:
        """Messages in flight (pulled, not finished; taken ones included)."""
        return len(self._inflight)

    @property
    def bytes(self) -> int:
        """Record bytes in flight."""
        return self._bytes

    @property
    def max_span(self) -> int:
        """The highest offset in flight minus the lowest; 0 when at most one is."""
        first = self._first()
        if first is None:
            return 0
        order = self._order
        inflight = self._inflight
        while order[-1].queue_offset not in inflight:  # trim the finished tail
            order.pop()
        # the take cursor may have passed the trimmed tail: the next message added must not
        # be skipped
        self._cursor = min(self._cursor, len(order))
        return order[-1].queue_offset - first.queue_offset

    @property
    def dropped(self) -> bool:
        """The queue was taken away from this consumer (rebalance) or reset: pulls stop and
        the results of listener calls still running are not committed."""
        return self._dropped

    def drop(self) -> None:
        self._dropped = True

    @property
    def next_offset(self) -> int:
        """One past the highest offset added or skipped to (``start_offset`` at first)."""
        return self._next

    # -- times, set by the caller --------------------------------------------------------------

    def mark_pulled(self, now: float) -> None:
        self.last_pull_time = now

    def mark_consumed(self, now: float) -> None:
        self.last_consume_time = now

    def mark_locked(self, now: float) -> None:
        self.locked = True
        self.last_lock_time = now

    # -- adding and finishing ------------------------------------------------------------------

    def add(self, msgs: Sequence[ReceivedMessage]) -> None:
        """Messages of the next pull, in ascending queue order, beyond every offset added
        before."""
        if not msgs:
            return
        first = msgs[0].queue_offset
        if first < self._next:
            raise InvalidArgumentError(
                field="msgs",
                rule=f"offsets must ascend across pulls: {first} is below {self._next}, "
                "where the previous pull ended",
            )
        inflight = self._inflight
        size = 0
        for m in msgs:
            inflight[m.queue_offset] = m
            size += m.size
        self._order += msgs
        self._bytes += size
        self._next = msgs[-1].queue_offset + 1

    def skip_to(self, offset: int) -> None:
        """The pull moved on to ``offset`` without returning the messages before it (a tag
        filter dropped them): once nothing is in flight, ``offset`` is the one to commit."""
        self._next = max(self._next, offset)

    def remove(self, msgs: Iterable[ReceivedMessage]) -> int:
        """Finish ``msgs`` (messages not in flight are ignored) and return the offset to
        commit (see :meth:`offset_to_commit`)."""
        inflight = self._inflight
        freed = 0
        for m in msgs:
            if inflight.pop(m.queue_offset, None) is not None:
                freed += m.size
        self._bytes -= freed
        return self.offset_to_commit()

    def offset_to_commit(self) -> int:
        """The smallest offset in flight, else one past the highest added (or skipped to);
        -1 when nothing was added and no start offset is known."""
        first = self._first()
        return self._next if first is None else first.queue_offset

    def clear(self, start_offset: int | None = None) -> list[ReceivedMessage]:
        """Forget every message in flight (the queue is dropped, or its offset was reset to
        ``start_offset``, where the next :meth:`add` may begin); returns them in offset order."""
        left = [m for m in self._order[self._head :] if m.queue_offset in self._inflight]
        self._inflight.clear()
        self._order = []
        self._head = self._cursor = 0
        self._taken = []
        self._bytes = 0
        if start_offset is not None:
            self._next = start_offset
        return left

    # -- orderly consumption -------------------------------------------------------------------

    def take(self, n: int) -> list[ReceivedMessage]:
        """The next ``n`` messages in offset order that were not taken yet (fewer when fewer
        are there). They stay in flight until :meth:`commit_taken` or :meth:`rollback_taken`."""
        order = self._order
        inflight = self._inflight
        cursor = max(self._cursor, self._head)
        end = len(order)
        out: list[ReceivedMessage] = []
        while cursor < end and len(out) < n:
            m = order[cursor]
            cursor += 1
            if m.queue_offset in inflight:
                out.append(m)
        self._cursor = cursor
        self._taken += out
        return out

    @property
    def taken(self) -> int:
        """How many messages are taken and neither committed nor rolled back."""
        return len(self._taken)

    def commit_taken(self) -> int:
        """The taken messages are finished; returns the offset to commit."""
        taken, self._taken = self._taken, []
        return self.remove(taken)

    def rollback_taken(self) -> None:
        """Put the taken messages back, to be taken again in the same order."""
        if not self._taken:
            return
        first = self._taken[0].queue_offset
        self._taken = []
        # the taken ones lie from the first of them up to the cursor: step back to it
        order = self._order
        cursor = min(self._cursor, len(order))
        head = self._head
        while cursor > head and order[cursor - 1].queue_offset >= first:
            cursor -= 1
        self._cursor = cursor

    # -- internals ----------------------------------------------------------------------------

    def _first(self) -> ReceivedMessage | None:
        """The lowest message in flight, trimming the finished prefix of the order list."""
        order = self._order
        inflight = self._inflight
        if not inflight:
            if order:
                self._order = []
                self._head = self._cursor = 0
            return None
        head = self._head
        while order[head].queue_offset not in inflight:
            head += 1
        if head >= _COMPACT_AT and head * 2 >= len(order):
            del order[:head]
            self._cursor = max(0, self._cursor - head)
            head = 0
        self._head = head
        return order[head]
