"""Where reads start and end: the queues of the topics, and offsets resolved per queue.

Runs where Spark plans (beside the driver): it asks the nameservers for the topics' queues and
each broker for its queues' bounds through the SDK's :class:`~apogee.client.QueueReader`.
A broker that does not answer (killed, restarting) keeps the offsets it had, so a stream
makes no progress on its queues until it is back, and loses nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from apogee.client import MessageQueue, QueueBounds
from apogee.common.errors import ApogeeError
from apogee.spark.options import EARLIEST, LATEST, Offsets, OffsetSpec
from apogee.spark.queues import QueueRange, SyncQueues

log = logging.getLogger(__name__)


def topic_queues(queues: SyncQueues, topics: Iterable[str]) -> list[MessageQueue]:
    out: list[MessageQueue] = []
    for topic in topics:
        out += queues.queues(topic)
    return out


def queue_bounds(
    queues: SyncQueues, mqs: Iterable[MessageQueue]
) -> dict[MessageQueue, QueueBounds]:
    """Bounds of every queue whose broker answers; a broker that fails is left out (logged)."""
    out: dict[MessageQueue, QueueBounds] = {}
    failed: set[str] = set()
    for mq in mqs:
        if mq.broker_name in failed:
            continue
        try:
            out[mq] = queues.bounds(mq)
        except ApogeeError as err:
            if not err.retriable:
                raise
            failed.add(mq.broker_name)
            log.warning("broker %s did not answer (%s); its queues wait", mq.broker_name, err)
    return out


def resolve(
    spec: OffsetSpec,
    queues: SyncQueues,
    bounds: dict[MessageQueue, QueueBounds],
    missing: int,
) -> Offsets:
    """``spec`` as one offset per queue of ``bounds``; ``missing`` (EARLIEST or LATEST) for a
    queue that a JSON spec does not name."""
    out: Offsets = {}
    for mq, b in bounds.items():
        if spec.kind == "earliest":
            offset = b.min_offset
        elif spec.kind == "latest":
            offset = b.max_offset
        elif spec.kind == "timestamp":
            offset = queues.offset_for_timestamp(mq, spec.timestamp_ms)
        else:
            named = spec.for_queue(mq.topic, mq.broker_name, mq.queue_id, missing)
            assert named is not None
            if named == EARLIEST:
                offset = b.min_offset
            elif named == LATEST:
                offset = b.max_offset
            else:
                offset = named
        out.setdefault(mq.topic, {}).setdefault(mq.broker_name, {})[mq.queue_id] = offset
    return out


def get(offsets: Offsets, topic: str, broker: str, queue_id: int) -> int | None:
    return offsets.get(topic, {}).get(broker, {}).get(queue_id)


def put(offsets: Offsets, topic: str, broker: str, queue_id: int, offset: int) -> None:
    offsets.setdefault(topic, {}).setdefault(broker, {})[queue_id] = offset


def flat(offsets: Offsets) -> dict[tuple[str, str, int], int]:
    return {
        (t, b, q): o for t, bs in offsets.items() for b, qs in bs.items() for q, o in qs.items()
    }


def ranges(start: Offsets, end: Offsets, split: int) -> list[QueueRange]:
    """One partition per queue and ``split`` offsets at most; a queue that ``start`` does not
    name (new since the last batch) is read from its earliest kept offset."""
    out: list[QueueRange] = []
    for (t, b, q), stop in sorted(flat(end).items()):
        begin = get(start, t, b, q)
        if begin is None:
            out.append(QueueRange(t, b, q, EARLIEST, stop))
            continue
        while begin < stop:
            nxt = min(stop, begin + split)
            out.append(QueueRange(t, b, q, begin, nxt))
            begin = nxt
    return out


def limit_rows(start: Offsets, latest: Offsets, max_rows: int) -> Offsets:
    """``latest`` with at most ``max_rows`` offsets taken in all, shared among the queues in
    proportion to their backlog (as Spark's Kafka source does)."""
    begin = flat(start)
    backlog = {k: max(0, o - begin.get(k, o)) for k, o in flat(latest).items()}
    total = sum(backlog.values())
    out: Offsets = {}
    if total <= max_rows:
        return latest
    shares = {k: (n * max_rows) // total for k, n in backlog.items()}
    left = max_rows - sum(shares.values())
    for k in sorted(backlog, key=lambda k: backlog[k] - shares[k], reverse=True):
        if left <= 0:
            break
        if shares[k] < backlog[k]:
            shares[k] += 1
            left -= 1
    for (t, b, q), o in flat(latest).items():
        s = begin.get((t, b, q))
        put(out, t, b, q, o if s is None else s + shares[(t, b, q)])
    return out
