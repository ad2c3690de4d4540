"""The transactional producer, as RocketMQ's ``TransactionMQProducer``.

::

    async def place_order(msg: TransactionMessage, order: Order) -> TransactionDecision:
        await db.insert(order, txn_id=msg.transaction_id)  # the local transaction
        return TransactionDecision.COMMIT

    async def was_placed(msg: TransactionCheckMessage) -> TransactionDecision:
        found = await db.order_of_txn(msg.transaction_id)
        return TransactionDecision.COMMIT if found else TransactionDecision.ROLLBACK

    async with TransactionProducer(namesrv, "orders", check_listener=was_placed) as producer:
        result = await producer.send_in_transaction(Message("Orders", b"..."), place_order, order)

:meth:`TransactionProducer.send_in_transaction`:

1. checks the message: the rules of every message, and one message, not delayed, none of the
   properties brokers put on halves (:func:`~apogee.client.producer.txn_model.
   check_transactional`); nothing is sent when it breaks one;
2. stores it as a *half* (``Transaction.SendHalf``) on a queue of its topic chosen as any send's
   (round robin, avoiding slow or failed brokers); a retriable failure is tried again on another
   broker (``retries``, all within ``send_timeout``), with the same unique id, the transaction
   id. Consumers never see a half;
3. runs ``executor(message, arg)``, the local transaction, with a copy of the message carrying
   its ``transaction_id``: a plain function is called on the event loop, an async one awaited
   at most ``executor_timeout``. It returns a :class:`~apogee.client.TransactionDecision`; one
   that raises, runs late or returns anything else counts as UNKNOWN, with a warning;
4. ends the transaction at the half's broker (``EndTransaction``, source PRODUCER) when the
   decision is COMMIT or ROLLBACK, retrying retriable failures within ``send_timeout``. An
   UNKNOWN transaction is not ended, and an end that failed is logged: either way the half
   stays at the broker, whose checks ask the group's producers later (the result's
   ``end_outcome`` says NOT_ENDED or FAILED, ``pending`` is true), so nothing is lost.

A retried SendHalf after a broken call may have stored the half on both brokers; the copy not
ended is then checked, and a listener that answers COMMIT stores the message a second time,
with the same unique id (sends are at-least-once).

Checks reach the producer on its session streams (:mod:`~apogee.client.producer.txn_session`):
one with every broker it sent a half to and every broker of its cached routes and of its
``topics`` option; :mod:`~apogee.client.producer.txn_checks` answers them with the check
listener. A transactional producer is also a :class:`~apogee.client.Producer`: it sends ordinary
messages as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar, Unpack, cast

from opentelemetry.trace import use_span

from apogee.client.consumer.config import CLIENT_ID_RE, default_client_id
from apogee.client.message import Message
from apogee.client.producer.config import ProducerOptions, _integer, _number
from apogee.client.producer.delivery import run_after_hooks
from apogee.client.producer.producer import Producer
from apogee.client.producer.send_spans import start_send, trace_properties, without_trace
from apogee.client.producer.txn_calls import TransactionCalls, TransactionCallStats
from apogee.client.producer.txn_checks import CheckRunner, CheckStats
from apogee.client.producer.txn_model import (
    CheckListener,
    HalfSent,
    TransactionDecision,
    TransactionExecutor,
    TransactionMessage,
    TransactionResult,
    check_transactional,
    end_request,
    error_text,
    half_message,
    run_executor,
    transaction_result,
)
from apogee.client.producer.txn_session import KEEP_EVERY, ProducerSessions, SessionKeeper
from apogee.client.producer.validation import MessageValidator
from apogee.common import tracing
from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    InvalidArgumentError,
    InvalidQueueIdError,
    UnavailableError,
)
from apogee.common.settings import doc
from apogee.v1 import transaction_pb2, transaction_pb2_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")
if TYPE_CHECKING:
    _TxnStub = transaction_pb2_grpc.TransactionAsyncStub
#: Pause before trying EndTransaction again after a retriable failure (seconds).
_END_RETRY_PAUSE = 0.1


class TransactionOptions(ProducerOptions, total=False):
    """Keyword options of a transactional producer: a producer's, and those of
    :class:`TransactionConfig`."""

    check_timeout: float
    max_concurrent_checks: int
    executor_timeout: float
    heartbeat_interval: float
    client_id: str
    topics: Sequence[str]


@dataclass(frozen=True, slots=True)
class TransactionConfig:
    """What a transactional producer adds to a producer's options."""

    check_timeout: float = doc(
        10.0,
        "Seconds a check may wait for a listener slot, and the check listener may take; then "
        "the answer is UNKNOWN (the broker asks again).",
    )
    max_concurrent_checks: int = doc(
        16, "Check listener calls at once (and threads for a plain-function listener)."
    )
    executor_timeout: float = doc(
        60.0,
        "Seconds an async executor may take before it is cancelled and its decision is "
        "UNKNOWN (a plain function is not interrupted).",
    )
    heartbeat_interval: float = doc(
        30.0, "Seconds between heartbeats on the session with each broker."
    )
    client_id: str = doc(
        "", "This producer's id among its group's producers; default host@pid@random."
    )
    topics: tuple[str, ...] = doc(
        (),
        "Topics whose brokers get a session from the start (for checks of transactions a "
        "previous run left open); the brokers of every topic sent to get one anyway.",
    )

    def __post_init__(self) -> None:
        _number("check_timeout", self.check_timeout, 0, above=True)
        _integer("max_concurrent_checks", self.max_concurrent_checks, 1)
        _number("executor_timeout", self.executor_timeout, 0, above=True)
        _number("heartbeat_interval", self.heartbeat_interval, 0, above=True)
        if not self.client_id:
            object.__setattr__(self, "client_id", default_client_id())
        elif not isinstance(self.client_id, str) or not CLIENT_ID_RE.fullmatch(self.client_id):
            raise InvalidArgumentError(
                field="client_id",
                rule=f"{self.client_id!r} must be 1 to 255 characters from [a-zA-Z0-9_.@:%|-]",
            )
        topics: Any = self.topics
        if not isinstance(topics, tuple) or not all(isinstance(t, str) for t in topics):
            raise InvalidArgumentError(
                field="topics", rule=f"must be a sequence of topic names, got {self.topics!r}"
            )

    @classmethod
    def split(cls, options: TransactionOptions) -> tuple[TransactionConfig, ProducerOptions]:
        """This config from ``options``, and the producer's options that are left."""
        own = {f.name for f in fields(cls)}
        mine: dict[str, Any] = {k: v for k, v in options.items() if k in own}
        rest = {k: v for k, v in options.items() if k not in own}
        topics = mine.get("topics")
        if isinstance(topics, str):
            mine["topics"] = (topics,)
        elif topics is not None and not isinstance(topics, tuple):
            with contextlib.suppress(TypeError):  # else refused by __post_init__
                mine["topics"] = tuple(topics)
        return cls(**mine), cast(ProducerOptions, rest)


def validate_transactional(msg: object, validate: MessageValidator) -> Message:
    """``msg`` when it may be sent in a transaction; else the error of the first rule it
    breaks (the transactional rules first, then those of every message)."""
    check_transactional(msg)
    validate(msg)  # type: ignore[arg-type]
    return cast(Message, msg)


def executor_message(msg: Message, uid: str) -> TransactionMessage:
    """The copy of ``msg`` an executor gets: the same fields, and the transaction id."""
    return TransactionMessage(
        msg.topic,
        msg.body,
        msg.tags,
        msg.keys,
        msg.properties,
        msg.delay_level,
        msg.deliver_at,
        transaction_id=uid,
    )


class TransactionProducer(Producer):
    """Sends messages in transactions; use as ``async with TransactionProducer("host:9876",
    "group", check_listener=...) as p``. See the module docstring."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str,
        check_listener: CheckListener | None = None,
        **options: Unpack[TransactionOptions],
    ) -> None:
        if check_listener is not None and not callable(check_listener):
            raise TypeError(
                f"check_listener must be callable or None, got {type(check_listener).__name__}"
            )
        txn, rest = TransactionConfig.split(options)
        super().__init__(namesrv, group, **rest)
        self.txn_config = txn
        cfg = self.config
        self._calls = TransactionCalls(self._pool, cfg.group, cfg.batching, cfg.send_timeout)
        self._checks = CheckRunner(
            check_listener,
            cfg.group,
            txn.client_id,
            self._end_call,
            max_concurrent=txn.max_concurrent_checks,
            timeout=txn.check_timeout,
            end_timeout=cfg.send_timeout,
            clock=cfg.clock,
        )
        hello = transaction_pb2.ProducerHello(
            producer_group=cfg.group,
            client_id=txn.client_id,
            heartbeat_interval_ms=round(txn.heartbeat_interval * 1000),
        )
        self._sessions = ProducerSessions(
            self._pool, hello, txn.heartbeat_interval, self._checks.submit, cfg.clock, cfg.rng
        )
        self._keeper = SessionKeeper(
            self._routes,
            self._sessions,
            txn.topics,
            cfg.clock,
            min(KEEP_EVERY, cfg.route_refresh_interval),
        )
        self._txn_closing = False
        #: the route whose brokers were last given a session (a route is a new object when it
        #: changes)
        self._sessions_route: object = None

    @property
    def client_id(self) -> str:
        """This producer's id among its group's producers (what the brokers list)."""
        return self.txn_config.client_id

    def check_stats(self) -> CheckStats:
        """The checks received and answered so far."""
        return self._checks.stats

    def transaction_stats(self) -> TransactionCallStats:
        """The halves and ends sent so far, and the requests that carried them."""
        return self._calls.stats()

    # -- lifecycle ---------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._txn_closing:
            raise RuntimeError("the producer is closed")
        super()._ensure_started()
        self._keeper.start()

    async def __aenter__(self) -> TransactionProducer:
        await self.start()
        return self

    async def close(self, timeout: float | None = None) -> None:
        """End the sessions (no more checks), cancel the checks running (within about 2 s
        each), then close as a producer: transactional sends still running get up to
        ``timeout`` (default ``close_timeout``) to finish."""
        if not self._txn_closing:
            self._txn_closing = True
            await self._keeper.stop()
            await self._sessions.stop()
            await self._checks.close()
        await super().close(timeout)
        await self._calls.close(0.5)  # nothing is queued any more: the sends have ended

    # -- sending in a transaction ------------------------------------------------------------

    async def send_in_transaction(
        self, message: Message, executor: TransactionExecutor, arg: Any = None
    ) -> TransactionResult:
        """Send ``message`` as a half, run ``executor(message, arg)`` and end the transaction as
        it decides (see the module docstring). Raises when the message is refused or its half
        could not be stored (the executor did not run then); after that, returns a result
        whatever happens to the end."""
        msg = self._prepare(message, executor)
        if self._tracer is not None:
            return await self._send_traced(msg, executor, arg)
        half = await self._open(msg)
        try:
            decision, why = await run_executor(
                executor, half.message, arg, self.txn_config.executor_timeout
            )
        except BaseException:
            self._leave()
            raise
        return await self._settle(half, decision, why)

    async def _send_traced(
        self, msg: Message, executor: TransactionExecutor, arg: Any
    ) -> TransactionResult:
        """:meth:`send_in_transaction` under a ``send <topic>`` span (this producer traces):
        the half carries the span's context, so the real message, the checks and everything
        after them join the trace; the span ends when the transaction is ended (or left to
        the checks)."""
        assert self._tracer is not None
        uid = self._ids.next_id()
        span = start_send(self._tracer, msg, uid, self.config.group)
        try:
            half = await self._open(without_trace(msg), uid, trace_properties(span))
            try:
                with use_span(span, end_on_exit=False):  # the local transaction's spans join
                    decision, why = await run_executor(
                        executor, half.message, arg, self.txn_config.executor_timeout
                    )
            except BaseException:
                self._leave()
                raise
            result = await self._settle(half, decision, why)
        except BaseException as exc:
            tracing.failed(span, exc)
            span.end()
            raise
        span.set_attributes(
            {
                tracing.BROKER: result.broker_name,
                tracing.PARTITION: str(half.queue_id),
                tracing.TRANSACTION_ID: result.transaction_id,
                tracing.TRANSACTION_OUTCOME: result.end_outcome.value,
            }
        )
        span.end()
        return result

    def _prepare(self, message: object, executor: object) -> Message:
        """Check the message and the executor, before anything is sent."""
        if self._state != "started" or self._txn_closing:
            self._ensure_started()
        msg = validate_transactional(message, self._validate)
        if not callable(executor):
            raise TypeError(f"executor must be callable, got {type(executor).__name__}")
        return msg

    async def _open(
        self, msg: Message, uid: str = "", trace: Mapping[str, str] | None = None
    ) -> HalfSent:
        """Count the send among the unsettled ones and store its half; the count is left again
        when this raises, else by :meth:`_settle` (or the caller, when it gives up between)."""
        if self._txn_closing:
            raise RuntimeError("the producer is closed")
        await self._admit()
        try:
            return await self._send_half(msg, uid, trace)
        except BaseException as exc:
            if self._metrics is not None:
                self._metrics.failed(exc)
            self._leave()
            raise

    async def _settle(
        self, half: HalfSent, decision: TransactionDecision, why: str
    ) -> TransactionResult:
        """End the transaction of ``half`` as decided and shape the result; leaves the count of
        unsettled sends."""
        try:
            if decision is TransactionDecision.UNKNOWN:
                log.debug(
                    "transaction %s is UNKNOWN: not ended; broker %s will check it",
                    half.unique_id,
                    half.broker_name,
                )
                return self._counted(transaction_result(half, decision, why, None))
            end = await self._end_transaction(half, decision)
            return self._counted(transaction_result(half, decision, why, end))
        finally:
            self._leave()

    def _counted(self, result: TransactionResult) -> TransactionResult:
        if self._metrics is not None:  # apogee_client_transactions_total
            self._metrics.transaction(result.end_outcome.value)
        return result

    async def _send_half(
        self, msg: Message, uid: str = "", trace: Mapping[str, str] | None = None
    ) -> HalfSent:
        """Store ``msg`` as a half on a queue of its topic (retries on other brokers), with
        ``uid`` (default: a new one) and the trace properties ``trace``."""
        cfg = self.config
        topic = msg.topic
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.send_timeout
        uid = uid or self._ids.next_id()
        self._before(msg)
        born = cfg.clock.time_ms()
        exclude: str | None = None
        fresh = False
        attempt = 0
        last: ApogeeError | None = None
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise DeadlineExceededError(
                        what=f"sending a transactional message to topic {topic!r}",
                        timeout_s=cfg.send_timeout,
                    ) from last
                route = None if fresh else self._routes.cached(topic)
                if route is None or not route.queues:
                    try:
                        async with asyncio.timeout(remaining):
                            route = await (
                                self._routes.fetch(topic) if fresh else self._route(topic)
                            )
                    except TimeoutError:
                        continue  # the deadline passed: raised above
                if route is not self._sessions_route:
                    for name, at in route.addresses.items():
                        self._sessions.ensure(name, at)
                    self._sessions_route = route
                mq = self._selector.select(route, exclude)
                address = self._routes.address_of(mq.broker_name)
                if address is None:
                    raise UnavailableError(
                        what=f"broker {mq.broker_name}", detail="no route gives its address"
                    )
                message = half_message(msg, uid, mq.queue_id, born, cfg.compress_over)
                if trace:
                    message.properties.update(trace)
                start = cfg.clock.monotonic()
                try:
                    resp = await self._calls.send_half(mq.broker_name, address, message, remaining)
                except ApogeeError as err:
                    elapsed_ms = (cfg.clock.monotonic() - start) * 1000
                    self._fault.update(mq.broker_name, elapsed_ms, err.retriable)
                    last = err
                    fresh = isinstance(err, InvalidQueueIdError)  # the route is stale
                    if not fresh:
                        self._routes.refresh_soon(topic)
                    if not (err.retriable or fresh) or attempt >= cfg.retries:
                        raise
                    attempt += 1
                    self._ctx.retried += 1
                    if not fresh:
                        exclude = mq.broker_name
                    log.debug("SendHalf to %s failed, trying again: %s", mq.broker_name, err)
                    continue
                self._fault.update(mq.broker_name, (cfg.clock.monotonic() - start) * 1000, False)
                broker = resp.broker_name or mq.broker_name
                half = HalfSent(
                    executor_message(msg, resp.unique_id or uid),
                    resp.unique_id or uid,
                    broker,
                    address,
                    topic,
                    resp.queue_id,
                    resp.half_offset,
                    resp.store_timestamp_ms,
                )
                break
        except BaseException as exc:
            if cfg.hooks:
                run_after_hooks(cfg.hooks, msg, exc)
            raise
        if cfg.hooks:
            run_after_hooks(cfg.hooks, msg, half.send_result())
        return half

    async def _end_transaction(
        self, half: HalfSent, decision: TransactionDecision
    ) -> transaction_pb2.EndTransactionResponse | Exception:
        """End ``half``'s transaction at its broker (retriable failures tried again within
        ``send_timeout``); the answer, or the failure (logged)."""
        cfg = self.config
        request = end_request(
            cfg.group,
            half.unique_id,
            half.half_offset,
            decision,
            transaction_pb2.PRODUCER,
            self.client_id,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.send_timeout
        attempt = 0
        while True:
            remaining = deadline - loop.time()
            address = self._routes.address_of(half.broker_name) or half.address
            try:
                return await self._end_call(half.broker_name, address, request, remaining)
            except Exception as exc:
                retriable = isinstance(exc, ApogeeError) and exc.retriable
                left = deadline - loop.time()
                if retriable and attempt < cfg.retries and left > _END_RETRY_PAUSE:
                    attempt += 1
                    log.debug("ending transaction %s failed, trying again: %s", half.unique_id, exc)
                    await asyncio.sleep(_END_RETRY_PAUSE)
                    continue
                log.warning(
                    "ending transaction %s (%s) at broker %s failed: %s; the broker's checks "
                    "will resolve it",
                    half.unique_id,
                    decision.value,
                    half.broker_name,
                    error_text(exc),
                    exc_info=not isinstance(exc, ApogeeError),
                )
                return exc

    # -- calls -------------------------------------------------------------------------------

    async def _end_call(
        self,
        broker: str,
        address: str,
        request: transaction_pb2.EndTransactionRequest,
        timeout: float,
    ) -> transaction_pb2.EndTransactionResponse:
        return await self._calls.end(broker, address, request, timeout)
