"""The asyncio producer: validation, routes, queue selection, retries, batching.

Every way of sending goes through one path: the message is checked (nothing bad is ever
queued), given a unique id, compressed if large and encoded once as a send record
(:mod:`~apogee.client.producer.wire`); one state machine (:class:`~apogee.client.producer.
delivery.Delivery`) then drives its attempts: each picks a queue and hands the records to the
:class:`~apogee.client.producer.accumulator.Accumulator`, which gathers the messages of
concurrent sends into one request per broker, sent on a small pool of streams
(``send_streams``). Send modes differ only in how the queue is chosen, whether they retry and
how the caller waits:

==================  ===================================================================
``send``            awaits the result (retries included)
``send_nowait``     returns a future at once (callback optional); the same retries
``send_oneway``     returns once the message is queued; no retry, failures are logged;
                    no future and no result object
``send_batch``      several messages of one topic, one queue, one request; one future
                    for the batch; retries the messages that failed
``send_ordered``    a queue chosen by sharding key; retries stay on that queue unless
                    ``failover=True`` (ordering across a failover is not kept). The key is
                    the message's message group (property ``__SHARDINGKEY``; a bytes key
                    as hex), so the message is a FIFO message, for FIFO and MIXED topics
==================  ===================================================================

Retries (``retries``, default 2) follow a failure whose error is ``retriable``, on a queue of
another broker when there is one, all within ``send_timeout``. Every request's latency (and
every failed request) feeds the latency fault tolerance, so brokers that are slow or down are
avoided by later sends too; a failure also refreshes the topic's route in the background.

A failure after the request may have reached its broker (:mod:`~apogee.client.producer.
outcome`) leaves the outcome unknown: the send's error says the message may have been stored,
with its id (``err.outcome_unknown``, ``err.message_id``), and a plain send is not tried again.
An idempotent producer (``idempotent=True``) gives every message the property
``APOGEE_DEDUP_ID`` (its own, else its message id) and sends it to the queue that id hashes to,
so that its retries, and the application's (``send(msg, message_id=err.message_id)``), are
stored once by the broker's dedup window.

A request settles with per-request work: its answer is read once (queue offsets packed, one
store timestamp) and each delivery takes its outcome from it; a send costs its delivery and a
future only where the caller waits on one.

A producer that traces (``tracer_provider``, or an application-wide OpenTelemetry setup: see
docs/tracing.md) gives each message a send span whose context its record carries
(:mod:`~apogee.client.producer.send_spans`); one that does not holds no tracer, and each send
checks for one once. Likewise a producer given a ``metrics_registry`` counts its sends
(:mod:`apogee.client.metrics`: one update as each send settles); one that is not holds no
metrics object.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, Unpack, cast

from apogee.client._rpc import ChannelPool, NameServerClient
from apogee.client.message import Message, SendResult
from apogee.client.producer import wire
from apogee.client.producer.accumulator import Accumulator
from apogee.client.producer.config import DEFAULT_GROUP, ProducerConfig, ProducerOptions
from apogee.client.producer.delivery import (
    Delivery,
    SendCallback,
    SendContext,
    run_after_hooks,
)
from apogee.client.producer.fault import FaultStrategy
from apogee.client.producer.outcome import (
    RequestFailed,
    check_message_id,
    dedup_of,
    may_have_reached,
    record_dedup,
)
from apogee.client.producer.routes import RouteCache, TopicRoute
from apogee.client.producer.selector import RoundRobinSelector, shard_of
from apogee.client.producer.send_spans import (
    TracedDelivery,
    abandon,
    encode_batch_traced,
    encode_traced,
)
from apogee.client.producer.validation import MessageValidator, validate_batch
from apogee.codec import PROP_SHARDING_KEY
from apogee.common import tracing
from apogee.common.aio import PeriodicLoop
from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    InvalidArgumentError,
    UnavailableError,
)
from apogee.common.ids import IdGenerator

if TYPE_CHECKING:
    from apogee.client.metrics import ProducerMetrics

log = logging.getLogger(__name__)

_State = Literal["new", "started", "closing", "closed"]


@dataclass(frozen=True, slots=True)
class ProducerStats:
    """What a producer has done so far; ``messages / requests`` is the batching achieved."""

    #: send requests made (failed ones included)
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
        self._pool = ChannelPool(cfg.security)
        self._namesrv = NameServerClient(cfg.namesrv, self._pool, cfg.send_timeout)
        self._routes = RouteCache(self._namesrv, cfg.clock)
        self._refresher = PeriodicLoop(
            "the route refresher", cfg.route_refresh_interval, self._routes.refresh_all
        )
        self._fault = FaultStrategy(cfg.clock, cfg.latency_fault_tolerance)
        self._selector = RoundRobinSelector(self._fault, cfg.rng)
        self._acc: Accumulator[bytearray, SendResult] = Accumulator(
            self._send_request, cfg.batching
        )
        self._ids = IdGenerator()
        self._validate = MessageValidator(cfg.max_message_size)
        self._group_field = wire.group_field(cfg.group)
        #: None unless this producer traces (see apogee.client.producer.send_spans)
        self._tracer = tracing.client_tracer(cfg.tracer_provider, "apogee.client.producer")
        self._state: _State = "new"
        self._active = 0
        self._all_done = asyncio.Event()
        self._all_done.set()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = asyncio.Event()
        self._failed_requests = 0
        #: None unless this producer counts metrics (see apogee.client.metrics)
        self._metrics = _metrics_of(self)
        self._ctx = SendContext(
            self._acc,
            self._routes,
            self._selector,
            cfg.retries,
            cfg.send_timeout,
            cfg.hooks,
            self._leave,
            metrics=self._metrics,
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

    async def send(self, msg: Message, *, message_id: str | None = None) -> SendResult:
        """Send ``msg`` and wait until a broker stored it. ``message_id`` (idempotent producers
        only): send it under this id, the one of an earlier send whose outcome is unknown
        (``err.message_id``), so that the broker stores it once."""
        self._check(msg)
        if message_id is not None:
            self._check_id("message_id", message_id)
        if self._active < self.config.max_pending and not self._waiters:
            self._enter()  # room: no need to wait for it
        else:
            await self._admit()
        return await self._deliver(msg, None, False, None, message_id)

    def send_nowait(
        self,
        msg: Message,
        callback: SendCallback | None = None,
        *,
        message_id: str | None = None,
    ) -> asyncio.Future[SendResult]:
        """Send ``msg`` in the background; the future (and ``callback(result, error)``, if
        given) gets the outcome. Invalid messages are refused here, before anything is queued.
        Not held back by ``max_pending``: pace yourself, or await :meth:`send`.
        ``message_id``: as :meth:`send`'s."""
        if self._state != "started":
            self._ensure_started()
        self._validate(msg)
        if message_id is not None:
            self._check_id("message_id", message_id)
        if self._active == 0:  # _enter(), inline: this is the hot path
            self._all_done.clear()
        self._active += 1
        return self._deliver(msg, None, False, callback, message_id)

    async def send_ordered(
        self,
        msg: Message,
        sharding_key: str | bytes,
        failover: bool = False,
        *,
        message_id: str | None = None,
        fifo: bool = True,
    ) -> SendResult:
        """Send ``msg`` to the queue of ``sharding_key`` (the same queue for the same key while
        the route is unchanged). Retries stay on that queue; ``failover=True`` lets them move
        to another broker, giving up ordering for availability (an idempotent send's retries
        stay once an attempt may have stored it). ``message_id``: as :meth:`send`'s.

        The message sent is a copy of ``msg`` whose message group (the property
        ``__SHARDINGKEY``, RocketMQ's) is the key (a bytes key: its hex): a FIFO message, which
        FIFO and MIXED topics accept. ``fifo=False``: the key only picks the queue, and the
        message stays of its own type (a replayed copy reaches the broker that deduplicates
        it, as the Spark sink needs)."""
        self._check(msg)
        shard_of(sharding_key)
        if fifo:
            msg = with_message_group(msg, sharding_key)
        self._validate(msg)
        if message_id is not None:
            self._check_id("message_id", message_id)
        await self._admit()
        return await self._deliver(msg, sharding_key, failover, None, message_id)

    async def send_oneway(self, msg: Message) -> None:
        """Queue ``msg`` and return: no result, no retry; a failure is only logged."""
        await self._queue_oneway(msg)

    async def _queue_oneway(
        self, msg: Message, on_settled: Callable[[], None] | None = None
    ) -> None:
        """:meth:`send_oneway`, calling ``on_settled()`` once the message's one attempt has its
        outcome (for callers that track it, such as the sync producer). Its route is looked up
        first, so an unknown topic is raised here."""
        self._check(msg)
        await self._admit()
        span = None
        try:
            await self._route(msg.topic)
            self._before(msg)
            uid = self._ids.next_id()
            dedup, dedup_key = how = self._dedup_of(msg, uid)
            if self._tracer is None:
                record = self._encode(msg, uid, how)
                cls = Delivery
            else:
                record, span = encode_traced(self._tracer, self.config, msg, uid, record_dedup(how))
                cls = TracedDelivery
            delivery = cls(
                self._ctx,
                [msg],
                [record],
                [uid],
                asyncio.get_running_loop(),
                oneway=True,
                future=False,
                on_settled=on_settled,
                dedup=dedup,
                dedup_key=dedup_key,
            )
            if span is not None:
                cast(TracedDelivery, delivery).span = span
        except BaseException as exc:
            abandon(span, exc)
            self._leave()
            raise
        delivery.begin()

    async def send_batch(
        self, msgs: Sequence[Message], *, message_ids: Sequence[str] | None = None
    ) -> list[SendResult]:
        """Send messages of one topic (no delay level or delivery time, bodies within
        ``max_message_size`` together) to one queue in one request. Returns their results in
        order. If some fail for good, the first error is raised; the others may have been
        stored. ``message_ids`` (idempotent producers only): the messages' ids, those of an
        earlier batch whose outcome is unknown (``err.message_ids``)."""
        self._ensure_started()
        validate_batch(msgs, self.config.max_message_size, check=self._validate)
        batch = list(msgs)
        if message_ids is not None:
            given = list(message_ids)
            if len(given) != len(batch):
                raise InvalidArgumentError(
                    field="message_ids",
                    rule=f"must give one id per message: {len(given)} for {len(batch)}",
                )
            for uid in given:
                self._check_id("message_ids", uid)
        await self._admit()
        span = None
        try:
            for m in batch:
                self._before(m)
            cfg = self.config
            born = cfg.clock.time_ms()
            ids = given if message_ids is not None else self._ids.next_ids(len(batch))
            dedups = [self._dedup_of(m, uid) for m, uid in zip(batch, ids, strict=True)]
            dedup = ""  # idempotent: the batch goes to the queue its first dedup id hashes to
            if cfg.idempotent:
                dedup = "own" if all(mode == "own" for mode, _ in dedups) else "id"
            if self._tracer is None:
                records = [
                    wire.encode(m, uid, born, cfg.compress_over, dedup=record_dedup(d))
                    for m, uid, d in zip(batch, ids, dedups, strict=True)
                ]
                cls = Delivery
            else:
                records, span = encode_batch_traced(
                    self._tracer, self.config, batch, ids, born, [record_dedup(d) for d in dedups]
                )
                cls = TracedDelivery
            delivery = cls(
                self._ctx,
                batch,
                records,
                ids,
                asyncio.get_running_loop(),
                batch=True,
                dedup=dedup,
                dedup_key=dedups[0][1],
            )
            if span is not None:
                cast(TracedDelivery, delivery).span = span
        except BaseException as exc:
            abandon(span, exc)
            self._leave()
            raise
        delivery.begin()
        assert delivery.result is not None
        results: list[SendResult] = await delivery.result
        return results

    # -- the send path -----------------------------------------------------------------------

    async def _route(self, topic: str) -> TopicRoute:
        route = self._routes.cached(topic)
        if route is None or not route.queues:
            route = await self._routes.get(topic)
        return route

    def _check_id(self, field: str, uid: object) -> None:
        check_message_id(field, uid, self.config.idempotent)

    def _dedup_of(self, msg: Message, uid: str) -> tuple[str, str]:
        return dedup_of(msg, uid) if self.config.idempotent else ("", "")

    def _encode(self, msg: Message, uid: str, dedup: tuple[str, str]) -> bytearray:
        cfg = self.config
        return wire.encode(
            msg, uid, cfg.clock.time_ms(), cfg.compress_over, dedup=record_dedup(dedup)
        )

    def _deliver(
        self,
        msg: Message,
        key: str | bytes | None,
        failover: bool,
        callback: SendCallback | None,
        message_id: str | None = None,
    ) -> asyncio.Future[SendResult]:
        """Start delivering a checked and admitted ``msg`` (under ``message_id``, else a new
        id); the future settles with its outcome (and the send leaves the count of unsettled
        ones then)."""
        if self._tracer is not None:
            return self._deliver_traced(msg, key, failover, callback, message_id)
        try:
            if self.config.hooks:
                self._before(msg)
            uid = message_id or self._ids.next_id()
            dedup, dedup_key = how = self._dedup_of(msg, uid)
            record = self._encode(msg, uid, how)
            delivery = Delivery(
                self._ctx,
                [msg],
                [record],
                [uid],
                asyncio.get_running_loop(),
                key=key,
                failover=failover,
                callback=callback,
                dedup=dedup,
                dedup_key=dedup_key,
            )
        except BaseException:
            self._leave()
            raise
        delivery.begin()
        assert delivery.result is not None
        return delivery.result

    # -- the send path of a tracing producer (see send_spans) ---------------------------------

    def _deliver_traced(
        self,
        msg: Message,
        key: str | bytes | None,
        failover: bool,
        callback: SendCallback | None,
        message_id: str | None,
    ) -> asyncio.Future[SendResult]:
        """:meth:`_deliver` with the message's send span, which its delivery ends."""
        span = None
        try:
            if self.config.hooks:
                self._before(msg)
            uid = message_id or self._ids.next_id()
            dedup, dedup_key = how = self._dedup_of(msg, uid)
            record, span = encode_traced(self._tracer, self.config, msg, uid, record_dedup(how))
            delivery = TracedDelivery(
                self._ctx,
                [msg],
                [record],
                [uid],
                asyncio.get_running_loop(),
                key=key,
                failover=failover,
                callback=callback,
                dedup=dedup,
                dedup_key=dedup_key,
            )
            delivery.span = span
        except BaseException as exc:
            abandon(span, exc)
            self._leave()
            raise
        delivery.begin()
        assert delivery.result is not None
        return delivery.result

    async def _send_request(self, broker: str, records: list[bytearray]) -> wire.Answer:
        """One request of send records (the accumulator's sender); feeds the fault strategy.
        A failure is raised as :class:`RequestFailed`, which says whether the request may have
        reached the broker."""
        address = self._routes.address_of(broker)
        if address is None:
            error = UnavailableError(what=f"broker {broker}", detail="no route gives its address")
            raise RequestFailed(error, reached=False)
        clock = self.config.clock
        start = clock.monotonic()
        try:
            resp = await self._pool.send(
                address,
                wire.request(records, self._group_field),
                self.config.send_timeout,
                f"broker {broker} at {address}",
                streams=self.config.send_streams,
            )
        except ApogeeError as err:
            self._failed_requests += 1
            self._fault.update(broker, (clock.monotonic() - start) * 1000, err.retriable)
            raise RequestFailed(err, may_have_reached(err)) from err
        self._fault.update(broker, (clock.monotonic() - start) * 1000, False)
        return wire.Answer(resp, broker)

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


def _metrics_of(producer: Producer) -> ProducerMetrics | None:
    """The producer's metrics when it was given a registry (importing prometheus_client only
    then: the SDK does not depend on it)."""
    cfg = producer.config
    if cfg.metrics_registry is None:
        return None
    from apogee.client.metrics import ProducerMetrics  # noqa: PLC0415 - only when asked for

    # the gauge of sends in flight reads the producer's count when scraped
    return ProducerMetrics(cfg.metrics_registry, cfg.group, lambda: producer._active)


def with_message_group(msg: Message, sharding_key: str | bytes) -> Message:
    """A copy of ``msg`` whose message group (property ``__SHARDINGKEY``) is ``sharding_key``
    (bytes: its hex); a text key holding a separator of the stored properties is refused."""
    group = sharding_key.hex() if isinstance(sharding_key, bytes) else sharding_key
    if "\x01" in group or "\x02" in group:
        raise InvalidArgumentError(
            field="sharding_key",
            rule=f"must not contain \\x01 or \\x02: it is the message group "
            f"({PROP_SHARDING_KEY}); pass bytes for a binary key",
        )
    return replace(msg, properties={**msg.properties, PROP_SHARDING_KEY: group})
