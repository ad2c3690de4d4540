"""The push consumer: a listener called with the messages of the subscribed topics.

::

    async def handle(messages: list[ReceivedMessage]) -> ConsumeResult | None:
        ...  # return None or SUCCESS when done; raise or return RETRY_LATER to retry

    async with PushConsumer("127.0.0.1:9876", "orders-app", handle) as consumer:
        consumer.subscribe("Orders", "created || paid")
        await consumer.start()
        ...

The listener may be an ``async def`` (run as tasks on the consumer's event loop) or a plain
function (run on a thread pool of ``consume_concurrency`` threads). It gets up to
``consume_batch_size`` messages of one queue at a time.

*Concurrent* (the default): up to ``consume_concurrency`` listener calls run at once, in any
order. *Orderly* (``orderly=True``): each queue is locked at its broker and its messages are
handed over one call at a time, in queue order; different queues still run in parallel.

A listener call fails when it raises, returns :attr:`ConsumeResult.RETRY_LATER`, or runs past
``consume_timeout``. What happens next (see :mod:`apogee.client.consumer.retry`):

- *clustering, concurrent*: the messages are sent back to their broker, which delivers them
  again through ``%RETRY%<group>`` after a growing delay (``first_retry_delay_level``, then one
  level more per retry) and, after ``max_reconsume_times`` retries, moves them to
  ``%DLQ%<group>``. A message counts as done for its queue's offset once its broker has stored
  it again. When the send-back fails, the message is handed to the listener again locally after
  ``retry_delay`` (doubling up to ``max_retry_delay``), and sent back again if it fails again.
- *orderly*: the queue waits and the same messages are handed over again (``retry_delay``,
  doubling), in order; after ``max_reconsume_times`` local retries they go to the dead-letter
  topic and the queue moves on (if that fails too, the local retries go on).
- *broadcasting*: there is no retry topic: the messages are retried locally up to
  ``max_reconsume_times`` times, then dropped with a warning naming them.

In every case the queue's committed offset does not pass a message that is not done.

A consumer that traces (``tracer_provider``, see docs/tracing.md) runs each listener call under
a process span, the current span inside the listener (:mod:`apogee.client.consumer.spans`). One
that counts metrics (``metrics_registry``, :mod:`apogee.client.metrics`) times each call and
counts its messages: ok when it succeeded, else retried or failed once their fate is known.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import enum
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Unpack

from opentelemetry import trace
from opentelemetry.trace import Tracer

from apogee.client.consumer.base import ConsumerBase
from apogee.client.consumer.config import ConsumerConfig, ConsumerOptions
from apogee.client.consumer.queue_state import QueueState
from apogee.client.consumer.records import ReceivedMessage
from apogee.client.consumer.retry import one_line
from apogee.client.consumer.runtime import ConsumerRuntime
from apogee.client.consumer.spans import start_process
from apogee.client.producer.routes import MessageQueue
from apogee.common import tracing

if TYPE_CHECKING:
    from apogee.client.metrics import ConsumerMetrics

log = logging.getLogger(__name__)


class ConsumeResult(enum.Enum):
    SUCCESS = "SUCCESS"
    #: hand the messages over again later (as if the listener had raised)
    RETRY_LATER = "RETRY_LATER"


Listener = Callable[
    [list[ReceivedMessage]], "ConsumeResult | Awaitable[ConsumeResult | None] | None"
]

_Work = tuple[QueueState, list[ReceivedMessage], int]


class _Caller:
    """Runs the listener once with a timeout; tells whether the call succeeded, and if not,
    why (one line: what the broker keeps with a dead letter)."""

    def __init__(
        self,
        listener: Listener,
        cfg: ConsumerConfig,
        tracer: Tracer | None,
        metrics: ConsumerMetrics | None = None,
    ) -> None:
        self.listener = listener
        self.cfg = cfg
        self.tracer = tracer
        self.metrics = metrics
        self.is_async = inspect.iscoroutinefunction(listener) or inspect.iscoroutinefunction(
            getattr(listener, "__call__", None)  # noqa: B004 - async callable objects
        )
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        if not self.is_async:
            self.pool = concurrent.futures.ThreadPoolExecutor(
                cfg.consume_concurrency, thread_name_prefix=f"apogee-consume-{cfg.group}"
            )
        self.name = getattr(listener, "__qualname__", repr(listener))

    async def __call__(self, msgs: list[ReceivedMessage], topic: str) -> str | None:
        """None when the call succeeded, else the reason it failed. ``topic``: of the queue
        the messages were read from (what the metrics count them under)."""
        if self.metrics is not None:
            return await self._measured(self.metrics, msgs, topic)
        if self.tracer is not None:
            return await self._traced(self.tracer, msgs)
        return await self._call(msgs)

    async def _measured(
        self, metrics: ConsumerMetrics, msgs: list[ReceivedMessage], topic: str
    ) -> str | None:
        """The call, timed and counted (a failed one's messages are counted by :meth:`fate`)."""
        start = perf_counter()
        if self.tracer is not None:
            failure = await self._traced(self.tracer, msgs)
        else:
            failure = await self._call(msgs)
        metrics.called(topic, len(msgs), perf_counter() - start, failure is None)
        return failure

    def fate(self, topic: str, retried: int = 0, failed: int = 0) -> None:
        """Of messages whose call failed: ``retried`` come again (a retry topic, a local
        retry), ``failed`` do not (dead-lettered, dropped). Counted when metrics are on."""
        if self.metrics is not None:
            self.metrics.fate(topic, retried, failed)

    async def _traced(self, tracer: Tracer, msgs: list[ReceivedMessage]) -> str | None:
        """:meth:`_call` under the call's process span (the listener's current span)."""
        span = start_process(tracer, msgs, self.cfg.group, self.cfg.client_id)
        try:
            with trace.use_span(span, end_on_exit=False):
                failure = await self._call(msgs)
        except BaseException as exc:
            tracing.failed(span, exc)
            raise
        else:
            if failure is not None:
                tracing.failed(span, failure)
        finally:
            span.end()
        return failure

    async def _call(self, msgs: list[ReceivedMessage]) -> str | None:
        try:
            async with asyncio.timeout(self.cfg.consume_timeout):
                if self.is_async:
                    result = await self.listener(msgs)  # type: ignore[misc]
                else:
                    loop = asyncio.get_running_loop()
                    if self.tracer is None:
                        result = await loop.run_in_executor(self.pool, self.listener, msgs)
                    else:  # the listener's thread sees the process span as its current span
                        run = contextvars.copy_context().run
                        result = await loop.run_in_executor(self.pool, run, self.listener, msgs)
                    if inspect.isawaitable(result):
                        result = await result
        except TimeoutError:
            log.warning(
                "listener %s ran past consume_timeout (%.0fs) on %d message(s) of %s queue %d "
                "(first offset %d); counted as a failure",
                self.name,
                self.cfg.consume_timeout,
                len(msgs),
                msgs[0].topic,
                msgs[0].queue_id,
                msgs[0].queue_offset,
            )
            return f"consume timeout of {self.cfg.consume_timeout:g} s"
        except Exception as exc:
            log.warning(
                "listener %s failed on %d message(s) of %s queue %d (first offset %d, id %s)",
                self.name,
                len(msgs),
                msgs[0].topic,
                msgs[0].queue_id,
                msgs[0].queue_offset,
                msgs[0].unique_id,
                exc_info=True,
            )
            return one_line(f"{type(exc).__name__}: {exc}")
        if result is None or result is ConsumeResult.SUCCESS:
            return None
        if result is ConsumeResult.RETRY_LATER:
            return "listener returned RETRY_LATER"
        log.warning(
            "listener %s returned %r; expected None or a ConsumeResult: counted as a failure",
            self.name,
            result,
        )
        return one_line(f"listener returned {result!r}, not None or a ConsumeResult")

    def delay(self, attempt: int) -> float:
        return float(min(self.cfg.retry_delay * 2 ** max(attempt - 1, 0), self.cfg.max_retry_delay))

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


class _Concurrent:
    """Concurrent consumption: a pool of worker tasks taking batches from one queue; failed
    batches are sent back (clustering) or retried locally (broadcasting)."""

    def __init__(self, runtime_of: Callable[[], ConsumerRuntime], call: _Caller) -> None:
        self._runtime_of = runtime_of
        self._call = call
        self._work: collections.deque[_Work] = collections.deque()
        self._ready = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        self._timers: set[asyncio.TimerHandle] = set()
        self._sending: set[asyncio.Task[None]] = set()

    def start(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        self._workers = [
            loop.create_task(self._worker(), name=f"apogee-consumer-worker-{i}") for i in range(n)
        ]

    def deliver(self, qs: QueueState, msgs: list[ReceivedMessage]) -> None:
        size = self._call.cfg.consume_batch_size
        if size == 1:
            self._work.extend((qs, [m], 0) for m in msgs)
        else:
            self._work.extend((qs, msgs[i : i + size], 0) for i in range(0, len(msgs), size))
        self._ready.set()

    def released(self, qs: QueueState) -> None:
        pass  # work of a dropped queue is skipped when taken

    async def _worker(self) -> None:
        work = self._work
        runtime = self._runtime_of()
        while True:
            if not work:
                self._ready.clear()
                await self._ready.wait()
                continue
            qs, msgs, attempt = work.popleft()
            if qs.pq.dropped:
                continue
            qs.call_started()
            try:
                failure = await self._call(msgs, qs.mq.topic)
            finally:
                qs.call_ended()
            if failure is None:
                runtime.finished(qs, msgs)
            elif not qs.pq.dropped:
                self._failed(runtime, qs, msgs, attempt + 1, failure)

    def _failed(
        self,
        runtime: ConsumerRuntime,
        qs: QueueState,
        msgs: list[ReceivedMessage],
        attempt: int,
        reason: str,
    ) -> None:
        """The ``attempt``-th call on ``msgs`` failed."""
        if runtime.send_back is not None:
            qs.call_started()  # the queue's release waits for the send-back as for a call
            task = asyncio.get_running_loop().create_task(
                self._send_back(runtime, qs, msgs, attempt, reason), name="apogee-send-back"
            )
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
            return
        cfg = self._call.cfg  # broadcasting: local retries, then the messages are dropped
        if attempt > cfg.max_reconsume_times:
            log.warning(
                "giving up on %d message(s) of %s queue %d after %d failed call(s) "
                "(broadcasting: no retry topic); dropped: %s; last failure: %s",
                len(msgs),
                qs.mq.topic,
                qs.mq.queue_id,
                attempt,
                ", ".join(m.unique_id for m in msgs),
                reason,
            )
            self._call.fate(qs.mq.topic, failed=len(msgs))
            runtime.finished(qs, msgs)
            return
        self._call.fate(qs.mq.topic, retried=len(msgs))
        for m in msgs:
            m.reconsume_times += 1
        self._retry(qs, msgs, attempt)

    async def _send_back(
        self,
        runtime: ConsumerRuntime,
        qs: QueueState,
        msgs: list[ReceivedMessage],
        attempt: int,
        reason: str,
    ) -> None:
        assert runtime.send_back is not None
        try:
            outcomes = await runtime.send_back.send_back(qs.address, qs.mq.topic, msgs, reason)
        finally:
            qs.call_ended()
        if self._call.metrics is not None:  # the ones not dead-lettered come again
            dead = sum(o.dead_lettered for o in outcomes)
            self._call.fate(qs.mq.topic, retried=len(msgs) - dead, failed=dead)
        done = [m for m, o in zip(msgs, outcomes, strict=True) if o.ok]
        if done:
            runtime.finished(qs, done)
            if any(o.ok and not o.dead_lettered for o in outcomes):
                runtime.retry_stored()
        if len(done) == len(msgs) or qs.pq.dropped:
            return
        kept = [m for m, o in zip(msgs, outcomes, strict=True) if not o.ok]
        error = next(o.error for o in outcomes if o.error is not None)
        delay = self._call.delay(attempt)
        log.warning(
            "sending %d failed message(s) of %s queue %d back to broker %s failed: %s; "
            "consuming them again here in %.1fs (first id %s)",
            len(kept),
            qs.mq.topic,
            qs.mq.queue_id,
            qs.mq.broker_name,
            error,
            delay,
            kept[0].unique_id,
        )
        self._retry(qs, kept, attempt)

    def _retry(self, qs: QueueState, msgs: list[ReceivedMessage], attempt: int) -> None:
        loop = asyncio.get_running_loop()

        def again() -> None:
            self._timers.discard(handle)
            if not qs.pq.dropped:
                self._work.append((qs, msgs, attempt))
                self._ready.set()

        handle = loop.call_later(self._call.delay(attempt), again)
        self._timers.add(handle)

    async def stop(self) -> None:
        for h in self._timers:
            h.cancel()
        self._timers.clear()
        tasks = [*self._workers, *self._sending]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._workers = []
        self._sending.clear()


class _Orderly:
    """Orderly consumption: per queue, one call at a time, in offset order, while locked; a
    failed call is retried locally, and after ``max_reconsume_times`` retries its messages go
    to the dead-letter topic."""

    def __init__(self, runtime_of: Callable[[], ConsumerRuntime], call: _Caller) -> None:
        self._runtime_of = runtime_of
        self._call = call
        self._slots = asyncio.Semaphore(call.cfg.consume_concurrency)
        self._wakeups: dict[MessageQueue, asyncio.Event] = {}

    def start(self, n: int) -> None:
        pass

    def deliver(self, qs: QueueState, msgs: list[ReceivedMessage]) -> None:
        event = self._wakeups.setdefault(qs.mq, asyncio.Event())
        event.set()
        if qs.worker is None or qs.worker.done():
            qs.worker = asyncio.get_running_loop().create_task(
                self._queue_worker(qs, event), name=f"apogee-orderly-{qs.mq.topic}-{qs.mq.queue_id}"
            )

    def released(self, qs: QueueState) -> None:
        self._wakeups.pop(qs.mq, None)
        if qs.worker is not None:
            qs.worker.cancel()

    async def _queue_worker(self, qs: QueueState, event: asyncio.Event) -> None:
        runtime = self._runtime_of()
        size = self._call.cfg.consume_batch_size
        clock = self._call.cfg.clock
        attempt = 0
        while not qs.pq.dropped:
            batch = qs.pq.take(size)
            if not batch:
                event.clear()
                await event.wait()
                continue
            # consume only under a trusted lock; a queue whose lock lapsed waits for it
            while not qs.locked(clock.monotonic()) and not qs.pq.dropped:
                qs.pq.rollback_taken()
                await _wait_event(qs.lock_granted, 1.0)
                batch = qs.pq.take(size)
            if qs.pq.dropped or not batch:
                continue
            async with self._slots:
                qs.call_started()
                try:
                    failure = await self._call(batch, qs.mq.topic)
                    if failure is not None:
                        if attempt + 1 <= self._call.cfg.max_reconsume_times:
                            self._call.fate(qs.mq.topic, retried=len(batch))
                        elif await self._dead_letter(runtime, qs, batch, attempt + 1, failure):
                            failure = None  # done: in the dead-letter topic
                finally:
                    qs.call_ended()
            if failure is None:
                attempt = 0
                runtime.committed_orderly(qs, qs.pq.commit_taken())
            else:
                attempt += 1
                for m in batch:
                    m.reconsume_times += 1
                qs.pq.rollback_taken()
                await _wait_event(qs.gone, self._call.delay(attempt))

    async def _dead_letter(
        self,
        runtime: ConsumerRuntime,
        qs: QueueState,
        batch: list[ReceivedMessage],
        attempts: int,
        reason: str,
    ) -> bool:
        """Send ``batch`` to the dead-letter topic; True when all of it went (those that did
        are done either way)."""
        assert runtime.send_back is not None  # orderly consumers are clustering consumers
        outcomes = await runtime.send_back.send_back(
            qs.address, qs.mq.topic, batch, reason, to_dlq=True, attempts=attempts
        )
        errors = [o.error for o in outcomes if o.error is not None]
        self._call.fate(qs.mq.topic, retried=len(errors), failed=len(batch) - len(errors))
        if not errors:
            log.warning(
                "%d message(s) of %s queue %d failed %d time(s) and went to the dead-letter "
                "topic: %s; last failure: %s",
                len(batch),
                qs.mq.topic,
                qs.mq.queue_id,
                attempts,
                ", ".join(m.unique_id for m in batch),
                reason,
            )
            return True
        done = [m for m, o in zip(batch, outcomes, strict=True) if o.ok]
        if done and not qs.pq.dropped:
            runtime.committed_orderly(qs, qs.pq.remove(done))
        log.warning(
            "%s queue %d: sending %d message(s) to the dead-letter topic failed: %s; "
            "retrying them here",
            qs.mq.topic,
            qs.mq.queue_id,
            len(errors),
            errors[0],
        )
        return False

    async def stop(self) -> None:
        self._wakeups.clear()


async def _wait_event(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()


class PushConsumer(ConsumerBase):
    """Calls ``listener`` with the messages of its subscriptions; see the module docstring."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str,
        listener: Listener,
        **options: Unpack[ConsumerOptions],
    ) -> None:
        if not callable(listener):
            raise TypeError(f"listener must be callable, got {type(listener).__name__}")
        super().__init__(ConsumerConfig.create(namesrv, group, options))
        self._caller = _Caller(listener, self.config, self._tracer, self._metrics)
        self._dispatch: _Concurrent | _Orderly = (
            _Orderly(self._get_runtime, self._caller)
            if self.config.orderly
            else _Concurrent(self._get_runtime, self._caller)
        )

    def _get_runtime(self) -> ConsumerRuntime:
        assert self._runtime is not None
        return self._runtime

    async def start(self) -> None:
        """Join the group, take a share of the queues and start consuming. Raises (and cleans
        up) when a subscribed topic is unknown or no nameserver answers."""
        if not self._startable():
            return
        self._dispatch.start(self.config.consume_concurrency)
        try:
            await self._start_runtime(self._dispatch)
        except BaseException:
            await self._dispatch.stop()
            self._caller.shutdown()
            raise

    async def close(self) -> None:
        """Stop pulling, let running listener calls finish (up to ``close_timeout``), commit
        offsets, unlock queues and leave the group. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._runtime is not None:
            await self._runtime.close()
        await self._dispatch.stop()
        self._caller.shutdown()

    async def __aenter__(self) -> PushConsumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
