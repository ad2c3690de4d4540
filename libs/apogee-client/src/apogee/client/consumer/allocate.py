"""How a consumer group shares a topic's queues among its members (clustering mode).

Every member computes its own share from the same inputs (the topic's queues and the group's
members, both sorted), so the members agree without talking to each other; while one of them
has an outdated member list, a queue can briefly have two consumers or none, and the next
rebalance settles it (RocketMQ's design). The strategies, by :attr:`~AllocateStrategy.name`:

``average`` (:class:`AverageAllocation`, the default; RocketMQ's AllocateMessageQueueAveragely)
    contiguous ranges: 8 queues, 3 members -> ``[0 1 2] [3 4 5] [6 7]``.
``round-robin`` (:class:`RoundRobinAllocation`; AllocateMessageQueueAveragelyByCircle)
    by circle: 8 queues, 3 members -> ``[0 3 6] [1 4 7] [2 5]``.
``consistent-hash`` (:class:`ConsistentHashAllocation`; AllocateMessageQueueConsistentHash)
    a hash ring of virtual nodes per member (MD5, the same in every process): when a member
    joins or leaves, only the queues it takes or gives up change hands.
``config`` (:class:`ConfigAllocation`; AllocateMessageQueueByConfig)
    a fixed list of queues for this member, whatever the others do.

With more members than queues, the extra members get nothing (a queue has one consumer).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Sequence
from typing import Final, Protocol, runtime_checkable

from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import InvalidArgumentError

__all__ = [
    "AllocateStrategy",
    "AverageAllocation",
    "ConfigAllocation",
    "ConsistentHashAllocation",
    "RoundRobinAllocation",
    "strategy_by_name",
]


@runtime_checkable
class AllocateStrategy(Protocol):
    """Decides which of a topic's queues one member of a group consumes."""

    #: the strategy's name, as :func:`strategy_by_name` and the consumer options take it
    name: str

    def allocate(
        self,
        group: str,
        client_id: str,
        queues: Sequence[MessageQueue],
        members: Sequence[str],
    ) -> list[MessageQueue]:
        """The queues ``client_id`` consumes, out of ``queues`` (sorted), given the group's
        ``members`` (sorted client ids). A client that is not a member gets ``[]``."""
        ...


class AverageAllocation:
    """Contiguous ranges of nearly equal size; the first members take one more when the
    queues do not divide evenly."""

    name = "average"

    def allocate(
        self,
        group: str,
        client_id: str,
        queues: Sequence[MessageQueue],
        members: Sequence[str],
    ) -> list[MessageQueue]:
        index = _index(client_id, members)
        if index is None or not queues:
            return []
        n, m = len(queues), len(members)
        base, extra = divmod(n, m)
        size = base + (1 if index < extra else 0)
        start = index * base + min(index, extra)
        return list(queues[start : start + size])

    def __repr__(self) -> str:
        return "AverageAllocation()"


class RoundRobinAllocation:
    """Queue ``i`` goes to member ``i mod members``."""

    name = "round-robin"

    def allocate(
        self,
        group: str,
        client_id: str,
        queues: Sequence[MessageQueue],
        members: Sequence[str],
    ) -> list[MessageQueue]:
        index = _index(client_id, members)
        if index is None:
            return []
        return list(queues[index :: len(members)])

    def __repr__(self) -> str:
        return "RoundRobinAllocation()"


#: Virtual nodes per member on the hash ring: more spread the queues more evenly.
DEFAULT_VIRTUAL_NODES: Final = 160


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same in every process and on every machine (the
    first 8 bytes of its MD5, big-endian); Python's ``hash()`` changes between processes."""
    return int.from_bytes(hashlib.md5(text.encode(), usedforsecurity=False).digest()[:8], "big")


class ConsistentHashAllocation:
    """Each member owns ``virtual_nodes`` points of a hash ring; a queue belongs to the member
    of the first point at or after its own hash (wrapping around)."""

    name = "consistent-hash"

    def __init__(self, virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        if (
            not isinstance(virtual_nodes, int)
            or isinstance(virtual_nodes, bool)
            or not 1 <= virtual_nodes <= 10_000
        ):
            raise InvalidArgumentError(
                field="virtual_nodes",
                rule=f"must be an integer from 1 to 10000, got {virtual_nodes!r}",
            )
        self.virtual_nodes = virtual_nodes
        # the last ring built: rebalances repeat with the same members most of the time
        self._ring_members: tuple[str, ...] = ()
        self._ring: tuple[list[int], list[str]] = ([], [])

    def _ring_of(self, members: Sequence[str]) -> tuple[list[int], list[str]]:
        key = tuple(members)
        if key != self._ring_members or not self._ring[0]:
            points = sorted(
                (stable_hash(f"{member}#{i}"), member)
                for member in key
                for i in range(self.virtual_nodes)
            )
            self._ring = ([p for p, _ in points], [member for _, member in points])
            self._ring_members = key
        return self._ring

    def owner(self, queue: MessageQueue, members: Sequence[str]) -> str:
        """The member that ``queue`` belongs to."""
        hashes, owners = self._ring_of(members)
        i = bisect.bisect_left(hashes, stable_hash(queue_key(queue)))
        return owners[i % len(owners)]

    def allocate(
        self,
        group: str,
        client_id: str,
        queues: Sequence[MessageQueue],
        members: Sequence[str],
    ) -> list[MessageQueue]:
        if _index(client_id, members) is None:
            return []
        return [q for q in queues if self.owner(q, members) == client_id]

    def __repr__(self) -> str:
        return f"ConsistentHashAllocation(virtual_nodes={self.virtual_nodes})"


def queue_key(queue: MessageQueue) -> str:
    """The text a queue is hashed by: ``topic@broker@queue_id``."""
    return f"{queue.topic}@{queue.broker_name}@{queue.queue_id}"


class ConfigAllocation:
    """A fixed set of queues for this member, whatever the other members consume (each member
    is configured with its own). Only the listed queues that the topic has are returned."""

    name = "config"

    def __init__(self, queues: Iterable[MessageQueue]) -> None:
        chosen = tuple(queues)
        for q in chosen:
            if not isinstance(q, MessageQueue):
                raise InvalidArgumentError(
                    field="queues", rule=f"{q!r} is not a MessageQueue(topic, broker_name, id)"
                )
        self.queues = frozenset(chosen)

    def allocate(
        self,
        group: str,
        client_id: str,
        queues: Sequence[MessageQueue],
        members: Sequence[str],
    ) -> list[MessageQueue]:
        if _index(client_id, members) is None:
            return []
        return [q for q in queues if q in self.queues]

    def __repr__(self) -> str:
        shown = ", ".join(sorted(queue_key(q) for q in self.queues))
        return f"ConfigAllocation([{shown}])"


def _index(client_id: str, members: Sequence[str]) -> int | None:
    try:
        return members.index(client_id)
    except ValueError:
        return None


_BY_NAME: Final[dict[str, type[AllocateStrategy]]] = {
    AverageAllocation.name: AverageAllocation,
    RoundRobinAllocation.name: RoundRobinAllocation,
    ConsistentHashAllocation.name: ConsistentHashAllocation,
}


def strategy_by_name(name: str) -> AllocateStrategy:
    """A new strategy of that name: ``average``, ``round-robin`` or ``consistent-hash``
    (``config`` needs its queues: create :class:`ConfigAllocation` yourself)."""
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        hint = (
            "; 'config' takes its queue list: pass ConfigAllocation(queues) instead of a name"
            if name == "config"
            else ""
        )
        raise InvalidArgumentError(
            field="allocate",
            rule=f"{name!r} is not a strategy; use one of: {', '.join(sorted(_BY_NAME))}{hint}",
        )
    return cls()
