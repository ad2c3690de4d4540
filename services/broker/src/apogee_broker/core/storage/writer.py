"""Storing: what every write of the broker goes through on its way into the CommitLog.

Sends, half messages, transaction decisions, retries, dead letters and the schedule topic's
deliveries are all appended here (:class:`StoreWriter`); none of them touches the store itself.

- :meth:`StoreWriter.fill_defaults` gives the messages of a batch what they lack: a unique id
  (:class:`~apogee.common.ids.IdGenerator`), the born timestamp (the broker's clock) and the born
  host (the caller's address).
- :meth:`StoreWriter.store_batch` stores a checked batch and answers each message
  (:class:`SendOutcome`). The store checks its own rules (properties, keys, hosts) over the whole
  batch before writing anything; in the rare case it refuses the batch, each message is checked
  alone with the store's encoder and the batch is stored again without the bad ones. A store
  failure (closed, disk full, flush timeout) becomes the outcome of every message of the batch.
- :meth:`StoreWriter.append_internal` stores messages the broker built itself, without the client
  checks; :meth:`StoreWriter.append_all` stores a batch all or nothing (what a transaction writes
  together); :meth:`StoreWriter.append_records` stores send records as one block.

Flushing: with ``flush_mode = async`` an append returns as soon as the bytes are in the page
cache, so it runs directly on the event loop. With ``sync`` the write is acknowledged only once
fsynced: :meth:`MessageStore.append_async` returns at once and calls back from the store's
group-commit thread; a :class:`LoopBridge` settles the waiting futures with one wake-up of the
loop per flush group. A refusal for lack of space, and the first success after one, are told to
:class:`~.disk_episodes.DiskFullEpisodes`.

A broker that traces records a store span for each stored message that carries a trace context
(:mod:`.store_spans`); one that does not checks for that once per batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple, Protocol

from opentelemetry.trace import Tracer

from apogee.codec.send import RecordRef
from apogee.common.aio import LoopBridge
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import (
    ApogeeError,
    DiskFullError,
    FlushTimeoutError,
    InternalError,
    InvalidArgumentError,
)
from apogee.common.ids import IdGenerator
from apogee.store import AppendResult, FlushMode, Message, MessageStore
from apogee.store.records import Encoder
from apogee_broker.core.storage.disk_episodes import DiskFullEpisodes
from apogee_broker.core.storage.store_spans import StoreSpans
from apogee_broker.metrics import BrokerMetrics


class SendOutcome(NamedTuple):
    """What became of one message: ``result`` when stored, ``error`` when not (or, for a flush
    timeout, stored but not confirmed durable: both set)."""

    topic: str
    queue_id: int
    unique_id: str
    result: AppendResult | None = None
    error: ApogeeError | None = None
    #: for a delayed or timer message: when it is due (ms); it is not in its queue before
    scheduled_for: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


_new_outcome = tuple.__new__

NOT_STORED: Final = InternalError(detail="the message was not stored")

#: An append of ``batch``: its results and, when durability could not be confirmed, the error
#: saying so (the messages are stored).
Appended = tuple[list[AppendResult], ApogeeError | None]


class Replication(Protocol):
    """What the writer needs of a replica group leader's term (:mod:`apogee_broker.replication`)."""

    async def admit(self) -> None: ...

    async def replicated(self, end: int) -> ApogeeError | None: ...


class StoreWriter:
    """Appends to one broker's store and waits for durability; methods run on the loop."""

    def __init__(
        self,
        store: MessageStore,
        *,
        broker_name: str,
        clock: Clock = SYSTEM_CLOCK,
        ids: IdGenerator | None = None,
        metrics: BrokerMetrics | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.ids = ids or IdGenerator()
        self.metrics = metrics if metrics is not None else BrokerMetrics()
        #: None unless the broker traces: then each stored message with a trace context gets
        #: its store span (:mod:`.store_spans`)
        self.spans = StoreSpans(tracer, broker_name) if tracer is not None else None
        self.disk = DiskFullEpisodes(store.root)
        self._sync = store.cfg.flush_mode is FlushMode.SYNC
        self._checker = Encoder(store.cfg)  # the store's own rules, for the rare slow path
        self._bridge: LoopBridge | None = None
        #: a replica group leader's term: every write is refused while it may not be stored
        #: and waits, once stored, for the in-sync set (docs/replication.md); None: a lone broker
        self.replication: Replication | None = None

    def fill_defaults(self, batch: list[Message], born_host: str) -> None:
        """Give each message of ``batch`` the unique id, born timestamp and born host it lacks."""
        missing: list[Message] = []
        now = self.clock.time_ms()
        for m in batch:
            if not m.unique_id:
                missing.append(m)
            if not m.born_timestamp:
                m.born_timestamp = now
            if not m.born_host:
                m.born_host = born_host
        if missing:
            for m, uid in zip(missing, self.ids.next_ids(len(missing)), strict=True):
                m.unique_id = uid

    async def append_internal(
        self, batch: list[Message], attempts: Sequence[str] | None = None
    ) -> list[SendOutcome]:
        """Store messages the broker built itself (deliveries of the schedule topic, retries,
        dead letters) without the client checks; one outcome per message, in order.
        ``attempts``: per message, the ``traceparent`` of the failed delivery its store span
        links to (``""``: none)."""
        outcomes: list[SendOutcome | None] = [None] * len(batch)
        self.fill_defaults(batch, "")
        await self.store_batch(list(range(len(batch))), batch, outcomes, attempts)
        return [
            o if o is not None else failed(m, NOT_STORED)
            for o, m in zip(outcomes, batch, strict=True)
        ]

    async def store_batch(
        self,
        good: list[int],
        batch: list[Message],
        outcomes: list[SendOutcome | None],
        attempts: Sequence[str] | None = None,
    ) -> None:
        """Store ``batch`` (defaults filled); the outcome of ``batch[k]`` goes to
        ``outcomes[good[k]]`` (see the module docstring)."""
        began = time.time_ns() if self.spans is not None else 0
        try:
            results, durable_error = await self._append(batch)
        except InvalidArgumentError as refused:
            # The store refused the batch (nothing written): find the bad ones, store the rest.
            keep_idx: list[int] = []
            keep: list[Message] = []
            for i, msg in zip(good, batch, strict=True):
                try:
                    self._checker.prepare([msg])
                except ApogeeError as err:
                    outcomes[i] = failed(msg, err)
                else:
                    keep_idx.append(i)
                    keep.append(msg)
            if len(keep) == len(batch):  # no single message is to blame: the batch fails
                for i, msg in zip(good, batch, strict=True):
                    outcomes[i] = failed(msg, refused)
            elif keep:
                await self.store_batch(keep_idx, keep, outcomes)
            return
        except ApogeeError as err:  # closed, failed, disk full: nothing of the batch stored
            for i, msg in zip(good, batch, strict=True):
                outcomes[i] = failed(msg, err)
            if self.spans is not None:
                self.spans.messages(batch, None, began, err, attempts)
            return
        for i, r in zip(good, results, strict=True):
            outcomes[i] = _new_outcome(
                SendOutcome, (r.topic, r.queue_id, r.unique_id, r, durable_error, 0)
            )
        if self.spans is not None:
            self.spans.messages(batch, results, began, durable_error, attempts)

    async def append_all(self, batch: list[Message]) -> Appended:
        """Store ``batch`` (built by the broker, defaults filled) as one append, all or nothing:
        the store checks every message before it writes any. Returns where each went and, when
        durability could not be confirmed, the error saying so (the messages are stored);
        raises when nothing was stored. What a transaction writes together (a commit's message
        and op records) goes this way."""
        if self.spans is None:
            return await self._append(batch)
        began = time.time_ns()
        try:
            results, durable_error = await self._append(batch)
        except ApogeeError as err:
            self.spans.messages(batch, None, began, err)
            raise
        self.spans.messages(batch, results, began, durable_error)
        return results, durable_error

    async def append_records(self, block: bytes, refs: list[RecordRef], born_host: str) -> Appended:
        """:meth:`append_all` of send records (checked by the caller), as one block; no spans
        (the caller records them, it knows which records carry a trace context)."""
        return await self._appended(
            lambda: self.store.append_records(block, refs, born_host),
            lambda done: self.store.append_records_async(block, refs, done, born_host),
            lambda: len(block),
        )

    async def _append(self, batch: list[Message]) -> Appended:
        return await self._appended(
            lambda: self.store.append(batch),
            lambda done: self.store.append_async(batch, done),
            lambda: sum(len(m.body) for m in batch),
        )

    async def _appended(
        self,
        append: Callable[[], list[AppendResult]],
        append_async: Callable[[Callable[[BaseException | None], None]], list[AppendResult]],
        needed: Callable[[], int],
    ) -> Appended:
        """``append()`` (async flush) or ``append_async(on_durable)`` waited for (sync flush);
        a refusal for lack of space, and the first success after one, are told to
        :attr:`disk` (``needed()``: the bytes the refused append wanted)."""
        metrics = self.metrics
        replication = self.replication
        if replication is not None:
            await replication.admit()
        try:
            if not self._sync:
                began = time.perf_counter()
                out: Appended = append(), None
                metrics.append_latency.observe(time.perf_counter() - began)
            else:
                out = await self._durably(append_async)
        except DiskFullError as err:
            self.disk.failed(err, needed())
            raise
        self.disk.stored()
        metrics.stored(out[0])
        if replication is not None and out[1] is None and out[0]:
            last = out[0][-1]
            not_replicated = await replication.replicated(last.phys_offset + last.size)
            if not_replicated is not None:
                return out[0], not_replicated
        return out

    async def _durably(
        self, start: Callable[[Callable[[BaseException | None], None]], list[AppendResult]]
    ) -> Appended:
        """``start(on_durable)`` appends; wait for its durability (sync flush)."""
        if self._bridge is None:
            self._bridge = LoopBridge(asyncio.get_running_loop())
        bridge = self._bridge
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        began = time.perf_counter()
        results = start(lambda err: bridge.post(fut, err))
        self.metrics.append_latency.observe(time.perf_counter() - began)
        # The store answers within sync_flush_timeout_s (or at close); the bound is a backstop.
        limit = self.store.cfg.sync_flush_timeout_s
        try:
            await asyncio.wait_for(fut, limit * 2 + 1)
        except TimeoutError:
            last = results[-1]
            return results, FlushTimeoutError(timeout_s=limit, offset=last.phys_offset + last.size)
        except ApogeeError as err:
            return results, err
        return results, None


def failed(msg: Message, err: ApogeeError) -> SendOutcome:
    """The outcome of ``msg``, not stored because of ``err``."""
    return SendOutcome(msg.topic, msg.queue_id, msg.unique_id or "", None, err)
