"""Which queue a message goes to.

:class:`RoundRobinSelector` walks a topic's queues in turn (each topic from its own counter,
started at a random place so that producers spread out), taking the first queue whose broker
the fault strategy says is available and which is not the broker that just failed (on a retry).
When no such queue exists it asks the fault strategy for the broker most likely to work among
the others, and only when the topic lives on the failed broker alone does it go back to it.

:func:`select_by_key` is the selector of ordered sends: ``crc32(key) % len(queues)`` over the
route's stable queue order, so one key always lands on one queue while the route is unchanged.
"""

from __future__ import annotations

import random
import zlib

from apogee.client.message import not_text_rule
from apogee.client.producer.fault import FaultStrategy
from apogee.client.producer.routes import MessageQueue, TopicRoute
from apogee.common.errors import InvalidArgumentError, PermissionDeniedError


def _no_queue(route: TopicRoute) -> PermissionDeniedError:
    return PermissionDeniedError(
        what=f"topic {route.topic!r}", rule="no live broker accepts writes to it (perm)"
    )


class RoundRobinSelector:
    def __init__(self, fault: FaultStrategy, rng: random.Random | None = None) -> None:
        self._fault = fault
        self._rng = rng or random.Random()
        self._counters: dict[str, int] = {}

    def select(self, route: TopicRoute, exclude: str | None = None) -> MessageQueue:
        """The next queue, avoiding unavailable brokers and ``exclude`` (the broker that just
        failed) when the route offers anything else."""
        queues = route.queues
        n = len(queues)
        if n == 0:
            raise _no_queue(route)
        counters = self._counters
        index = counters.get(route.topic)
        if index is None:
            index = self._rng.randrange(1 << 16)
        counters[route.topic] = index + 1
        fault = self._fault
        q = queues[index % n]  # the usual case, first: the next queue is fine
        if q.broker_name != exclude and fault.is_available(q.broker_name):
            return q
        for i in range(1, n):
            q = queues[(index + i) % n]
            if q.broker_name != exclude and fault.is_available(q.broker_name):
                return q
        others = [b for b in route.by_broker if b != exclude]
        if others:
            best = self._fault.pick_one_at_least(others) or others[index % len(others)]
            on_best = route.by_broker[best]
            return on_best[index % len(on_best)]
        return queues[index % n]


def shard_of(key: str | bytes) -> int:
    """The hash a sharding key is placed by."""
    if isinstance(key, str):
        try:
            key = key.encode()
        except UnicodeEncodeError as exc:
            raise InvalidArgumentError(
                field="sharding_key", rule=f"{not_text_rule(exc)}; pass bytes for a binary key"
            ) from None
    elif not isinstance(key, bytes):
        raise InvalidArgumentError(
            field="sharding_key", rule=f"must be str or bytes, got {type(key).__name__}"
        )
    return zlib.crc32(key)


def select_by_key(route: TopicRoute, key: str | bytes, exclude: str | None = None) -> MessageQueue:
    """The queue of ``key``: ``crc32(key) % len(queues)``; with ``exclude``, the same over the
    queues of the other brokers (if there are any)."""
    queues = route.queues
    if exclude is not None:
        queues = tuple(q for q in queues if q.broker_name != exclude) or queues
    if not queues:
        raise _no_queue(route)
    return queues[shard_of(key) % len(queues)]
