"""One message's way through its attempts, driven by callbacks: no task per message.

A :class:`Delivery` owns the future the caller waits on and a deadline ``send_timeout`` away. Each
attempt picks a queue and appends the message to the accumulator; when the accumulator's
future completes, :meth:`Delivery._on_outcome` either settles the caller's future or, after a
retriable failure, starts the next attempt on another broker (or, for an ordered send, the same
queue). Only a message whose topic has no cached route starts a task, to fetch the route.

Deadlines share one timer (:class:`Deadlines`). Whatever settles the caller's future — a result,
an error, the deadline, the caller giving up — the future's one done-callback cleans up: a copy
still waiting in the accumulator is dropped, the after-send hooks run, and the producer counts
the send finished.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from apogee.client.message import Message, SendResult
from apogee.client.producer import wire
from apogee.client.producer.accumulator import Accumulator
from apogee.client.producer.config import SendHook
from apogee.client.producer.routes import MessageQueue, RouteCache, TopicRoute
from apogee.client.producer.selector import RoundRobinSelector, select_by_key
from apogee.common.errors import ApogeeError, DeadlineExceededError, UnavailableError

log = logging.getLogger(__name__)

FRAME_OVERHEAD = 8  # tag, length and queue id around a message's bytes


class Deadlines:
    """One timer for every delivery: all share ``send_timeout``, so they expire in the order
    they started, and a FIFO whose head holds the only timer replaces a timer per message.
    Settled deliveries leave the FIFO when they reach its head."""

    __slots__ = ("_loop", "_queue", "_timer")

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[float, Delivery]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, loop: asyncio.AbstractEventLoop, when: float, delivery: Delivery) -> None:
        self._queue.append((when, delivery))
        if self._timer is None:
            self._loop = loop
            self._timer = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        assert self._loop is not None
        now = self._loop.time()
        queue = self._queue
        while queue:
            when, delivery = queue[0]
            if not delivery.result.done() and when > now:
                self._timer = self._loop.call_at(when, self._fire)
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


class Delivery:
    __slots__ = (
        "attempt",
        "ctx",
        "encoded",
        "exclude",
        "key",
        "last",
        "loop",
        "mq",
        "msg",
        "nbytes",
        "pending",
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
    ) -> None:
        self.ctx = ctx
        self.msg = msg
        self.encoded = encoded
        self.nbytes = len(encoded) + FRAME_OVERHEAD
        self.key = key
        self.pinned = key is not None and not failover  # ordered: retries keep the queue
        self.exclude: str | None = None
        self.mq: MessageQueue | None = None
        self.attempt = 0
        self.last: ApogeeError | None = None
        self.pending: asyncio.Future[SendResult] | None = None
        self.route: TopicRoute | None = None
        self.loop = loop
        self.result: asyncio.Future[SendResult] = loop.create_future()
        ctx.deadlines.add(loop, loop.time() + ctx.send_timeout, self)
        self.result.add_done_callback(self._settled)

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
            self.pending = self.ctx.acc.append(
                mq.broker_name, wire.frame(self.encoded, mq.queue_id), self.nbytes
            )
        except Exception as exc:
            self._fail(exc)
            return
        self.pending.add_done_callback(self._on_outcome)

    def _on_outcome(self, fut: asyncio.Future[SendResult]) -> None:
        if self.result.done():
            return
        if fut.cancelled():
            self._fail(_closed())
            return
        exc = fut.exception()
        if exc is None:
            self.result.set_result(fut.result())
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

    def _settled(self, result: asyncio.Future[SendResult]) -> None:
        """The one clean-up, however the caller's future was settled."""
        pending = self.pending
        if pending is not None and not pending.done():
            pending.cancel()  # still queued: the accumulator drops it
        if self.ctx.hooks:  # (without hooks an ignored failure still gets asyncio's warning)
            outcome: object
            if result.cancelled():
                outcome = asyncio.CancelledError()
            else:
                outcome = result.exception() or result.result()
            run_after_hooks(self.ctx.hooks, self.msg, outcome)
        self.ctx.leave()


def _closed() -> UnavailableError:
    return UnavailableError(what="the producer", detail="it closed before the message was sent")
