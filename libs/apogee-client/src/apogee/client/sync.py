"""Synchronous twins of the asyncio clients, for scripts and threads.

Each facade owns a :class:`~apogee.client._loop.LoopThread` and the asyncio client living on
it; its methods hand the work to that loop and wait. There is one implementation of sending
and administration — the asyncio one — so the two flavours cannot drift apart (the shape of
httpx's ``Client`` and ``AsyncClient``).

Sends from any number of threads are handed over through one queue that the loop empties in a
single wake-up, so concurrent threads feed the same batching as concurrent coroutines do.
Callbacks (``send_async(..., callback=)``) and hooks run on the loop thread: they must not block,
and must not call the blocking methods of the same facade (that raises ``RuntimeError``).

:class:`SyncTransactionProducer` runs its steps on the loop (storing the half, ending the
transaction) and the executor, the caller's local transaction, in the calling thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Literal, TypeVar, Unpack

from opentelemetry import context as otel_context

from apogee.client._loop import LoopThread
from apogee.client.admin import (
    READ_WRITE,
    AdminClient,
    BrokerAnswer,
    BrokerDetails,
    BrokerInfo,
    GroupDescription,
    GroupSummary,
    MessageType,
    MessageWindow,
    NameServerHealth,
    Perm,
    QueueOffset,
    ResetOffset,
    ScheduleState,
    TopicListing,
    TopicStatus,
    TopicUpdate,
)
from apogee.client.dlq import DeadLetter, RedriveResult
from apogee.client.message import Message, SendResult, StoredMessage
from apogee.client.producer.config import DEFAULT_GROUP, ProducerOptions
from apogee.client.producer.delivery import SendCallback
from apogee.client.producer.producer import Producer, ProducerStats
from apogee.client.producer.routes import MessageQueue
from apogee.client.producer.transaction import (
    TransactionOptions,
    TransactionProducer,
    validate_transactional,
)
from apogee.client.producer.txn_calls import TransactionCallStats
from apogee.client.producer.txn_checks import CheckStats
from apogee.client.producer.txn_model import (
    CheckListener,
    TransactionDecision,
    TransactionExecutor,
    TransactionMessage,
    TransactionResult,
    await_decision,
    decision_of,
    failed,
)
from apogee.client.producer.validation import MessageValidator
from apogee.common.errors import DeadlineExceededError

log = logging.getLogger(__name__)
T = TypeVar("T")

_Mode = Literal["async", "oneway"]
#: (message, future, callback, mode, the sender's OpenTelemetry context when tracing)
_Handoff = tuple[
    Message,
    "concurrent.futures.Future[SendResult] | None",
    "SendCallback | None",
    _Mode,
    "otel_context.Context | None",
]
_GRACE = 5.0  # seconds added to the core's own timeouts when waiting across threads


class SyncProducer:
    """The blocking producer: ``with SyncProducer("host:9876", group="g") as p: p.send(msg)``.
    Takes the same options as :class:`~apogee.client.Producer`."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str = DEFAULT_GROUP,
        **options: Unpack[ProducerOptions],
    ) -> None:
        self._setup(Producer(namesrv, group, **options), "apogee-producer")

    def _setup(self, core: Producer, thread_name: str) -> None:
        """Run ``core`` on a loop thread of its own (started here)."""
        self._core = core
        self.config = self._core.config
        self._thread = LoopThread(thread_name)
        self._handoff: collections.deque[_Handoff] = collections.deque()
        #: a tracing producer's send spans are children of the sending thread's current span
        self._traced = core._tracer is not None
        self._room = threading.BoundedSemaphore(self.config.max_pending)
        self._validate = MessageValidator(self.config.max_message_size)
        self._wake_pending = False
        self._closed = False
        try:
            self._thread.run(self._core.start(), _GRACE, "starting the producer")
        except BaseException:
            self._thread.stop()
            raise

    def __enter__(self) -> SyncProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sending -----------------------------------------------------------------------------

    def send(self, msg: Message, *, message_id: str | None = None) -> SendResult:
        """Send ``msg`` and wait until a broker stored it (retries included). ``message_id``
        (idempotent producers): as :meth:`Producer.send <apogee.client.Producer.send>`'s, the
        id of an earlier send whose outcome is unknown (``err.message_id``)."""
        if self._thread.in_loop_thread():
            raise RuntimeError("SyncProducer.send from its own loop thread would wait forever")
        if message_id is not None:
            return self._run(self._core.send(msg, message_id=message_id), "a send")
        fut = self.send_async(msg)
        try:
            return fut.result(self.config.send_timeout + _GRACE)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def send_async(
        self, msg: Message, callback: SendCallback | None = None
    ) -> concurrent.futures.Future[SendResult]:
        """Send ``msg`` in the background; the future (and ``callback(result, error)``, called
        on the producer's loop thread) gets the outcome. Invalid messages raise here."""
        fut: concurrent.futures.Future[SendResult] = concurrent.futures.Future()
        self._hand_over(msg, fut, callback, "async")
        return fut

    def send_oneway(self, msg: Message) -> None:
        """Hand ``msg`` over and return at once: no result, no retry, failures are logged."""
        self._hand_over(msg, None, None, "oneway")

    def send_ordered(
        self,
        msg: Message,
        sharding_key: str | bytes,
        failover: bool = False,
        *,
        message_id: str | None = None,
        fifo: bool = True,
    ) -> SendResult:
        """As :meth:`Producer.send_ordered <apogee.client.Producer.send_ordered>`."""
        return self._run(
            self._core.send_ordered(msg, sharding_key, failover, message_id=message_id, fifo=fifo),
            "an ordered send",
        )

    def send_batch(
        self, msgs: Sequence[Message], *, message_ids: Sequence[str] | None = None
    ) -> list[SendResult]:
        """As :meth:`Producer.send_batch <apogee.client.Producer.send_batch>`."""
        return self._run(self._core.send_batch(msgs, message_ids=message_ids), "a batch send")

    def stats(self) -> ProducerStats:
        return self._core.stats()

    def close(self, timeout: float | None = None) -> None:
        """Let queued messages leave (at most ``timeout``, default ``close_timeout``), then stop
        the producer and its loop thread."""
        if self._closed:
            return
        self._closed = True
        wait = self.config.close_timeout if timeout is None else timeout
        try:
            if self._thread.running():
                self._thread.run(
                    self._close_on_loop(timeout), wait + _GRACE, "closing the producer"
                )
        finally:
            self._thread.stop()
            while self._handoff:  # handed over by another thread while closing
                _, fut, _, _, _ = self._handoff.popleft()
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError("the producer is closed"))

    async def _close_on_loop(self, timeout: float | None) -> None:
        self._take_handoff()  # what was handed over before close still goes out
        await self._core.close(timeout)

    # -- internals ---------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("the producer is closed")
        return self._thread.run(coro, self.config.send_timeout + _GRACE, what)

    def _hand_over(
        self,
        msg: Message,
        fut: concurrent.futures.Future[SendResult] | None,
        callback: SendCallback | None,
        mode: _Mode,
    ) -> None:
        if self._closed:
            raise RuntimeError("the producer is closed")
        self._validate(msg)
        # from a callback on the loop thread, waiting for room would wait forever
        wait = not self._thread.in_loop_thread()
        if not self._room.acquire(blocking=wait, timeout=self.config.send_timeout if wait else -1):
            raise DeadlineExceededError(
                what=f"waiting for room among {self.config.max_pending} unsettled sends "
                "(max_pending)",
                timeout_s=self.config.send_timeout,
            )
        ctx = otel_context.get_current() if self._traced else None
        self._handoff.append((msg, fut, callback, mode, ctx))
        if not self._wake_pending:
            self._wake_pending = True
            self._thread.call_soon(self._take_handoff)

    def _take_handoff(self) -> None:
        """On the loop: start everything handed over since the last wake-up."""
        self._wake_pending = False
        core = self._core
        handoff = self._handoff
        release = self._release
        while handoff:
            msg, fut, callback, mode, ctx = handoff.popleft()
            token = otel_context.attach(ctx) if ctx is not None else None
            try:
                if mode == "oneway":
                    task = asyncio.get_running_loop().create_task(core._queue_oneway(msg, release))
                    task.add_done_callback(self._oneway_queued)
                    continue
                assert fut is not None
                if not fut.set_running_or_notify_cancel():
                    release()
                    continue
                try:
                    inner = core.send_nowait(msg, callback)
                except Exception as exc:
                    release()
                    fut.set_exception(exc)
                    continue
                inner.add_done_callback(functools.partial(_copy_outcome, out=fut, release=release))
            finally:
                if token is not None:
                    otel_context.detach(token)

    def _release(self, *_: object) -> None:
        self._room.release()

    def _oneway_queued(self, task: asyncio.Task[None]) -> None:
        """Queued, the send releases its room once settled; else it releases it here."""
        if task.cancelled():
            self._release()
        elif (exc := task.exception()) is not None:
            self._release()
            log.warning("oneway send failed before it was queued: %s", exc)


class SyncTransactionProducer(SyncProducer):
    """The blocking transactional producer: ``with SyncTransactionProducer("host:9876", "g",
    check_listener=was_placed) as p: p.send_in_transaction(msg, place_order, order)``. Takes
    the options of :class:`~apogee.client.TransactionProducer`, and sends ordinary messages as
    :class:`SyncProducer` does.

    The executor runs in the calling thread (a plain function may block: it is the caller's
    local transaction); one that returns an awaitable has it awaited on the producer's loop, at
    most ``executor_timeout``. A plain-function check listener runs on the producer's pool of
    check threads, an async one on its loop."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str,
        check_listener: CheckListener | None = None,
        **options: Unpack[TransactionOptions],
    ) -> None:
        core = TransactionProducer(namesrv, group, check_listener, **options)
        self._txn = core
        self._txn_validate = MessageValidator(core.config.max_message_size)
        self._setup(core, "apogee-txn-producer")

    def __enter__(self) -> SyncTransactionProducer:
        return self

    @property
    def client_id(self) -> str:
        """This producer's id among its group's producers."""
        return self._txn.client_id

    def check_stats(self) -> CheckStats:
        """The checks received and answered so far."""
        return self._txn.check_stats()

    def transaction_stats(self) -> TransactionCallStats:
        """The halves and ends sent so far, and the requests that carried them."""
        return self._txn.transaction_stats()

    def send_in_transaction(
        self, message: Message, executor: TransactionExecutor, arg: Any = None
    ) -> TransactionResult:
        """As :meth:`TransactionProducer.send_in_transaction
        <apogee.client.TransactionProducer.send_in_transaction>`, the executor called in this
        thread."""
        if self._thread.in_loop_thread():
            raise RuntimeError(
                "SyncTransactionProducer.send_in_transaction from its own loop thread would wait "
                "forever"
            )
        if self._closed:
            raise RuntimeError("the producer is closed")
        msg = validate_transactional(message, self._txn_validate)
        if not callable(executor):
            raise TypeError(f"executor must be callable, got {type(executor).__name__}")
        core = self._txn
        wait = self.config.send_timeout + _GRACE
        half = self._thread.run(core._open(msg), wait, "storing the half of a transaction")
        try:
            decision, why = self._execute(executor, half.message, arg)
        except BaseException:
            self._thread.call_soon(core._leave)
            raise
        return self._thread.run(
            core._settle(half, decision, why), wait, f"ending transaction {half.unique_id}"
        )

    def _execute(
        self, executor: TransactionExecutor, message: TransactionMessage, arg: Any
    ) -> tuple[TransactionDecision, str]:
        uid = message.transaction_id
        who = "the executor"
        try:
            value = executor(message, arg)
        except Exception as exc:
            return failed(exc, who, uid)
        if inspect.isawaitable(value):
            timeout = self._txn.txn_config.executor_timeout
            return self._thread.run(await_decision(value, timeout, who, uid), timeout + _GRACE, who)
        return decision_of(value, who, uid)


def _copy_outcome(
    src: asyncio.Future[SendResult],
    out: concurrent.futures.Future[SendResult],
    release: Callable[[], None],
) -> None:
    release()
    if src.cancelled():  # a running concurrent future cannot be cancelled: report it instead
        out.set_exception(concurrent.futures.CancelledError())
    elif (exc := src.exception()) is not None:
        out.set_exception(exc)
    else:
        out.set_result(src.result())


class SyncAdminClient:
    """The blocking admin client; same methods as :class:`~apogee.client.AdminClient`."""

    def __init__(self, namesrv: str | Sequence[str], timeout: float = 3.0) -> None:
        self._core = AdminClient(namesrv, timeout)
        self.timeout = self._core.timeout
        self._thread = LoopThread("apogee-admin")
        self._closed = False

    def __enter__(self) -> SyncAdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("the admin client is closed")
        return self._thread.run(coro, self.timeout * 2 + _GRACE, what)

    def cluster_info(self) -> list[BrokerInfo]:
        return self._run(self._core.cluster_info(), "cluster info")

    def nameserver_health(self) -> list[NameServerHealth]:
        return self._run(self._core.nameserver_health(), "checking the nameservers")

    def describe_brokers(
        self, brokers: Sequence[str] | None = None
    ) -> list[BrokerAnswer[BrokerDetails]]:
        return self._run(self._core.describe_brokers(brokers), "describing the brokers")

    def schedule_states(self) -> list[BrokerAnswer[ScheduleState]]:
        return self._run(self._core.schedule_states(), "reading the schedule state")

    def offsets_for_time(self, topic: str, timestamp_ms: int) -> list[QueueOffset]:
        return self._run(
            self._core.offsets_for_time(topic, timestamp_ms), "finding offsets for a time"
        )

    def commit_offsets(
        self,
        group: str,
        offsets: Mapping[MessageQueue, int],
        *,
        client_id: str = "apogee-admin",
    ) -> list[QueueOffset]:
        return self._run(
            self._core.commit_offsets(group, offsets, client_id=client_id), "committing offsets"
        )

    def list_topics(self) -> list[str]:
        return self._run(self._core.list_topics(), "listing topics")

    def list_topic_configs(self) -> list[TopicListing]:
        return self._run(self._core.list_topic_configs(), "listing topics")

    def create_or_update_topic(
        self,
        name: str,
        queues: int = 8,
        perm: Perm | int = READ_WRITE,
        brokers: Sequence[str] | None = None,
        cluster: str | None = None,
        message_type: MessageType | str | None = None,
    ) -> list[TopicUpdate]:
        return self._run(
            self._core.create_or_update_topic(name, queues, perm, brokers, cluster, message_type),
            "creating a topic",
        )

    def delete_topic(self, name: str, brokers: Sequence[str] | None = None) -> list[str]:
        return self._run(self._core.delete_topic(name, brokers), "deleting a topic")

    def describe_topic(self, name: str) -> TopicStatus:
        return self._run(self._core.describe_topic(name), "describing a topic")

    def get_message(self, unique_id: str) -> StoredMessage:
        return self._run(self._core.get_message(unique_id), "getting a message")

    def get_messages(self, unique_id: str) -> list[StoredMessage]:
        return self._run(self._core.get_messages(unique_id), "getting the messages of an id")

    def query_messages(
        self, topic: str, key: str, begin_ms: int = 0, end_ms: int = 0, max_messages: int = 64
    ) -> list[StoredMessage]:
        return self._run(
            self._core.query_messages(topic, key, begin_ms, end_ms, max_messages),
            "querying messages",
        )

    def messages_between(
        self, topic: str, begin_ms: int, end_ms: int = 0, max_messages: int = 64
    ) -> MessageWindow:
        return self._run(
            self._core.messages_between(topic, begin_ms, end_ms, max_messages),
            "listing the messages of a time window",
        )

    def list_groups(self) -> list[GroupSummary]:
        return self._run(self._core.list_groups(), "listing groups")

    def describe_group(self, group: str) -> GroupDescription:
        return self._run(self._core.describe_group(group), "describing a group")

    def reset_offsets(
        self,
        group: str,
        topic: str,
        *,
        earliest: bool = False,
        latest: bool = False,
        timestamp_ms: int | None = None,
    ) -> list[ResetOffset]:
        return self._run(
            self._core.reset_offsets(
                group, topic, earliest=earliest, latest=latest, timestamp_ms=timestamp_ms
            ),
            "resetting offsets",
        )

    def list_dead_letters(
        self,
        group: str,
        *,
        key: str | None = None,
        tag: str | None = None,
        topic: str | None = None,
        since_ms: int = 0,
        limit: int = 100,
    ) -> list[DeadLetter]:
        return self._run(
            self._core.list_dead_letters(
                group, key=key, tag=tag, topic=topic, since_ms=since_ms, limit=limit
            ),
            "listing dead letters",
        )

    def redrive_dead_letters(
        self,
        group: str,
        *,
        key: str | None = None,
        tag: str | None = None,
        topic: str | None = None,
        since_ms: int = 0,
        rate: float = 100.0,
        dry_run: bool = False,
        wait_s: float = 3600.0,
    ) -> RedriveResult:
        """:meth:`AdminClient.redrive_dead_letters`; ``wait_s`` bounds the whole redrive (it is
        paced to ``rate``, so many messages take a while)."""
        return self._thread.run(
            self._core.redrive_dead_letters(
                group,
                key=key,
                tag=tag,
                topic=topic,
                since_ms=since_ms,
                rate=rate,
                dry_run=dry_run,
            ),
            wait_s,
            "redriving dead letters",
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._thread.running():
                self._thread.run(self._core.close(), _GRACE, "closing the admin client")
        finally:
            self._thread.stop()
