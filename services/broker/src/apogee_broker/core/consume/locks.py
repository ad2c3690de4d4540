"""Queue locks for orderly consumption (RocketMQ's RebalanceLockManager).

A queue is held by at most one client of a group at a time. A client locks a batch of queues and
gets back the subset it now holds (a queue held by another client is not granted); locking a
queue it already holds renews the lock. A lock not renewed for ``expiry_ms`` is free again, so a
crashed holder cannot block its queue for ever; a client dropped from its group (its session
ended, or it stopped heartbeating) loses its locks at once (:meth:`QueueLocks.drop_client`).

Expiry is judged when a lock is looked at, on the injected clock's monotonic time; expired entries
are swept as the group's locks are touched, so nothing needs a background loop.

Each request is checked (group, client id, every queue: topic known and readable, queue id among
its read queues) before anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee_broker.core.checks import (
    check_read_queue,
    readable_topic,
    validate_client_id,
    validate_group,
)
from apogee_broker.core.topics import TopicManager

QueueKey = tuple[str, int]


@dataclass(slots=True)
class _Lock:
    client_id: str
    #: monotonic time of the last lock or renewal
    renewed: float


class QueueLocks:
    """The queue locks of every group at this broker; methods run on the event loop."""

    def __init__(
        self, topics: TopicManager, *, expiry_ms: int = 60_000, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.topics = topics
        self.expiry_s = expiry_ms / 1000
        self.clock = clock
        #: group -> queue -> lock
        self._locks: dict[str, dict[QueueKey, _Lock]] = {}

    def lock(self, group: str, client_id: str, queues: Sequence[QueueKey]) -> list[QueueKey]:
        """Lock (or renew) ``queues`` for ``client_id``; returns those it holds now, in the
        order asked."""
        self._check(group, client_id, queues)
        now = self.clock.monotonic()
        table = self._sweep(group, now)
        granted: list[QueueKey] = []
        for key in dict.fromkeys(queues):
            held = table.get(key)
            if held is None or held.client_id == client_id:
                table[key] = _Lock(client_id, now)
                granted.append(key)
        if not table:
            self._locks.pop(group, None)
        return granted

    def unlock(self, group: str, client_id: str, queues: Sequence[QueueKey]) -> None:
        """Release those of ``queues`` that ``client_id`` holds (others are left alone)."""
        self._check(group, client_id, queues)
        table = self._locks.get(group)
        if table is None:
            return
        for key in queues:
            held = table.get(key)
            if held is not None and held.client_id == client_id:
                del table[key]
        if not table:
            del self._locks[group]

    def drop_client(self, group: str, client_id: str) -> int:
        """Release every lock of ``client_id`` in ``group``; returns how many it held."""
        table = self._locks.get(group)
        if table is None:
            return 0
        mine = [key for key, held in table.items() if held.client_id == client_id]
        for key in mine:
            del table[key]
        if not table:
            del self._locks[group]
        return len(mine)

    def holder(self, group: str, topic: str, queue_id: int) -> str | None:
        """The client holding the queue's lock, or None (never locked, released or expired)."""
        table = self._locks.get(group)
        if table is None:
            return None
        held = table.get((topic, queue_id))
        if held is None or self.clock.monotonic() - held.renewed >= self.expiry_s:
            return None
        return held.client_id

    def held_by(self, group: str, client_id: str) -> list[QueueKey]:
        """The queues ``client_id`` holds in ``group``, sorted."""
        table = self._locks.get(group, {})
        now = self.clock.monotonic()
        return sorted(
            key
            for key, held in table.items()
            if held.client_id == client_id and now - held.renewed < self.expiry_s
        )

    def _sweep(self, group: str, now: float) -> dict[QueueKey, _Lock]:
        table = self._locks.setdefault(group, {})
        expired = [key for key, held in table.items() if now - held.renewed >= self.expiry_s]
        for key in expired:
            del table[key]
        return table

    def _check(self, group: str, client_id: str, queues: Sequence[QueueKey]) -> None:
        validate_group(group)
        validate_client_id(client_id)
        for topic, queue_id in queues:
            check_read_queue(self.topics, readable_topic(self.topics, topic), queue_id)
