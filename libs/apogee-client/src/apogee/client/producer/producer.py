"""The asyncio producer: validation, routes, queue selection, retries, batching.

Every way of sending goes through one path: the message is checked (nothing bad is ever
queued), given a unique id and compressed if large, then each attempt picks a queue and hands
the message to the :class:`~apogee.client.producer.accumulator.Accumulator`, which gathers the
messages of concurrent sends into one ``SendMessages`` request per broker. Send modes differ
only in how the caller waits:

==================  ===================================================================
``send``            awaits the result (retries included)
``send_nowait``     returns a future at once (callback optional); the same retries
``send_oneway``     returns once the message is queued; no retry, failures are logged
``send_batch``      several messages of one topic, one queue, one request; awaits
``send_ordered``    a queue chosen by sharding key; retries stay on that queue unless
                    ``failover=True`` (ordering across a failover is not kept)
==================  ===================================================================

Retries (``retries``, default 2) follow a failure whose error is ``retriable``, on a queue of
another broker when there is one, all within ``send_timeout``. Every request's latency (and
every failed request) feeds the latency fault tolerance, so brokers that are slow or down are
avoided by later sends too; a failure also refreshes the topic's route in the background.

A single message's attempts are driven by callbacks (:mod:`~apogee.client.producer.delivery`):
``send`` awaits a plain future and ``send_nowait`` creates no task, so a send costs a few
microseconds of Python besides its share of a request.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Unpack

from apogee.client._rpc import ChannelPool, NameServerClient
from apogee.client.message import Message, SendResult
from apogee.client.producer import wire
from apogee.client.producer.accumulator import Accumulator
from apogee.client.producer.config import DEFAULT_GROUP, ProducerConfig, ProducerOptions
from apogee.client.producer.delivery import (
    FRAME_OVERHEAD,
    Delivery,
    SendCallback,
    SendContext,
    run_after_hooks,
)
from apogee.client.producer.fault import FaultStrategy
from apogee.client.producer.routes import MessageQueue, RouteCache, TopicRoute
from apogee.client.producer.selector import RoundRobinSelector, shard_of
from apogee.client.producer.validation import MessageValidator, validate_batch
from apogee.common.aio import PeriodicLoop
from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    UnavailableError,
)
from apogee.common.ids import IdGenerator

log = logging.getLogger(__name__)

_State = Literal["new", "started", "closing", "closed"]


@dataclass(frozen=True, slots=True)
class ProducerStats:
    """What a producer has done so far; ``messages / requests`` is the batching achieved."""

    #: SendMessages requests made (failed ones included)
    requests: int
    #: messages carried by those requests (a retried message counts once per attempt)
    messages: int
    #: the most messages one request carried
    largest_request: int
    #: requests that failed as a whole (unreachable broker, timeout, ...)
    failed_requests: int
    #: attempts after a retriable failure
    retries: int


class Producer:
    """Sends messages; use as ``async with Producer("host:9876", group="g") as p``."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str = DEFAULT_GROUP,
        **options: Unpack[ProducerOptions],
    ) -> None:
        self.config = cfg = ProducerConfig.create(namesrv, group, options)
        self._pool = ChannelPool()
        self._namesrv = NameServerClient(cfg.namesrv, self._pool, cfg.send_timeout)
        self._routes = RouteCache(self._namesrv, cfg.clock)
        self._refresher = PeriodicLoop(
            "the route refresher", cfg.route_refresh_interval, self._routes.refresh_all
        )
        self._fault = FaultStrategy(cfg.clock, cfg.latency_fault_tolerance)
        self._selector = RoundRobinSelector(self._fault, cfg.rng)
        self._acc: Accumulator[bytes, SendResult] = Accumulator(self._send_request, cfg.batching)
        self._ids = IdGenerator()
        self._validate = MessageValidator(cfg.max_message_size)
        self._group_field = wire.group_field(cfg.group)
        self._state: _State = "new"
        self._active = 0
        self._all_done = asyncio.Event()
        self._all_done.set()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = asyncio.Event()
        self._failed_requests = 0
        self._ctx = SendContext(
            self._acc,
            self._routes,
            self._selector,
            cfg.retries,
            cfg.send_timeout,
            cfg.hooks,
            self._leave,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the background route refresh (sending starts it too)."""
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._state == "started":
            return
        if self._state != "new":
            raise RuntimeError("the producer is closed")
        self._state = "started"
        self._refresher.start()

    async def __aenter__(self) -> Producer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, timeout: float | None = None) -> None:
        """Stop taking messages, let the queued ones leave (at most ``timeout`` seconds,
        default ``close_timeout``), fail what is left, stop background tasks, close channels."""
        wait = self.config.close_timeout if timeout is None else timeout
        if self._state in ("closing", "closed"):  # closed, or being closed by another caller
            await asyncio.wait_for(self._closed.wait(), wait + 2.0)
            return
        self._state = "closing"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        try:
            await asyncio.wait_for(self._all_done.wait(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            log.warning("close: %d sends still running after the timeout", self._active)
        await self._acc.close(max(0.0, deadline - loop.time()))
        tasks = [t for t in self._ctx.route_tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        self._ctx.deadlines.cancel()
        await self._refresher.stop(timeout=1.0)
        await self._routes.close()
        await self._pool.close()
        self._state = "closed"
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._state in ("closing", "closed")

    def stats(self) -> ProducerStats:
        """Requests, messages and retries so far."""
        acc = self._acc.stats()
        return ProducerStats(
            acc.requests,
            acc.messages,
            acc.largest_request,
            self._failed_requests,
            self._ctx.retried,
        )

    def _enter(self) -> None:
        if self._active == 0:
            self._all_done.clear()
        self._active += 1

    def _leave(self) -> None:
        self._active -= 1
        waiters = self._waiters
        while waiters and self._active < self.config.max_pending:
            waiter = waiters.popleft()
            if not waiter.done():
                self._enter()  # the slot is the waiter's from now on
                waiter.set_result(None)
        if self._active == 0:
            self._all_done.set()

    async def _admit(self) -> None:
        """Count one more unsettled send, first waiting (FIFO, at most ``send_timeout``) while
        ``max_pending`` are."""
        if self._active < self.config.max_pending and not self._waiters:
            self._enter()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, self.config.send_timeout)
        except TimeoutError:
            raise DeadlineExceededError(
                what=f"waiting for room among {self.config.max_pending} unsettled sends "
                "(max_pending)",
                timeout_s=self.config.send_timeout,
            ) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._leave()  # admitted just as the caller gave up
            raise

    def _check(self, msg: Message) -> None:
        if self._state != "started":
            self._ensure_started()
        self._validate(msg)

    # -- sending -----------------------------------------------------------------------------

    async def send(self, msg: Message) -> SendResult:
        """Send ``msg`` and wait until a broker stored it."""
        self._check(msg)
        if self._active < self.config.max_pending and not self._waiters:
            self._enter()  # room: no need to wait for it
        else:
            await self._admit()
        return await self._deliver(msg, None, False, None)

    def send_nowait(
        self, msg: Message, callback: SendCallback | None = None
    ) -> asyncio.Future[SendResult]:
        """Send ``msg`` in the background; the future (and ``callback(result, error)``, if
        given) gets the outcome. Invalid messages are refused here, before anything is queued.
        Not held back by ``max_pending``: pace yourself, or await :meth:`send`."""
        if self._state != "started":
            self._ensure_started()
        self._validate(msg)
        if self._active == 0:  # _enter(), inline: this is the hot path
            self._all_done.clear()
        self._active += 1
        return self._deliver(msg, None, False, callback)

    async def send_ordered(
        self, msg: Message, sharding_key: str | bytes, failover: bool = False
    ) -> SendResult:
        """Send ``msg`` to the queue of ``sharding_key`` (the same queue for the same key while
        the route is unchanged). Retries stay on that queue; ``failover=True`` lets them move
        to another broker, giving up ordering for availability."""
        self._check(msg)
        shard_of(sharding_key)
        await self._admit()
        return await self._deliver(msg, sharding_key, failover, None)

    async def send_oneway(self, msg: Message) -> None:
        """Queue ``msg`` and return: no result, no retry; a failure is only logged."""
        await self._queue_oneway(msg)

    async def _queue_oneway(self, msg: Message) -> asyncio.Future[SendResult]:
        """:meth:`send_oneway` that returns the future of the message's one attempt (for
        callers that track it, such as the sync producer); its failure is logged regardless."""
        self._check(msg)
        await self._admit()
        try:
            route = await self._route(msg.topic)
            mq = self._selector.select(route)
            self._before(msg)
            encoded = self._encode(msg)
            fut = self._acc.append(
                mq.broker_name, wire.frame(encoded, mq.queue_id), len(encoded) + FRAME_OVERHEAD
            )
        except BaseException:
            self._leave()
            raise
        fut.add_done_callback(lambda f: self._oneway_done(msg, mq, f))
        return fut

    async def send_batch(self, msgs: Sequence[Message]) -> list[SendResult]:
        """Send messages of one topic (no delay level or delivery time, bodies within
        ``max_message_size`` together) to one queue in one request. Returns their results in
        order. If some fail for good, the first error is raised; the others may have been
        stored."""
        self._ensure_started()
        validate_batch(msgs, self.config.max_message_size, check=self._validate)
        batch = list(msgs)
        await self._admit()
        try:
            for m in batch:
                self._before(m)
            try:
                results = await self._batch_attempts(batch)
            except Exception as exc:
                for m in batch:
                    self._after(m, exc)
                raise
            for m, r in zip(batch, results, strict=True):
                self._after(m, r)
            return results
        finally:
            self._leave()

    # -- the send path -----------------------------------------------------------------------

    async def _route(self, topic: str) -> TopicRoute:
        route = self._routes.cached(topic)
        if route is None or not route.queues:
            route = await self._routes.get(topic)
        return route

    def _encode(self, msg: Message) -> bytes:
        return wire.encode(
            msg, self._ids.next_id(), self.config.clock.time_ms(), self.config.compress_over
        )

    def _deliver(
        self,
        msg: Message,
        key: str | bytes | None,
        failover: bool,
        callback: SendCallback | None,
    ) -> asyncio.Future[SendResult]:
        """Start delivering a checked and admitted ``msg``; the future settles with its outcome
        (and the send leaves the count of unsettled ones then)."""
        try:
            if self.config.hooks:
                self._before(msg)
            encoded = wire.encode(
                msg, self._ids.next_id(), self.config.clock.time_ms(), self.config.compress_over
            )
            delivery = Delivery(
                self._ctx, msg, encoded, key, failover, asyncio.get_running_loop(), callback
            )
        except BaseException:
            self._leave()
            raise
        delivery.begin()
        return delivery.result

    async def _batch_attempts(self, batch: list[Message]) -> list[SendResult]:
        cfg = self.config
        topic = batch[0].topic
        last: ApogeeError | None = None
        results: list[SendResult | None] = [None] * len(batch)
        try:
            async with asyncio.timeout(cfg.send_timeout):
                born = cfg.clock.time_ms()
                ids = self._ids.next_ids(len(batch))
                encoded = [
                    wire.encode(m, uid, born, cfg.compress_over)
                    for m, uid in zip(batch, ids, strict=True)
                ]
                route = await self._route(topic)
                todo = list(range(len(batch)))
                exclude: str | None = None
                for attempt in range(cfg.retries + 1):
                    mq = self._selector.select(route, exclude)
                    frames = [wire.frame(encoded[i], mq.queue_id) for i in todo]
                    size = sum(len(f) for f in frames)
                    failure: BaseException
                    try:
                        outs = await self._acc.append_group(mq.broker_name, frames, size)
                    except ApogeeError as err:
                        failure = err
                    else:
                        failed: list[tuple[int, BaseException]] = []
                        for i, o in zip(todo, outs, strict=True):
                            if isinstance(o, BaseException):
                                failed.append((i, o))
                            else:
                                results[i] = o
                        if not failed:
                            break
                        todo = [i for i, _ in failed]
                        failure = next((o for _, o in failed if not _retriable(o)), failed[0][1])
                    if isinstance(failure, ApogeeError):
                        last = failure
                    self._routes.refresh_soon(topic)
                    if not _retriable(failure) or attempt >= cfg.retries or self._acc.closed:
                        raise failure
                    self._ctx.retried += 1
                    exclude = mq.broker_name
                    route = self._routes.cached(topic) or route
        except TimeoutError:
            raise DeadlineExceededError(
                what=f"sending a batch of {len(batch)} messages to topic {topic!r}",
                timeout_s=cfg.send_timeout,
            ) from last
        return [r for r in results if r is not None]

    async def _send_request(
        self, broker: str, frames: list[bytes]
    ) -> list[SendResult | BaseException]:
        """One SendMessages request (the accumulator's sender); feeds the fault strategy."""
        address = self._routes.address_of(broker)
        if address is None:
            raise UnavailableError(what=f"broker {broker}", detail="no route gives its address")
        clock = self.config.clock
        start = clock.monotonic()
        try:
            resp = await self._pool.send(
                address,
                wire.request(frames, self._group_field),
                self.config.send_timeout,
                f"broker {broker} at {address}",
            )
        except ApogeeError as err:
            self._failed_requests += 1
            self._fault.update(broker, (clock.monotonic() - start) * 1000, err.retriable)
            raise
        self._fault.update(broker, (clock.monotonic() - start) * 1000, False)
        return wire.outcomes(resp, broker)

    # -- hooks and callbacks -----------------------------------------------------------------

    def _before(self, msg: Message) -> None:
        if not self.config.hooks:
            return
        for hook in self.config.hooks:
            if hook.before is not None:
                try:
                    hook.before(msg)
                except Exception:
                    log.exception("a before-send hook failed")

    def _after(self, msg: Message, outcome: SendResult | BaseException) -> None:
        run_after_hooks(self.config.hooks, msg, outcome)

    def _oneway_done(self, msg: Message, mq: MessageQueue, fut: asyncio.Future[SendResult]) -> None:
        self._leave()
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            self._after(msg, fut.result())
            return
        log.warning("oneway send to %s of topic %s failed: %s", mq.broker_name, msg.topic, exc)
        self._after(msg, exc)
        if not self.closed:
            self._routes.refresh_soon(msg.topic)


def _retriable(exc: BaseException) -> bool:
    return isinstance(exc, ApogeeError) and exc.retriable
