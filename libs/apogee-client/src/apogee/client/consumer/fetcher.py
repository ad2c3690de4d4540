"""The per-queue fetcher: one background task per owned queue that fetches its records from
where the queue got to and hands them to the sink.

Where records come from is one seam, :class:`RecordSource`: the fetcher asks it for "the next
records of this queue from offset X" (a :class:`FetchRequest`) and gets a
:class:`~apogee.client._rpc.PullAnswer` back: a status, the offset to ask from next, the
queue's bounds, and the records. :class:`~apogee.client.consumer.stream_source.StreamSource`
(the default) answers from what the broker pushed on its delivery stream;
:class:`PullSource` answers with one long-polling pull per request. The offset to commit rides
along with each request (``commit_offset``, clustering).

What the fetcher does around the source:

- a queue starts at the offset ``start_offset`` finds (see :func:`find_start_offset`), or at
  the one it was reset to; an orderly consumer first waits for the queue's lock at its broker;
- fetching pauses while the queue holds ``max_cached_messages_per_queue`` messages or
  ``max_cached_bytes_per_queue`` bytes, or spans ``max_span`` offsets (concurrent mode), and goes
  on as soon as the sink finishes enough of them (``QueueState.space``);
- what arrives is decoded, filtered by tag, presented under its original topic when it comes
  from the retry topic, put in the queue's :class:`ProcessQueue` and handed to the sink;
- a queue another member of the group still reads (a rebalance moving it) is asked for again
  every :data:`HELD_RETRY_S`, from the offset that member commits when it lets it go;
- a failed fetch is tried again after a growing pause (0.1 s to 5 s); one that cannot succeed
  by retrying (the topic moved or is gone) also wakes the rebalancer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from opentelemetry.trace import Tracer

from apogee.client._rpc import ChannelPool, PullAnswer, rpc
from apogee.client.consumer.committer import OffsetCommitter
from apogee.client.consumer.config import ConsumeFrom, ConsumeMode, ConsumerConfig
from apogee.client.consumer.locking import QueueLocker
from apogee.client.consumer.process_queue import ProcessQueue
from apogee.client.consumer.queue_state import QueueState, Sink
from apogee.client.consumer.records import decode_records
from apogee.client.consumer.retry import present_retried
from apogee.client.consumer.spans import received
from apogee.client.producer.routes import MessageQueue
from apogee.client.reader import get_queue_offsets
from apogee.common.aio import cancel_and_wait
from apogee.common.errors import ApogeeError, CorruptRecordError, QueueHeldError
from apogee.common.filtering import EVERYTHING, Selection
from apogee.v1 import consumer_pb2

if TYPE_CHECKING:
    from apogee.client.metrics import ConsumerMetrics

__all__ = [
    "FetchContext",
    "FetchRequest",
    "PullSource",
    "QueueFetcher",
    "RecordSource",
    "find_start_offset",
]

log = logging.getLogger(__name__)

_MIN_BACKOFF = 0.1
_MAX_BACKOFF = 5.0
#: how often a queue another member of the group still holds is asked for again (seconds)
HELD_RETRY_S = 0.2
#: What a broker answers for a queue of a route that it does not have (yet).
_NOT_THERE_YET = frozenset({"UNKNOWN_TOPIC", "INVALID_QUEUE_ID"})


@dataclass(frozen=True, slots=True)
class Subscription:
    """A subscription as kept: its expressions as given and what they select."""

    tag_expression: str = "*"
    sql_expression: str = ""
    selection: Selection = EVERYTHING


#: A subscription to every message (the group's retry topic has one).
EVERY_MESSAGE = Subscription()


@dataclass(frozen=True, slots=True)
class FetchRequest:
    """Give me the next records of ``mq`` (at the broker at ``address``) from ``offset``."""

    mq: MessageQueue
    address: str
    offset: int
    #: the most messages wanted now
    max_messages: int
    tag_expression: str
    #: the queue's offset to commit, riding along (None: nothing to commit)
    commit_offset: int | None = None
    #: "": no SQL92 condition
    sql_expression: str = ""


class RecordSource(Protocol):
    """Where a fetcher's records come from (one source serves every queue of a consumer).

    The contract a source can rely on: each queue has at most one :meth:`fetch` outstanding;
    a queue's next request starts at the ``next_offset`` of the previous answer, unless the
    answer said the offset was out of range (then at the offset it named); while a queue is
    full the fetcher does not ask, so ``max_messages`` of the outstanding request is all the
    room it has (a pushing source grants credits from it). A fetch of a released queue is
    cancelled, then :meth:`released` is called; a queue taken again (an offset reset) starts
    again with a new request at its new offset."""

    async def fetch(self, request: FetchRequest) -> PullAnswer:
        """The next records of ``request.mq`` from ``request.offset``: waits (bounded) for some
        to arrive, answers with a ``PULL_NO_NEW_MESSAGE`` status when none did. Raises
        :class:`~apogee.common.errors.ApogeeError` when the queue cannot be read now
        (``retriable`` says whether asking again may help)."""
        ...

    def released(self, mq: MessageQueue, keep_commit: bool = False) -> None:
        """``mq`` is no longer fetched: forget whatever is kept for it (``keep_commit``: but
        the commit its release just made)."""
        ...

    async def close(self) -> None:
        """The consumer is closing (every queue was released): end what the source keeps
        open. The channels themselves belong to the consumer's pool."""
        ...


class PullSource:
    """Records by long-polling pulls: the broker holds a pull that finds nothing for up to
    ``long_poll_timeout`` and answers as soon as a message arrives."""

    def __init__(self, cfg: ConsumerConfig, pool: ChannelPool) -> None:
        self._cfg = cfg
        self._pool = pool
        self._hold_ms = int(cfg.long_poll_timeout * 1000)
        self._deadline = cfg.long_poll_timeout + cfg.request_timeout

    async def fetch(self, request: FetchRequest) -> PullAnswer:
        cfg = self._cfg
        mq = request.mq
        pull = consumer_pb2.PullRequest(
            group=cfg.group,
            topic=mq.topic,
            queue_id=mq.queue_id,
            offset=request.offset,
            max_messages=request.max_messages,
            tag_expression=request.tag_expression,
            sql_expression=request.sql_expression,
            hold_ms=self._hold_ms,
            client_id=cfg.client_id,
        )
        if request.commit_offset is not None:
            pull.commit_offset = request.commit_offset
        what = f"broker {mq.broker_name} ({request.address})"
        return await self._pool.pull(request.address, pull, self._deadline, what)

    def released(self, mq: MessageQueue, keep_commit: bool = False) -> None:
        pass

    async def close(self) -> None:
        pass


StartOffset = Callable[[QueueState], Awaitable[int]]


@dataclass(frozen=True, slots=True)
class FetchContext:
    """What every fetcher of one consumer shares."""

    cfg: ConsumerConfig
    source: RecordSource
    committer: OffsetCommitter
    sink: Sink
    #: the subscriptions by topic, as they are now
    subscriptions: Mapping[str, Subscription]
    #: where a queue without a given start offset starts
    start_offset: StartOffset
    #: orderly consumers: the queue locks
    locker: QueueLocker | None = None
    #: clustering: the group's retry topic
    retry_topic: str | None = None
    #: called when a fetch fails in a way that retrying will not mend (rebalance now)
    on_lost: Callable[[], None] = lambda: None
    #: None unless the consumer traces: then each message's receive span starts on arrival
    tracer: Tracer | None = None
    #: None unless the consumer counts metrics: each answer is counted as it arrives
    metrics: ConsumerMetrics | None = None


class QueueFetcher:
    """Fetches one owned queue until :meth:`stop`."""

    def __init__(self, ctx: FetchContext, qs: QueueState, start_at: int | None = None) -> None:
        """``start_at``: the offset to start from (after an offset reset), else the one
        ``ctx.start_offset`` finds."""
        self.ctx = ctx
        self.qs = qs
        self._start_at = start_at
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            mq = self.qs.mq
            self._task = asyncio.get_running_loop().create_task(
                self._main(), name=f"apogee-pull-{mq.topic}-{mq.queue_id}"
            )

    async def stop(self) -> None:
        """Stop fetching (the queue must be dropped first: ``qs.pq.drop()``, ``qs.gone``).
        The source still holds the queue (a stream's subscription, which for a clustering
        consumer keeps the group's other members off it) until :meth:`let_go`."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    def let_go(self, keep_commit: bool = False) -> None:
        """The source no longer holds the queue (after the release's commit, which it writes
        first with ``keep_commit``)."""
        self.ctx.source.released(self.qs.mq, keep_commit)

    async def _main(self) -> None:
        ctx, qs = self.ctx, self.qs
        backoff = _MIN_BACKOFF
        while not qs.pq.dropped:
            try:
                if ctx.locker is not None:
                    await ctx.locker.until_locked(qs)
                if qs.next_offset < 0:
                    qs.next_offset = (
                        self._start_at if self._start_at is not None else await ctx.start_offset(qs)
                    )
                    qs.pq.skip_to(qs.next_offset)
                    ctx.committer.start_at(qs.mq, qs.next_offset)
                qs.placed.set()
                await self._fetch_loop()
                return
            except asyncio.CancelledError:
                raise
            except ApogeeError as err:
                log.log(
                    self._level(err, logging.WARNING),
                    "%s/%s queue %d: %s; trying again in %.1fs",
                    qs.mq.broker_name,
                    qs.mq.topic,
                    qs.mq.queue_id,
                    err,
                    backoff,
                )
            except Exception:
                log.exception("%s queue %d failed", qs.mq.topic, qs.mq.queue_id)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    def _level(self, err: ApogeeError, level: int) -> int:
        """How loud a failure is: a queue of the retry topic that its broker does not have yet
        (a route of auto-created topics stands in for the real one until the brokers register
        it) is not worth a warning."""
        if self.qs.mq.topic == self.ctx.retry_topic and err.kind.name in _NOT_THERE_YET:
            return logging.DEBUG
        return level

    async def _fetch_loop(self) -> None:
        ctx, qs = self.ctx, self.qs
        cfg = ctx.cfg
        mq, pq = qs.mq, qs.pq
        sub = ctx.subscriptions.get(mq.topic, EVERY_MESSAGE)
        what = f"broker {mq.broker_name} ({qs.address})"
        backoff = _MIN_BACKOFF
        while not pq.dropped:
            if self._full(pq):
                qs.space.clear()
                if self._full(pq):
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await qs.space.wait()
                    continue
            if ctx.locker is not None and not ctx.locker.holds(qs):
                await ctx.locker.until_locked(qs)
                continue
            request = FetchRequest(
                mq,
                qs.address,
                qs.next_offset,
                cfg.pull_batch_size,
                sub.tag_expression,
                ctx.committer.piggyback(mq) if qs.reading else None,
                sub.sql_expression,
            )
            try:
                answer = await ctx.source.fetch(request)
            except QueueHeldError as err:
                if qs.gone.is_set():
                    return
                await self._held(err)
                continue
            except ApogeeError as err:
                if qs.gone.is_set():
                    return
                log.log(
                    self._level(err, logging.INFO if err.retriable else logging.WARNING),
                    "pull of %s queue %d from %s failed: %s; again in %.1fs",
                    mq.topic,
                    mq.queue_id,
                    what,
                    err,
                    backoff,
                )
                if not err.retriable:
                    ctx.on_lost()  # the topic may be gone or moved: rebalance
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
                continue
            backoff = _MIN_BACKOFF
            if qs.gone.is_set():
                return
            self.handle(answer, sub.selection)

    async def _held(self, err: QueueHeldError) -> None:
        """Another member still reads the queue (a rebalance moving it is under way): ask
        again shortly; the broker then starts it at the offset that member committed."""
        qs = self.qs
        qs.reading = False
        log.debug("%s queue %d: %s; again in %.1fs", qs.mq.topic, qs.mq.queue_id, err, HELD_RETRY_S)
        await asyncio.sleep(HELD_RETRY_S)

    def _full(self, pq: ProcessQueue) -> bool:
        cfg = self.ctx.cfg
        return (
            pq.count >= cfg.max_cached_messages_per_queue
            or pq.bytes >= cfg.max_cached_bytes_per_queue
            or (not cfg.orderly and pq.count > 0 and pq.max_span >= cfg.max_span)
        )

    def handle(self, answer: PullAnswer, sel: Selection = EVERYTHING) -> None:
        """Take in one answer of the source: the records, the next offset, the queue's
        bounds."""
        ctx, qs = self.ctx, self.qs
        committer = ctx.committer
        mq, pq = qs.mq, qs.pq
        qs.reading = True
        resp = answer.response
        status = resp.status
        if status == consumer_pb2.PULL_FOUND:
            try:
                msgs = decode_records(
                    answer.records,
                    resp.broker_name or mq.broker_name,
                    mq.topic,
                    mq.queue_id,
                    qs.next_offset,
                    ctx.cfg.verify_crc,
                    start=answer.start,
                    end=answer.end,
                )
            except CorruptRecordError as err:
                # never skip silently: the same offset is fetched again after a pause
                log.error("%s; pulling it again", err)
                raise
            if not sel.everything:  # the broker filters; a stray message is not handed over
                msgs = [m for m in msgs if sel.matches(m.tags or None, m.all_properties)]
            if mq.topic == ctx.retry_topic:
                present_retried(msgs)
            if ctx.tracer is not None and msgs:
                received(ctx.tracer, msgs, ctx.cfg.group, ctx.cfg.client_id)
            if ctx.metrics is not None and msgs:
                ctx.metrics.received(mq.topic, len(msgs), answer.end - answer.start)
            qs.next_offset = resp.next_offset
            if msgs:
                pq.add(msgs)
            pq.skip_to(resp.next_offset)  # past what the tag filter left out
            committer.advance(mq, pq.offset_to_commit())
            if msgs:
                ctx.sink.deliver(qs, msgs)
        elif status in (consumer_pb2.PULL_NO_NEW_MESSAGE, consumer_pb2.PULL_NO_MATCHED_MESSAGE):
            qs.next_offset = resp.next_offset
            pq.skip_to(resp.next_offset)
            committer.advance(mq, pq.offset_to_commit())
        elif status in (consumer_pb2.PULL_OFFSET_TOO_SMALL, consumer_pb2.PULL_OFFSET_OVERFLOW):
            log.warning(
                "%s/%s queue %d: offset %d is %s (kept: %d to %d); continuing at %d",
                mq.broker_name,
                mq.topic,
                mq.queue_id,
                qs.next_offset,
                "no longer kept"
                if status == consumer_pb2.PULL_OFFSET_TOO_SMALL
                else "beyond the queue's end",
                resp.min_offset,
                resp.max_offset,
                resp.next_offset,
            )
            qs.next_offset = resp.next_offset
            if status == consumer_pb2.PULL_OFFSET_TOO_SMALL:
                pq.skip_to(resp.next_offset)
            elif pq.count == 0:
                pq.clear(start_offset=resp.next_offset)
            committer.start_at(mq, pq.offset_to_commit())
        else:
            log.warning("unexpected pull status %d from %s", status, mq.broker_name)


async def find_start_offset(
    cfg: ConsumerConfig,
    pool: ChannelPool,
    committer: OffsetCommitter,
    retry_topic: str | None,
    qs: QueueState,
) -> int:
    """Where ``qs`` starts: the group's committed offset (at the broker for clustering, in the
    local file for broadcasting), else the queue's earliest message for the group's retry topic,
    else what ``consume_from`` says (``timestamp``: the first offset stored at or after it, as
    the broker finds it)."""
    mq = qs.mq
    resp = await rpc(
        f"broker {mq.broker_name} ({qs.address})",
        pool.consumer(qs.address).QueryOffsets(
            consumer_pb2.QueryOffsetsRequest(
                group=cfg.group, topic=mq.topic, queue_ids=[mq.queue_id]
            ),
            timeout=cfg.request_timeout,
        ),
    )
    row = next((q for q in resp.queues if q.queue_id == mq.queue_id), None)
    lo, hi = (row.min_offset, row.max_offset) if row is not None else (0, 0)
    if cfg.mode is ConsumeMode.CLUSTERING:
        committed = row.committed if row is not None and row.committed >= 0 else None
    else:
        committed = await committer.load(mq)
    if committed is not None:
        return committed
    if mq.topic == retry_topic:
        return lo  # the group's own retries: none is ever skipped, whatever consume_from
    how = cfg.consume_from
    if how is ConsumeFrom.EARLIEST:
        return lo
    if how is ConsumeFrom.TIMESTAMP:
        found = await get_queue_offsets(
            pool, qs.address, mq, cfg.consume_timestamp_ms, cfg.request_timeout
        )
        return found.timestamp_offset
    return hi
