"""One message's way through its attempts, driven by callbacks: no task per message.

A :class:`Delivery` owns the future the caller waits on and a deadline ``send_timeout`` away. Each
attempt picks a queue and queues the delivery itself in the accumulator: it is an
:class:`~apogee.client.producer.accumulator.Entry` (the message framed for that queue) and its
own :class:`~apogee.client.producer.accumulator.Sink`. A result settles the caller's future at
once; a retriable failure (:meth:`Delivery.set_exception`) starts the next attempt on another
broker (or, for an ordered send, the same queue). Only a message whose topic has no cached
route starts a task, to fetch the route. A send therefore costs two objects that live until it
is settled (the delivery and its future), which keeps the garbage collector's work small: they
form no reference cycle once settled, and the deadline FIFO lets go of them as they settle.

Deadlines share one timer (:class:`Deadlines`). Whatever settles the caller's future — a result,
an error, the deadline, the caller giving up — the future's one done-callback cleans up: the
after-send hooks run, the producer counts the send finished, and the caller's callback (if any)
runs; a copy still waiting in the accumulator is dropped, since the delivery then reports
itself ``done()``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from apogee.client.message import Message, SendResult
from apogee.client.producer import wire
from apogee.client.producer.accumulator import Accumulator, Entry
from apogee.client.producer.config import SendHook
from apogee.client.producer.routes import MessageQueue, RouteCache, TopicRoute
from apogee.client.producer.selector import RoundRobinSelector, select_by_key
from apogee.common.errors import ApogeeError, DeadlineExceededError, UnavailableError

log = logging.getLogger(__name__)

FRAME_OVERHEAD = 8  # tag, length and queue id around a message's bytes

#: (result, None) on success, (None, error) on failure
SendCallback = Callable[[SendResult | None, BaseException | None], None]


class Deadlines:
    """One timer for every delivery: all share ``send_timeout``, so they expire in the order
    they started, and a FIFO whose head holds the only timer replaces a timer per message.
    Settled deliveries leave the FIFO when they reach its head."""

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
        """Let go of the settled deliveries at the head of the FIFO. Sends settle mostly in the
        order they started, so calling this as each one settles keeps the FIFO about as long
        as the number in flight: a settled delivery, its future and its bytes are freed at
        once, not ``send_timeout`` later (which at tens of thousands of sends a second kept
        that many seconds' worth alive, for the garbage collector to walk through)."""
        queue = self._queue
        while queue and queue[0].result.done():
            queue.popleft()

    def _fire(self) -> None:
        self._timer = None
        assert self._loop is not None
        now = self._loop.time()
        queue = self._queue
        while queue:
            delivery = queue[0]
            if not delivery.result.done() and delivery.deadline > now:
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

    acc: Accumulator[bytes, SendResult]
    routes: RouteCache
    selector: RoundRobinSelector
    retries: int
    send_timeout: float
    hooks: tuple[SendHook, ...]
    leave: Callable[[], None]
    retried: int = 0
    route_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    deadlines: Deadlines = field(default_factory=Deadlines)


def run_after_hooks(hooks: tuple[SendHook, ...], msg: Message, outcome: object) -> None:
    for hook in hooks:
        if hook.after is not None:
            try:
                hook.after(msg, outcome)  # type: ignore[arg-type]
            except Exception:
                log.exception("an after-send hook failed")


class Delivery(Entry):
    """One send: its attempts, its deadline and the caller's future (``result``)."""

    __slots__ = (
        "attempt",
        "callback",
        "ctx",
        "deadline",
        "encoded",
        "exclude",
        "key",
        "last",
        "loop",
        "mq",
        "msg",
        "pinned",
        "result",
        "route",
    )

    def __init__(
        self,
        ctx: SendContext,
        msg: Message,
        encoded: bytes,
        key: str | bytes | None,
        failover: bool,
        loop: asyncio.AbstractEventLoop,
        callback: SendCallback | None = None,
    ) -> None:
        # as an accumulator entry: one message, framed anew by each attempt, settling itself
        self.payload = b""
        self.count = 1
        self.nbytes = len(encoded) + FRAME_OVERHEAD
        self.future = self
        self.group = False
        self.ctx = ctx
        self.msg = msg
        self.encoded = encoded
        self.key = key
        self.pinned = key is not None and not failover  # ordered: retries keep the queue
        self.exclude: str | None = None
        self.mq: MessageQueue | None = None
        self.attempt = 0
        self.last: ApogeeError | None = None
        self.route: TopicRoute | None = None
        self.loop = loop
        self.callback = callback
        self.result: asyncio.Future[SendResult] = loop.create_future()
        self.deadline = loop.time() + ctx.send_timeout
        ctx.deadlines.add(loop, self)
        self.result.add_done_callback(self)  # __call__: no bound method to allocate

    def begin(self) -> None:
        route = self.ctx.routes.cached(self.msg.topic)
        if route is not None and route.queues:
            self._attempt(route)
            return
        task = self.loop.create_task(self._fetch_route())
        self.ctx.route_tasks.add(task)
        task.add_done_callback(self.ctx.route_tasks.discard)

    async def _fetch_route(self) -> None:
        try:
            route = await self.ctx.routes.get(self.msg.topic)
        except asyncio.CancelledError:
            self._fail(_closed())
            raise
        except Exception as exc:
            self._fail(exc)
            return
        self._attempt(route)

    def _attempt(self, route: TopicRoute) -> None:
        if self.result.done():
            return
        self.route = route
        try:
            mq = self.mq
            if mq is None or not self.pinned:
                if self.key is None:
                    mq = self.ctx.selector.select(route, self.exclude)
                else:
                    mq = select_by_key(route, self.key, self.exclude)
                self.mq = mq
            self.payload = wire.frame(self.encoded, mq.queue_id)
            self.ctx.acc.append_entry(mq.broker_name, self)
        except Exception as exc:
            self._fail(exc)

    # -- the accumulator's sink: the outcome of the current attempt ---------------------------

    def done(self) -> bool:
        """Whether the outcome is no longer wanted (a copy still queued is then dropped)."""
        return self.result.done()

    def set_result(self, result: SendResult) -> None:
        if not self.result.done():
            self.result.set_result(result)

    def set_exception(self, exc: BaseException) -> None:
        """The attempt failed: retry when the error allows it, else fail the send."""
        if self.result.done():
            return
        if not isinstance(exc, ApogeeError):
            self._fail(exc)
            return
        ctx = self.ctx
        self.last = exc
        topic = self.msg.topic
        ctx.routes.refresh_soon(topic)
        if not exc.retriable or self.attempt >= ctx.retries or ctx.acc.closed:
            self._fail(exc)
            return
        assert self.mq is not None
        log.debug("send to %s failed, retrying: %s", self.mq.broker_name, exc)
        self.attempt += 1
        ctx.retried += 1
        if not self.pinned:
            self.exclude = self.mq.broker_name
        route = ctx.routes.cached(topic)
        if route is None or not route.queues:
            route = self.route
        assert route is not None  # set by the attempt that just failed
        self._attempt(route)

    def _fail(self, exc: BaseException) -> None:
        if not self.result.done():
            self.result.set_exception(exc)

    def expire(self) -> None:
        if self.result.done():
            return
        err = DeadlineExceededError(
            what=f"sending a message to topic {self.msg.topic!r}",
            timeout_s=self.ctx.send_timeout,
        )
        err.__cause__ = self.last
        self.result.set_exception(err)

    def __call__(self, result: asyncio.Future[SendResult]) -> None:
        """The caller's future is settled: the one clean-up, however that happened."""
        self.payload = b""
        # As an entry, the delivery was its own sink: that reference cycle would leave every
        # settled send to the garbage collector. A copy still queued sees a settled sink.
        self.future = SETTLED
        self.ctx.deadlines.trim()
        if self.ctx.hooks:  # (without hooks an ignored failure still gets asyncio's warning)
            outcome: object
            if result.cancelled():
                outcome = asyncio.CancelledError()
            else:
                outcome = result.exception() or result.result()
            run_after_hooks(self.ctx.hooks, self.msg, outcome)
        self.ctx.leave()
        if self.callback is not None:
            run_callback(self.callback, result)


class _Settled:
    """The sink of a settled delivery: its outcome is no longer wanted."""

    __slots__ = ()

    def done(self) -> bool:
        return True

    def set_result(self, result: object, /) -> None:
        pass

    def set_exception(self, exception: BaseException, /) -> None:
        pass


SETTLED = _Settled()


def run_callback(callback: SendCallback, fut: asyncio.Future[SendResult]) -> None:
    """``callback(result, None)`` or ``callback(None, error)``; its failure is logged."""
    try:
        if fut.cancelled():
            callback(None, asyncio.CancelledError())
        elif (exc := fut.exception()) is not None:
            callback(None, exc)
        else:
            callback(fut.result(), None)
    except Exception:
        log.exception("a send callback failed")


def _closed() -> UnavailableError:
    return UnavailableError(what="the producer", detail="it closed before the message was sent")
