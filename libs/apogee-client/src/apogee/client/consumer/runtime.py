"""What every consumer runs: sessions, rebalance, one pull loop per owned queue, offsets.

A :class:`ConsumerRuntime` owns a set of queues (its share after rebalance). For each it keeps a
:class:`QueueState`: the :class:`ProcessQueue` of messages pulled and not yet finished, where the
next pull starts, and a task that pulls with long polling and hands what arrives to a
:class:`Sink` (the push consumer's listener workers, or the pull consumer's buffer). The sink
reports finished messages back with :meth:`ConsumerRuntime.finished`, which moves the queue's
offset to the smallest offset still unfinished; offsets are committed every
``offset_persist_interval``, on every pull (piggybacked), when a queue is taken away, and at
close.

Pulling a queue pauses while it holds ``max_cached_messages_per_queue`` messages or
``max_cached_bytes_per_queue`` bytes, or spans ``max_span`` offsets (concurrent mode), and goes on
as soon as the sink finishes enough of them.

A clustering runtime also reads the group's retry topic ``%RETRY%<group>`` (see
:mod:`apogee.client.consumer.retry`): it is subscribed at start, its queues are shared like any
topic's once the brokers route it (a missing route is looked for again at the next rebalance,
quietly), a queue of it without a committed offset starts at its earliest message whatever
``consume_from`` says, and its messages are handed over under their original topic.

A queue taken away (rebalance, offset reset, close) is released cleanly: no more pulls, the
listener calls already running get up to ``close_timeout`` to finish, messages not started are
abandoned (the next owner gets them: delivery is at least once), and the offset is committed.
Orderly consumers also hold a lock on each queue at its broker: a queue is consumed only while
the lock is held, its start offset is read after the lock is granted, and it is unlocked only
after its offset is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from apogee.client._rpc import ChannelPool, NameServerClient, PullAnswer, rpc
from apogee.client.consumer.config import ConsumeFrom, ConsumeMode, ConsumerConfig
from apogee.client.consumer.locking import QueueLocker
from apogee.client.consumer.offset_store import (
    OFFSETS_FILE,
    LocalOffsetStore,
    OffsetStore,
    RemoteOffsetStore,
    default_offset_dir,
)
from apogee.client.consumer.process_queue import ProcessQueue
from apogee.client.consumer.rebalance import ReadRoute, allocate, fetch_route, group_members
from apogee.client.consumer.records import ReceivedMessage, decode_records
from apogee.client.consumer.retry import SendBackClient, present_retried
from apogee.client.consumer.session import BrokerSession
from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import ApogeeError, CorruptRecordError, InvalidArgumentError
from apogee.common.tags import parse_tag_expression, tag_matches
from apogee.common.topics import retry_topic, validate_topic
from apogee.v1 import consumer_pb2

log = logging.getLogger(__name__)

_MIN_BACKOFF = 0.1
#: What a broker answers for a queue of a route that it does not have (yet).
_NOT_THERE_YET = frozenset({"UNKNOWN_TOPIC", "INVALID_QUEUE_ID"})
_MAX_BACKOFF = 5.0

_MODES = {
    ConsumeMode.CLUSTERING: consumer_pb2.CLUSTERING,
    ConsumeMode.BROADCASTING: consumer_pb2.BROADCASTING,
}


@dataclass(eq=False)
class QueueState:
    """One owned queue."""

    mq: MessageQueue
    address: str
    pq: ProcessQueue
    next_offset: int = -1
    task: asyncio.Task[None] | None = None
    #: set whenever the sink finishes messages (pulling may go on)
    space: asyncio.Event = field(default_factory=asyncio.Event)
    #: listener calls running for this queue, and set when there are none
    running: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: orderly: monotonic time until which the broker lock is trusted
    locked_until: float = 0.0
    #: orderly: set while the lock is trusted
    lock_granted: asyncio.Event = field(default_factory=asyncio.Event)
    #: consume_from=timestamp on a queue without a committed offset: skip older messages
    skip_before_ms: int = 0
    #: the sink's own per-queue state (the orderly worker task)
    worker: asyncio.Task[None] | None = None
    #: set when the queue is released
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def locked(self, now: float) -> bool:
        return now < self.locked_until

    def call_started(self) -> None:
        self.running += 1
        self.idle.clear()

    def call_ended(self) -> None:
        self.running -= 1
        if self.running <= 0:
            self.running = 0
            self.idle.set()


class Sink(Protocol):
    """Where pulled messages go."""

    def deliver(self, qs: QueueState, msgs: list[ReceivedMessage]) -> None: ...

    def released(self, qs: QueueState) -> None:
        """The queue is no longer owned; forget anything kept for it."""
        ...


class ConsumerRuntime:
    def __init__(self, cfg: ConsumerConfig, sink: Sink) -> None:
        self.cfg = cfg
        self.sink = sink
        self.pool = ChannelPool()
        self.namesrv = NameServerClient(cfg.namesrv, self.pool, cfg.request_timeout)
        self.subscriptions: dict[str, tuple[str, frozenset[str] | None]] = {}
        self.queues: dict[MessageQueue, QueueState] = {}
        self.routes: dict[str, ReadRoute] = {}
        self.sessions: dict[str, BrokerSession] = {}
        self.offsets: OffsetStore
        #: clustering: the group's retry topic, subscribed to at start, and the send-back
        self.retry_topic: str | None = None
        self.send_back: SendBackClient | None = None
        if cfg.mode is ConsumeMode.CLUSTERING:
            self.offsets = RemoteOffsetStore(
                cfg.group, cfg.client_id, self.pool, self._address_of, cfg.request_timeout
            )
            self.retry_topic = retry_topic(cfg.group)
            self.send_back = SendBackClient(
                self.pool,
                cfg.group,
                cfg.client_id,
                cfg.max_reconsume_times,
                cfg.first_retry_delay_level,
                cfg.request_timeout,
            )
        else:
            # the file outlives this process: named by the group (and the client id only when
            # the user chose one), so a restarted broadcasting consumer finds its offsets
            name = cfg.client_id if cfg.client_id_given else ""
            path = (
                cfg.offset_dir / _file_name(cfg.group, name)
                if cfg.offset_dir is not None
                else default_offset_dir(cfg.group, name or "default") / OFFSETS_FILE
            )
            self.offsets = LocalOffsetStore(path)
        self.locks = QueueLocker(cfg, self.pool)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._rebalance_lock = asyncio.Lock()
        self.started = False
        self.closing = False
        self.rebalances = 0

    # -- subscriptions and lifecycle ----------------------------------------------------------

    def subscribe(self, topic: str, tag_expression: str = "*") -> None:
        self.subscriptions[topic] = check_subscription(topic, tag_expression)
        if self.started:
            for s in self.sessions.values():
                s.poke()
            self._wake.set()

    def unsubscribe(self, topic: str) -> None:
        if topic == self.retry_topic:
            return  # the group's own; a clustering member always reads it
        self.subscriptions.pop(topic, None)
        if self.started:
            for s in self.sessions.values():
                s.poke()
            self._wake.set()

    async def start(self) -> None:
        if self.started:
            return
        if not self.subscriptions:
            raise InvalidArgumentError(
                field="subscriptions", rule="subscribe to at least one topic before start()"
            )
        self.started = True
        try:
            for topic in self.subscriptions:  # an unknown topic fails start() with its reason
                self.routes[topic] = await fetch_route(self.namesrv, topic)
            if self.retry_topic is not None:
                # it has no route until a broker has made it (when this member's session
                # starts there, or at the first send-back): the rebalances find it later
                self.subscriptions.setdefault(self.retry_topic, ("*", None))
                with contextlib.suppress(ApogeeError):
                    self.routes[self.retry_topic] = await fetch_route(
                        self.namesrv, self.retry_topic
                    )
            self._open_sessions()
            if self.cfg.mode is ConsumeMode.CLUSTERING:
                await self._await_sessions(self.cfg.request_timeout)
            await self.rebalance()
        except BaseException:
            await self.close()
            raise
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._rebalance_loop(), name="apogee-rebalance"),
            loop.create_task(self._persist_loop(), name="apogee-offsets"),
        ]
        if self.cfg.orderly:
            self._tasks.append(
                loop.create_task(self.locks.renew_loop(self.queues), name="apogee-locks")
            )

    async def close(self) -> None:
        """Release every queue (commits offsets, unlocks), end the sessions, close channels."""
        if self.closing:
            return
        self.closing = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        async with self._rebalance_lock:
            await asyncio.gather(*(self._release(mq) for mq in list(self.queues)))
        for t in list(self._side_tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await self.offsets.persist_all([])
        if self.send_back is not None:
            await self.send_back.close()
        await asyncio.gather(*(s.stop() for s in self.sessions.values()))
        self.sessions.clear()
        await self.pool.close()

    # -- sessions ------------------------------------------------------------------------------

    def _heartbeat(self) -> consumer_pb2.Heartbeat:
        return consumer_pb2.Heartbeat(
            client_id=self.cfg.client_id,
            group=self.cfg.group,
            mode=_MODES[self.cfg.mode],
            subscriptions=[
                consumer_pb2.Subscription(topic=t, tag_expression=expr)
                for t, (expr, _) in sorted(self.subscriptions.items())
            ],
            heartbeat_interval_ms=int(self.cfg.heartbeat_interval * 1000),
        )

    def _open_sessions(self) -> None:
        addresses = {a for r in self.routes.values() for a in r.addresses.values()}
        for address in sorted(addresses - set(self.sessions)):
            s = BrokerSession(
                address, self.pool, self._heartbeat, self.cfg.heartbeat_interval, self._on_event
            )
            self.sessions[address] = s
            s.start()

    async def _await_sessions(self, timeout: float) -> None:
        """Wait (bounded) until every broker has answered a heartbeat, so that the first
        rebalance sees this consumer among the members."""
        waits = [s.connected.wait() for s in self.sessions.values()]
        if waits:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.gather(*waits)

    def _on_event(self, address: str, event: consumer_pb2.SessionEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind == "members_changed":
            self._wake.set()
        elif kind == "offsets_reset":
            self._spawn(self._apply_reset(address, event.offsets_reset))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _apply_reset(self, address: str, reset: consumer_pb2.OffsetsReset) -> None:
        """The group's offsets at the broker at ``address`` were reset: the queues owned there
        start again from the new offsets."""
        if reset.group != self.cfg.group:
            return
        async with self._rebalance_lock:
            for qo in reset.offsets:
                owned = [
                    mq
                    for mq, qs in self.queues.items()
                    if mq.topic == qo.topic and mq.queue_id == qo.queue_id and qs.address == address
                ]
                for mq in owned:
                    await self._release(mq, commit=False)
                    self.offsets.update(mq, qo.offset, increase_only=False)
                    self._own(mq, address, start_at=qo.offset)
            log.info(
                "offsets of group %s on topic %s were reset; continuing from the new offsets",
                reset.group,
                reset.topic,
            )

    # -- rebalance -----------------------------------------------------------------------------

    async def _rebalance_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.rebalance_interval):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.rebalance()
            except Exception:
                log.exception("rebalance of group %s failed; trying again", self.cfg.group)
                await asyncio.sleep(1.0)

    async def rebalance(self) -> None:
        """Recompute this consumer's queues and take or release the difference."""
        async with self._rebalance_lock:
            if self.closing:
                return
            self.rebalances += 1
            wanted: set[MessageQueue] = set()
            keep_topics: set[str] = set()
            for topic in list(self.subscriptions):
                try:
                    route = await fetch_route(self.namesrv, topic)
                except ApogeeError as err:
                    if topic == self.retry_topic and err.kind.name == "UNKNOWN_TOPIC":
                        log.debug(
                            "route of %s: %s; looking again at the next rebalance", topic, err
                        )
                        continue
                    log.warning("route of %s: %s; keeping its queues as they are", topic, err)
                    keep_topics.add(topic)
                    continue
                self.routes[topic] = route
                self._open_sessions()
                if self.cfg.mode is ConsumeMode.BROADCASTING:
                    wanted |= set(route.queues)
                    continue
                try:
                    members = await group_members(
                        self.pool, route, self.cfg.group, self.cfg.request_timeout
                    )
                except ApogeeError as err:
                    log.warning("members of group %s: %s", self.cfg.group, err)
                    keep_topics.add(topic)
                    continue
                if self.cfg.client_id not in members:
                    log.debug("%s not yet among the members of %s", self.cfg.client_id, members)
                    keep_topics.add(topic)
                    continue
                wanted |= allocate(
                    self.cfg.allocate, self.cfg.group, self.cfg.client_id, route.queues, members
                )
            drop = [mq for mq in self.queues if mq not in wanted and mq.topic not in keep_topics]
            if drop:
                await asyncio.gather(*(self._release(mq) for mq in drop))
            add = sorted(wanted - set(self.queues), key=_order)
            for mq in add:
                address = self.routes[mq.topic].addresses.get(mq.broker_name)
                if address is not None:
                    self._own(mq, address)
            if drop or add:
                log.info(
                    "group %s: %s now reads %d queue(s)",
                    self.cfg.group,
                    self.cfg.client_id,
                    len(self.queues),
                )

    def owned(self) -> list[MessageQueue]:
        return sorted(self.queues, key=_order)

    def _address_of(self, broker_name: str) -> str | None:
        for route in self.routes.values():
            address = route.addresses.get(broker_name)
            if address is not None:
                return address
        return None

    def _own(self, mq: MessageQueue, address: str, start_at: int | None = None) -> None:
        qs = QueueState(mq, address, ProcessQueue())
        self.queues[mq] = qs
        qs.task = asyncio.get_running_loop().create_task(
            self._queue_main(qs, start_at), name=f"apogee-pull-{mq.topic}-{mq.queue_id}"
        )

    async def _release(self, mq: MessageQueue, commit: bool = True) -> None:
        qs = self.queues.pop(mq, None)
        if qs is None:
            return
        qs.pq.drop()
        qs.gone.set()
        qs.space.set()
        qs.lock_granted.set()  # wake a pull loop waiting for its lock; it sees the drop
        if qs.task is not None:
            qs.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await qs.task
        try:
            async with asyncio.timeout(self.cfg.close_timeout):
                await qs.idle.wait()
        except TimeoutError:
            log.warning(
                "%s/%s queue %d: %d listener call(s) still running after %.1fs; their messages "
                "will be delivered again to the queue's next owner",
                mq.broker_name,
                mq.topic,
                mq.queue_id,
                qs.running,
                self.cfg.close_timeout,
            )
        self.sink.released(qs)
        if commit:
            if qs.next_offset >= 0:
                self.offsets.update(mq, qs.pq.offset_to_commit())
            with contextlib.suppress(Exception):
                await self.offsets.persist(mq)
        self.offsets.remove(mq)
        if self.cfg.orderly and qs.locked_until > 0:
            await self.locks.unlock(qs)

    # -- one queue -----------------------------------------------------------------------------

    async def _queue_main(self, qs: QueueState, start_at: int | None) -> None:
        backoff = _MIN_BACKOFF
        while not qs.pq.dropped:
            try:
                if self.cfg.orderly:
                    await self.locks.until_locked(qs)
                if qs.next_offset < 0:
                    qs.next_offset = (
                        start_at if start_at is not None else await self._start_offset(qs)
                    )
                    qs.pq.skip_to(qs.next_offset)
                    self.offsets.update(qs.mq, qs.next_offset, increase_only=False)
                await self._pull_loop(qs)
                return
            except asyncio.CancelledError:
                raise
            except ApogeeError as err:
                log.log(
                    self._level(qs.mq, err, logging.WARNING),
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

    def _level(self, mq: MessageQueue, err: ApogeeError, level: int) -> int:
        """How loud a failure on ``mq`` is: a queue of the retry topic that its broker does
        not have yet (a route of auto-created topics stands in for the real one until the
        brokers register it) is not worth a warning."""
        if mq.topic == self.retry_topic and err.kind.name in _NOT_THERE_YET:
            return logging.DEBUG
        return level

    async def _start_offset(self, qs: QueueState) -> int:
        mq = qs.mq
        resp = await rpc(
            f"broker {mq.broker_name} ({qs.address})",
            self.pool.consumer(qs.address).QueryOffsets(
                consumer_pb2.QueryOffsetsRequest(
                    group=self.cfg.group, topic=mq.topic, queue_ids=[mq.queue_id]
                ),
                timeout=self.cfg.request_timeout,
            ),
        )
        row = next((q for q in resp.queues if q.queue_id == mq.queue_id), None)
        lo, hi = (row.min_offset, row.max_offset) if row is not None else (0, 0)
        if self.cfg.mode is ConsumeMode.CLUSTERING:
            committed = row.committed if row is not None and row.committed >= 0 else None
        else:
            committed = await self.offsets.load(mq)
        if committed is not None:
            return committed
        if mq.topic == self.retry_topic:
            return lo  # the group's own retries: none is ever skipped, whatever consume_from
        how = self.cfg.consume_from
        if how is ConsumeFrom.EARLIEST:
            return lo
        if how is ConsumeFrom.TIMESTAMP:
            qs.skip_before_ms = self.cfg.consume_timestamp_ms
            return lo
        return hi

    async def _pull_loop(self, qs: QueueState) -> None:
        cfg = self.cfg
        mq, pq = qs.mq, qs.pq
        expr, tags = self.subscriptions.get(mq.topic, ("*", None))
        hold_ms = int(cfg.long_poll_timeout * 1000)
        deadline = cfg.long_poll_timeout + cfg.request_timeout
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
            if cfg.orderly and not qs.locked(time.monotonic()):
                await self.locks.until_locked(qs)
                continue
            committed = self.offsets.read(mq)
            request = consumer_pb2.PullRequest(
                group=cfg.group,
                topic=mq.topic,
                queue_id=mq.queue_id,
                offset=qs.next_offset,
                max_messages=cfg.pull_batch_size,
                tag_expression=expr,
                hold_ms=hold_ms,
                client_id=cfg.client_id,
            )
            if committed is not None and cfg.mode is ConsumeMode.CLUSTERING:
                request.commit_offset = committed
            try:
                answer = await self.pool.pull(qs.address, request, deadline, what)
            except ApogeeError as err:
                if qs.gone.is_set():
                    return
                log.log(
                    self._level(mq, err, logging.INFO if err.retriable else logging.WARNING),
                    "pull of %s queue %d from %s failed: %s; again in %.1fs",
                    mq.topic,
                    mq.queue_id,
                    what,
                    err,
                    backoff,
                )
                if not err.retriable:
                    self._wake.set()  # the topic may be gone or moved: rebalance
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
                continue
            backoff = _MIN_BACKOFF
            if qs.gone.is_set():
                return
            self._handle(qs, answer, tags)

    def _full(self, pq: ProcessQueue) -> bool:
        cfg = self.cfg
        return (
            pq.count >= cfg.max_cached_messages_per_queue
            or pq.bytes >= cfg.max_cached_bytes_per_queue
            or (not cfg.orderly and pq.count > 0 and pq.max_span >= cfg.max_span)
        )

    def _handle(self, qs: QueueState, answer: PullAnswer, tags: frozenset[str] | None) -> None:
        mq, pq = qs.mq, qs.pq
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
                    self.cfg.verify_crc,
                    start=answer.start,
                    end=answer.end,
                )
            except CorruptRecordError as err:
                # never skip silently: the same offset is pulled again after a pause
                log.error("%s; pulling it again", err)
                raise
            if tags is not None:  # the broker filters; a stray message is not handed over
                msgs = [m for m in msgs if tag_matches(tags, m.tags or None)]
            if mq.topic == self.retry_topic:
                present_retried(msgs)
            if qs.skip_before_ms:
                fresh = [m for m in msgs if m.store_timestamp_ms >= qs.skip_before_ms]
                if fresh:
                    qs.skip_before_ms = 0
                msgs = fresh
            qs.next_offset = resp.next_offset
            if msgs:
                pq.add(msgs)
            pq.skip_to(resp.next_offset)  # past what the tag filter left out
            self.offsets.update(mq, pq.offset_to_commit())
            if msgs:
                self.sink.deliver(qs, msgs)
        elif status in (consumer_pb2.PULL_NO_NEW_MESSAGE, consumer_pb2.PULL_NO_MATCHED_MESSAGE):
            qs.next_offset = resp.next_offset
            pq.skip_to(resp.next_offset)
            self.offsets.update(mq, pq.offset_to_commit())
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
            self.offsets.update(mq, pq.offset_to_commit(), increase_only=False)
        else:
            log.warning("unexpected pull status %d from %s", status, mq.broker_name)

    def finished(self, qs: QueueState, msgs: list[ReceivedMessage]) -> None:
        """The sink is done with ``msgs`` (consumed, or given up on): move the offset."""
        if qs.pq.dropped:
            return
        self.offsets.update(qs.mq, qs.pq.remove(msgs))
        qs.space.set()

    def retry_stored(self) -> None:
        """A message went to the retry topic: if its route was not known yet, it is now
        (the broker made the topic), so rebalance at once rather than at the next interval."""
        if self.retry_topic is not None and self.retry_topic not in self.routes:
            self._wake.set()

    def committed_orderly(self, qs: QueueState, offset: int) -> None:
        if qs.pq.dropped:
            return
        self.offsets.update(qs.mq, offset)
        qs.space.set()

    # -- offsets -------------------------------------------------------------------------------

    async def _persist_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.offset_persist_interval)
            await self.persist_offsets()

    async def persist_offsets(self) -> None:
        try:
            await self.offsets.persist_all(list(self.queues))
        except Exception:
            log.exception("committing offsets of group %s failed", self.cfg.group)


def check_subscription(topic: str, tag_expression: str) -> tuple[str, frozenset[str] | None]:
    """The subscription as kept (expression, tag set); raises naming the bad field."""
    validate_topic(topic)
    if not isinstance(tag_expression, str):
        raise InvalidArgumentError(
            field="tag_expression", rule=f"must be a string, got {type(tag_expression).__name__}"
        )
    tags = parse_tag_expression(tag_expression, field="tag_expression")
    return (tag_expression.strip() or "*", tags)


def _order(mq: MessageQueue) -> tuple[str, str, int]:
    return (mq.topic, mq.broker_name, mq.queue_id)


def _file_name(group: str, client_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_.@%" else "_" for c in client_id)
    return f"{group}@{safe}.json" if safe else f"{group}.json"
