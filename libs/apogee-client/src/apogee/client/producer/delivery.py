"""One state machine for every send: attempts, retries, deadline and settling, by callbacks.

A :class:`Delivery` is one send: one message (``send``, ``send_nowait``, ``send_ordered``,
``send_oneway``) or a batch that travels in one request (``send_batch``). The modes differ only
in three settings:

==================  =======================  ================  ===========================
mode                queue                    retries           settles
==================  =======================  ================  ===========================
single              round robin              ``retries``       a future (the caller's)
ordered             by sharding key, kept    ``retries``       a future
batch               round robin, one queue   ``retries``       one future for the batch
oneway              round robin              none              nothing: a failure is logged
==================  =======================  ================  ===========================

Each attempt picks a queue (round robin skips the broker that just failed, and the fault
strategy's slow or failed brokers; an ordered send keeps its queue unless ``failover``; an
idempotent send goes to the queue its dedup id hashes to, and keeps it), writes the queue id
into the records (:func:`wire.set_queue`) and queues the delivery itself in the accumulator: it
is an :class:`~apogee.client.producer.accumulator.Entry` that reads its own outcomes from the
request's answer (:meth:`Delivery.settle`). A retriable failure starts the next attempt (a batch
retries the messages that failed); anything else ends the send, except ``INVALID_QUEUE_ID``:
the broker has fewer queues than the cached route said (it was fetched before the topic was
created, say), so the route is fetched afresh and the send tries again, within its retries.
Only a send whose topic has no cached route, or whose route proved stale, starts a task, to
fetch the route.

An attempt that fails after its request may have reached the broker (:mod:`.outcome`: a timeout,
a broken stream, the deadline passing with the request in flight) leaves the outcome unknown:
a plain send then ends at once, and its error says the message may have been stored, with its
id; an idempotent send (its records carry ``APOGEE_DEDUP_ID``) tries again on the same queue,
where the broker's dedup window stores it once, and says the same if it still fails. Attempts
that failed before anything reached a broker are retried as before, elsewhere when they may.

So a send costs its delivery, and a future only where the caller waits on one; a message's
:class:`SendResult` is built only when a future, a hook or a callback takes it. A producer that
counts metrics (:mod:`apogee.client.metrics`) notes when each send starts and counts it once,
as it settles.

Deadlines share one timer (:class:`Deadlines`). However a send ends — an outcome, an error, the
deadline, the caller cancelling its future — one clean-up runs (:meth:`Delivery._cleanup`): the
after-send hooks, the producer's count of unsettled sends, the caller's callback; a copy still
waiting in the accumulator is dropped, since the delivery then reports itself given up.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

from apogee.client.message import Message, SendResult
from apogee.client.producer import wire
from apogee.client.producer.accumulator import Accumulator, Entry
from apogee.client.producer.config import SendHook
from apogee.client.producer.outcome import (
    RequestFailed,
    answer_leaves_unknown,
    route_moved,
    unknown_outcome,
)
from apogee.client.producer.routes import MessageQueue, RouteCache, TopicRoute
from apogee.client.producer.selector import RoundRobinSelector, select_by_key
from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    InvalidQueueIdError,
    UnavailableError,
)

if TYPE_CHECKING:
    from apogee.client.metrics import ProducerMetrics

log = logging.getLogger(__name__)

#: (result, None) on success, (None, error) on failure
SendCallback = Callable[[SendResult | None, BaseException | None], None]


class Deadlines:
    """One timer for every delivery: all share ``send_timeout``, so they expire in the order
    they started, and a FIFO whose head holds the only timer replaces a timer per send.
    Finished deliveries leave the FIFO when they reach its head."""

    __slots__ = ("_loop", "_queue", "_timer")

    def __init__(self) -> None:
        self._queue: collections.deque[Delivery] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, loop: asyncio.AbstractEventLoop, delivery: Delivery) -> None:
        """Watch ``delivery`` until its ``deadline`` (loop time)."""
        self._queue.append(delivery)
        if self._timer is None:
            self._loop = loop
            self._timer = loop.call_at(delivery.deadline, self._fire)

    def trim(self) -> None:
        """Let go of the finished deliveries at the head of the FIFO. Sends finish mostly in
        the order they started, so calling this as each one finishes keeps the FIFO about as
        long as the number in flight: a finished delivery and its bytes are freed at once, not
        ``send_timeout`` later (which at tens of thousands of sends a second kept that many
        seconds' worth alive, for the garbage collector to walk through)."""
        queue = self._queue
        while queue and queue[0].finished:
            queue.popleft()

    def _fire(self) -> None:
        self._timer = None
        assert self._loop is not None
        now = self._loop.time()
        queue = self._queue
        while queue:
            delivery = queue[0]
            if not delivery.finished and delivery.deadline > now:
                self._timer = self._loop.call_at(delivery.deadline, self._fire)
                return
            queue.popleft()
            delivery.expire()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._queue.clear()


@dataclass(slots=True, eq=False)
class SendContext:
    """What deliveries share: the producer's parts and counters."""

    acc: Accumulator[bytearray, SendResult]
    routes: RouteCache
    selector: RoundRobinSelector
    retries: int
    send_timeout: float
    hooks: tuple[SendHook, ...]
    leave: Callable[[], None]
    retried: int = 0
    route_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    deadlines: Deadlines = field(default_factory=Deadlines)
    #: None unless the producer counts metrics
    metrics: ProducerMetrics | None = None


def run_after_hooks(hooks: tuple[SendHook, ...], msg: Message, outcome: object) -> None:
    for hook in hooks:
        if hook.after is not None:
            try:
                hook.after(msg, outcome)  # type: ignore[arg-type]
            except Exception:
                log.exception("an after-send hook failed")


class Delivery(Entry):
    """One send (one message, or a batch in one request): its attempts, its deadline and, when
    the caller wants one, its future (``result``)."""

    __slots__ = (
        "attempt",
        "callback",
        "ctx",
        "deadline",
        "dedup",
        "exclude",
        "finished",
        "ids",
        "key",
        "last",
        "loop",
        "mq",
        "msgs",
        "on_settled",
        "oneway",
        "pinned",
        "records",
        "result",
        "results",
        "route",
        "started",
        "todo",
        "topic",
        "unknown",
    )

    #: the caller's future, when it wants one
    result: asyncio.Future[Any] | None
    #: of a batch: each message's result so far, and the messages still to send
    results: list[SendResult | None]
    todo: list[int]
    #: ``perf_counter()`` when the send began, kept only when the producer counts metrics
    started: float

    def __init__(
        self,
        ctx: SendContext,
        msgs: list[Message],
        records: list[bytearray],
        ids: list[str],
        loop: asyncio.AbstractEventLoop,
        *,
        batch: bool = False,
        key: str | bytes | None = None,
        failover: bool = False,
        oneway: bool = False,
        future: bool = True,
        callback: SendCallback | None = None,
        on_settled: Callable[[], None] | None = None,
        dedup: str = "",
        dedup_key: str = "",
    ) -> None:
        # as an accumulator entry: its records, placed anew by each attempt
        self.payload: Any = b""
        self.count = len(records)
        self.nbytes = 0
        self.group = batch
        self.sent = False
        self.ctx = ctx
        self.msgs = msgs
        self.records = records
        self.ids = ids
        self.topic = msgs[0].topic
        #: idempotent: "id" (the records carry their message ids as dedup ids) or "own" (their
        #: own APOGEE_DEDUP_ID); "" for a plain send
        self.dedup = dedup
        if dedup and key is None:
            key, failover = dedup_key, False  # the queue its dedup id hashes to, kept
        self.key = key
        self.pinned = key is not None and not failover  # ordered: retries keep the queue
        #: an attempt may have reached a broker: the messages may have been stored
        self.unknown = False
        self.oneway = oneway
        self.exclude: str | None = None
        self.mq: MessageQueue | None = None
        self.attempt = 0
        self.last: ApogeeError | None = None
        self.route: TopicRoute | None = None
        if batch:
            self.todo = list(range(len(records)))
            self.results = [None] * len(records)
        self.finished = False
        self.loop = loop
        self.callback = callback
        self.on_settled = on_settled
        if future:
            fut = self.result = loop.create_future()
            fut.add_done_callback(self)  # __call__: no bound method to allocate
        else:
            self.result = None
        self.deadline = loop.time() + ctx.send_timeout
        ctx.deadlines.add(loop, self)
        if ctx.metrics is not None:
            self.started = perf_counter()

    def begin(self) -> None:
        route = self.ctx.routes.cached(self.topic)
        if route is not None and route.queues:
            self._attempt(route)
            return
        self._start_fetch(fresh=False)

    def _start_fetch(self, fresh: bool, fallback: TopicRoute | None = None) -> None:
        task = self.loop.create_task(self._fetch_route(fresh, fallback))
        self.ctx.route_tasks.add(task)
        task.add_done_callback(self.ctx.route_tasks.discard)

    async def _fetch_route(self, fresh: bool, fallback: TopicRoute | None) -> None:
        """The route, then the next attempt; ``fresh``: asked of the nameservers even when one
        is cached (the cached one proved stale); ``fallback``: the route to go on with when
        no nameserver answers."""
        routes = self.ctx.routes
        try:
            route = await (routes.fetch(self.topic) if fresh else routes.get(self.topic))
        except asyncio.CancelledError:
            self._end(_closed())
            raise
        except Exception as exc:
            if fallback is None:
                self._end(exc)
                return
            route = fallback
        self._attempt(route)

    def _attempt(self, route: TopicRoute) -> None:
        if self.finished:
            return
        self.route = route
        self.sent = False
        try:
            mq = self.mq
            if mq is None or not self.pinned:
                if self.key is None:
                    mq = self.ctx.selector.select(route, self.exclude)
                else:
                    mq = select_by_key(route, self.key, self.exclude)
                self.mq = mq
            queue_id = mq.queue_id
            if self.group:
                records = [self.records[i] for i in self.todo]
                nbytes = 0
                for record in records:
                    wire.set_queue(record, queue_id)
                    nbytes += len(record)
                self.payload = records
                self.count = len(records)
                self.nbytes = nbytes
            else:
                record = self.records[0]
                wire.set_queue(record, queue_id)
                self.payload = record
                self.nbytes = len(record)
            self.ctx.acc.append_entry(mq.broker_name, self)
        except Exception as exc:
            self._end(exc)

    # -- the accumulator's side: the outcome of the current attempt ----------------------------

    def given_up(self) -> bool:
        """Whether the outcome is no longer wanted (a copy still queued is then dropped)."""
        return self.finished

    def settle(self, answer: wire.Answer, start: int) -> None:
        """This attempt's answer: its messages' outcomes start at ``start``."""
        if self.finished:
            return
        mq = self.mq
        assert mq is not None
        if not self.group:
            fut = self.result
            if answer.offsets[start] >= 0:  # stored: the common case, settled here
                if fut is None and not self.ctx.hooks and self.callback is None:
                    self._cleanup(None)  # nobody reads the result: do not build it
                    return
                result = answer.stored(start, self.ids[0], self.topic, mq.queue_id)
                if fut is None:
                    self._cleanup(result)
                elif not fut.done():  # its done-callback cleans up
                    fut.set_result(result)
                return
            outcome = answer.outcome(start, self.ids[0], self.topic, mq.queue_id)
            if isinstance(outcome, BaseException):
                self._failed(outcome, answer_leaves_unknown(outcome))
            else:
                self._end(outcome)
            return
        failed: list[tuple[int, BaseException]] = []
        results = self.results
        for k, i in enumerate(self.todo):
            outcome = answer.outcome(start + k, self.ids[i], self.topic, mq.queue_id)
            if isinstance(outcome, BaseException):
                failed.append((i, outcome))
            else:
                results[i] = outcome
        if not failed:
            self._end(results)
            return
        self.todo = [i for i, _ in failed]
        self._failed(
            next((o for _, o in failed if not _retriable(o)), failed[0][1]),
            any(answer_leaves_unknown(o) for _, o in failed),
        )

    def fail(self, exc: BaseException) -> None:
        """The attempt's request failed as a whole (:class:`RequestFailed` from the producer's
        sender says whether it may have reached the broker; any other failure of a request
        that was sent leaves that unknown: the producer closing with it in flight, say)."""
        if isinstance(exc, RequestFailed):
            self._failed(exc.error, exc.reached)
        else:
            self._failed(exc, self.sent)

    def _failed(self, exc: BaseException, reached: bool) -> None:
        """The attempt failed with ``exc`` (``reached``: after its messages may have been
        stored): retry when the error, the attempts left and idempotence allow it, else end."""
        if self.finished:
            return
        self.sent = False
        if reached:
            self.unknown = True
            if self.dedup:
                self.pinned = True  # only the broker that may have it drops a second copy
        if not isinstance(exc, ApogeeError):
            self._end(exc)
            return
        ctx = self.ctx
        self.last = exc
        # a queue the broker does not have: the route is stale (fetched before the topic was
        # created, or before it lost queues), not the message bad; a fresh route tells. So it
        # does when the broker's replica group has another leader now.
        stale = isinstance(exc, InvalidQueueIdError) or route_moved(exc)
        # a broker that could not be reached may have moved too (its group's leader handed
        # over and stopped): the retry goes by a fresh route, away from that broker if it can
        unreached = exc.kind.name == "UNAVAILABLE" and not reached
        if not stale:
            ctx.routes.refresh_soon(self.topic)
        retries = 0 if self.oneway else ctx.retries
        if (
            not (exc.retriable or stale)
            or self.attempt >= retries
            or ctx.acc.closed
            or (self.unknown and not self.dedup)  # a plain send again may store it twice
        ):
            self._end(exc)
            return
        assert self.mq is not None
        log.debug("send to %s failed, retrying: %s", self.mq.broker_name, exc)
        self.attempt += 1
        ctx.retried += 1
        if not self.pinned and not (stale and not self.unknown):
            self.exclude = self.mq.broker_name
        route = ctx.routes.cached(self.topic)
        if route is None or not route.queues:
            route = self.route
        assert route is not None  # set by the attempt that just failed
        if stale and not self.unknown:
            self.mq = None  # chosen again on the fresh route (an ordered send's too)
            self._start_fetch(fresh=True)
        elif unreached and not self.unknown:
            if not self.pinned:
                self.mq = None  # an ordered send keeps its queue, at the broker's new address
            self._start_fetch(fresh=True, fallback=route)
        else:
            self._attempt(route)

    def expire(self) -> None:
        if self.finished:
            return
        if self.sent:  # the deadline passed with the request in flight
            self.unknown = True
        what = (
            f"sending a batch of {len(self.msgs)} messages to topic {self.topic!r}"
            if self.group
            else f"sending a message to topic {self.topic!r}"
        )
        err = DeadlineExceededError(what=what, timeout_s=self.ctx.send_timeout)
        err.__cause__ = self.last
        self._end(err)

    # -- the end -------------------------------------------------------------------------------

    def _end(self, outcome: Any) -> None:
        """The send's outcome (a result, the batch's results, None for a oneway send that
        nobody reads, or an exception)."""
        if self.finished:
            return
        if self.unknown and isinstance(outcome, ApogeeError):
            ids = [self.ids[i] for i in self.todo] if self.group else self.ids
            outcome = unknown_outcome(outcome, ids, self.dedup)
        fut = self.result
        if fut is None:
            self._cleanup(outcome)
        elif not fut.done():  # its done-callback cleans up
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

    def __call__(self, fut: asyncio.Future[Any]) -> None:
        """The caller's future is settled (or cancelled by the caller)."""
        if fut.cancelled():
            self._cleanup(asyncio.CancelledError())
        else:
            self._cleanup(fut.exception() or fut.result())

    def _cleanup(self, outcome: Any) -> None:
        """The one clean-up, however the send ended."""
        if self.finished:
            return
        self.finished = True
        self.payload = b""
        ctx = self.ctx
        ctx.deadlines.trim()
        if ctx.metrics is not None:
            ctx.metrics.settled(self, outcome)
        if ctx.hooks:
            if self.group and not isinstance(outcome, BaseException):
                for msg, result in zip(self.msgs, outcome, strict=True):
                    run_after_hooks(ctx.hooks, msg, result)
            else:
                for msg in self.msgs:
                    run_after_hooks(ctx.hooks, msg, outcome)
        ctx.leave()
        if self.oneway and isinstance(outcome, Exception):
            log.warning("oneway send of topic %s failed: %s", self.topic, outcome)
        if self.callback is not None:
            run_callback(self.callback, outcome)
        if self.on_settled is not None:
            self.on_settled()


def run_callback(callback: SendCallback, outcome: object) -> None:
    """``callback(result, None)`` or ``callback(None, error)``; its failure is logged."""
    try:
        if isinstance(outcome, BaseException):
            callback(None, outcome)
        else:
            callback(outcome, None)  # type: ignore[arg-type]
    except Exception:
        log.exception("a send callback failed")


def _retriable(exc: BaseException) -> bool:
    return isinstance(exc, ApogeeError) and exc.retriable


def _closed() -> UnavailableError:
    return UnavailableError(what="the producer", detail="it closed before the message was sent")
