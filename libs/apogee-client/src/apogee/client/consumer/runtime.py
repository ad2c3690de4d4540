"""What every consumer runs, wired together: sessions, the rebalancer, one fetcher per owned
queue, the offset committer and, for orderly consumers, the lock keeper.

A :class:`ConsumerRuntime` owns a set of queues (its share after rebalance). For each it keeps a
:class:`~apogee.client.consumer.queue_state.QueueState` (the
:class:`~apogee.client.consumer.process_queue.ProcessQueue` of messages fetched and not yet
finished, where the next fetch starts) and a
:class:`~apogee.client.consumer.fetcher.QueueFetcher` that fetches what its broker pushes (one
delivery stream per broker) and hands what arrives to a
:class:`~apogee.client.consumer.queue_state.Sink` (the push consumer's listener workers, or the
pull consumer's buffer). The sink reports finished messages back with
:meth:`ConsumerRuntime.finished`, which moves the queue's offset to the smallest offset still
unfinished; the :class:`~apogee.client.consumer.committer.OffsetCommitter` commits offsets
every ``offset_persist_interval``, on every fetch (piggybacked), when a queue is taken away,
and at close.

The pieces, each in its own module:

- :mod:`~apogee.client.consumer.session`: one ``Session`` stream per broker (membership,
  member changes, offset resets);
- :mod:`~apogee.client.consumer.rebalance`: :class:`Rebalancer`, which queues to read;
- :mod:`~apogee.client.consumer.fetcher`: :class:`QueueFetcher`, one per owned queue, over a
  :class:`~apogee.client.consumer.fetcher.RecordSource`;
- :mod:`~apogee.client.consumer.committer`: :class:`OffsetCommitter`;
- :mod:`~apogee.client.consumer.locking`: :class:`QueueLocker` and :class:`LockRenewer`.

A clustering runtime also reads the group's retry topic ``%RETRY%<group>`` (see
:mod:`apogee.client.consumer.retry`): it is subscribed at start, its queues are shared like any
topic's once the brokers route it (a missing route is looked for again at the next rebalance,
quietly), a queue of it without a committed offset starts at its earliest message whatever
``consume_from`` says, and its messages are handed over under their original topic.

A queue taken away (rebalance, offset reset, close) is released cleanly: no more fetches, the
listener calls already running get up to ``close_timeout`` to finish, messages not started are
abandoned (the next owner gets them: delivery is at least once), and the offset is committed,
never below one committed before: the commit that was waiting to ride on the delivery stream is
dropped (it is older), and the last offset goes out on the stream too, after everything that
rode on it before. Only then does the queue's subscription end: a clustering consumer
subscribes exclusively, so the queue's next owner in the group, refused until then
(``QUEUE_HELD``), never reads it while this one does, and starts from the offset just
committed. At close the rebalancer lets a release under way finish first.
Orderly consumers also hold a lock on each queue at its broker: a queue is consumed only while
the lock is held, its start offset is read after the lock is granted, and it is unlocked only
after its offset is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Tracer

from apogee.client._rpc import ChannelPool, NameServerClient
from apogee.client.consumer.committer import OffsetCommitter, make_offset_store
from apogee.client.consumer.config import ConsumeMode, ConsumerConfig
from apogee.client.consumer.fetcher import (
    EVERY_MESSAGE,
    FetchContext,
    QueueFetcher,
    RecordSource,
    Subscription,
    find_start_offset,
)
from apogee.client.consumer.locking import LockRenewer, QueueLocker
from apogee.client.consumer.process_queue import ProcessQueue
from apogee.client.consumer.queue_state import QueueState, Sink
from apogee.client.consumer.rebalance import ClusterDirectory, Rebalancer, queue_order
from apogee.client.consumer.records import ReceivedMessage
from apogee.client.consumer.retry import SendBackClient
from apogee.client.consumer.session import Sessions
from apogee.client.consumer.stream_source import StreamSource
from apogee.client.message import check_text
from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import ApogeeError, InvalidArgumentError
from apogee.common.filtering import parse_selection
from apogee.common.topics import retry_topic, validate_topic
from apogee.v1 import consumer_pb2

if TYPE_CHECKING:
    from apogee.client.metrics import ConsumerMetrics

__all__ = ["ConsumerRuntime", "QueueState", "Sink", "check_subscription"]

log = logging.getLogger(__name__)

_MODES = {
    ConsumeMode.CLUSTERING: consumer_pb2.CLUSTERING,
    ConsumeMode.BROADCASTING: consumer_pb2.BROADCASTING,
}


class ConsumerRuntime:
    def __init__(
        self,
        cfg: ConsumerConfig,
        sink: Sink,
        source: RecordSource | None = None,
        tracer: Tracer | None = None,
        metrics: ConsumerMetrics | None = None,
    ) -> None:
        """``source``: where the fetchers' records come from (by default, what the brokers
        push on one delivery stream each); ``tracer``: the consumer's, when it traces;
        ``metrics``: the consumer's, when it counts them."""
        self.cfg = cfg
        self.sink = sink
        self.pool = ChannelPool(cfg.security)
        self.namesrv = NameServerClient(cfg.namesrv, self.pool, cfg.request_timeout)
        self.subscriptions: dict[str, Subscription] = {}
        self.queues: dict[MessageQueue, QueueState] = {}
        self._fetchers: dict[MessageQueue, QueueFetcher] = {}
        #: clustering: the group's retry topic, subscribed to at start, and the send-back
        self.retry_topic: str | None = None
        self.send_back: SendBackClient | None = None
        if cfg.mode is ConsumeMode.CLUSTERING:
            self.retry_topic = retry_topic(cfg.group)
            self.send_back = SendBackClient(
                self.pool,
                cfg.group,
                cfg.client_id,
                cfg.max_reconsume_times,
                cfg.first_retry_delay_level,
                cfg.request_timeout,
            )
        #: held while the owned queues change (rebalance, offset reset, close)
        self._ownership = asyncio.Lock()
        self._directory = ClusterDirectory(self.namesrv, self.pool, cfg.group, cfg.request_timeout)
        self.sessions = Sessions(
            self.pool,
            self._heartbeat,
            cfg.heartbeat_interval,
            self._on_event,
            on_end=self._directory.session_ended,
        )
        self.rebalancer = Rebalancer(
            cfg,
            self._directory,
            self,
            self.subscriptions,
            lock=self._ownership,
            retry_topic=self.retry_topic,
            on_route=lambda route: self.sessions.open(route.addresses.values()),
        )
        self.committer = OffsetCommitter(
            make_offset_store(cfg, self.pool, self.rebalancer.address_of),
            # a queue another member still reads (QUEUE_HELD) is not committed: what this one
            # holds for it is only where it would start, behind what the other commits
            lambda: [mq for mq, qs in self.queues.items() if qs.reading],
            group=cfg.group,
            interval=cfg.offset_persist_interval,
            clock=cfg.clock,
            piggyback=cfg.mode is ConsumeMode.CLUSTERING,
        )
        self.locks = QueueLocker(cfg, self.pool) if cfg.orderly else None
        self._renewer = (
            LockRenewer(self.locks, self.queues.values) if self.locks is not None else None
        )
        #: the default source, which also carries a released queue's last commit
        self._streams: StreamSource | None = None
        if source is None:
            source = self._streams = StreamSource(cfg, self.pool)
        self.source: RecordSource = source
        self._fetch = FetchContext(
            cfg=cfg,
            source=self.source,
            committer=self.committer,
            sink=sink,
            subscriptions=self.subscriptions,
            start_offset=functools.partial(
                find_start_offset, cfg, self.pool, self.committer, self.retry_topic
            ),
            locker=self.locks,
            retry_topic=self.retry_topic,
            on_lost=self.rebalancer.wake,
            tracer=tracer,
            metrics=metrics,
        )
        self._side_tasks: set[asyncio.Task[None]] = set()
        self.started = False
        self.closing = False

    # -- subscriptions and lifecycle ----------------------------------------------------------

    def subscribe(self, topic: str, tag_expression: str = "*", sql: str = "") -> None:
        self.subscriptions[topic] = check_subscription(topic, tag_expression, sql)
        if self.started:
            self.sessions.poke()
            self.rebalancer.wake()

    def unsubscribe(self, topic: str) -> None:
        if topic == self.retry_topic:
            return  # the group's own; a clustering member always reads it
        self.subscriptions.pop(topic, None)
        if self.started:
            self.sessions.poke()
            self.rebalancer.wake()

    async def start(self) -> None:
        if self.started:
            return
        if not self.subscriptions:
            raise InvalidArgumentError(
                field="subscriptions", rule="subscribe to at least one topic before start()"
            )
        self.started = True
        routes = self.rebalancer.routes
        try:
            for topic in self.subscriptions:  # an unknown topic fails start() with its reason
                routes[topic] = await self._directory.route(topic)
            if self.retry_topic is not None:
                # it has no route until a broker has made it (when this member's session
                # starts there, or at the first send-back): the rebalances find it later
                self.subscriptions.setdefault(self.retry_topic, EVERY_MESSAGE)
                with contextlib.suppress(ApogeeError):
                    routes[self.retry_topic] = await self._directory.route(self.retry_topic)
            self.sessions.open(a for r in routes.values() for a in r.addresses.values())
            if self.cfg.mode is ConsumeMode.CLUSTERING:
                # so that the first rebalance sees this consumer among the members
                await self.sessions.wait_connected(self.cfg.request_timeout)
            await self.rebalancer.rebalance(read_routes=False)  # the routes were just read
            await self._placed(self.cfg.request_timeout)
        except BaseException:
            await self.close()
            raise
        self.rebalancer.start()
        self.committer.start()
        if self._renewer is not None:
            self._renewer.start()

    async def _placed(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until every queue owned knows where it starts, so that
        with ``consume_from="latest"`` a message sent once ``start()`` has returned is one the
        consumer reads. A queue that cannot know it yet (its broker does not answer, an
        orderly queue whose lock another member holds) is waited for no longer: its fetcher
        goes on trying."""
        waits = [qs.placed.wait() for qs in self.queues.values() if not qs.placed.is_set()]
        if waits:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.gather(*waits)

    async def close(self) -> None:
        """Release every queue (commits offsets, unlocks), end the sessions, close channels."""
        if self.closing:
            return
        self.closing = True
        await self.rebalancer.stop()
        await self.committer.stop()
        if self._renewer is not None:
            await self._renewer.stop()
        async with self._ownership:
            await asyncio.gather(*(self.release(mq) for mq in list(self.queues)))
        for t in list(self._side_tasks):
            t.cancel()
        await self.committer.close()
        await self.source.close()
        if self.send_back is not None:
            await self.send_back.close()
        await self.sessions.stop()
        await self.pool.close()

    # -- sessions ------------------------------------------------------------------------------

    def _heartbeat(self) -> consumer_pb2.Heartbeat:
        return consumer_pb2.Heartbeat(
            client_id=self.cfg.client_id,
            group=self.cfg.group,
            mode=_MODES[self.cfg.mode],
            subscriptions=[
                consumer_pb2.Subscription(
                    topic=t, tag_expression=s.tag_expression, sql_expression=s.sql_expression
                )
                for t, s in sorted(self.subscriptions.items())
            ],
            heartbeat_interval_ms=int(self.cfg.heartbeat_interval * 1000),
        )

    def _on_event(self, address: str, event: consumer_pb2.SessionEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind == "members_changed":
            if event.members_changed.group == self.cfg.group:
                self._directory.members_pushed(address, event.members_changed.client_ids)
            self.rebalancer.wake(read_routes=False)
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
        async with self._ownership:
            for qo in reset.offsets:
                owned = [
                    mq
                    for mq, qs in self.queues.items()
                    if mq.topic == qo.topic and mq.queue_id == qo.queue_id and qs.address == address
                ]
                for mq in owned:
                    await self.release(mq, commit=False)
                    self.committer.start_at(mq, qo.offset)
                    self.take(mq, address, start_at=qo.offset)
            log.info(
                "offsets of group %s on topic %s were reset; continuing from the new offsets",
                reset.group,
                reset.topic,
            )

    # -- the owned queues (what the rebalancer changes) ---------------------------------------

    async def rebalance(self) -> None:
        """Recompute this consumer's queues and take or release the difference."""
        await self.rebalancer.rebalance()

    @property
    def rebalances(self) -> int:
        return self.rebalancer.rebalances

    def owned(self) -> list[MessageQueue]:
        return sorted(self.queues, key=queue_order)

    def take(self, mq: MessageQueue, address: str, start_at: int | None = None) -> None:
        """Start fetching ``mq`` from its broker at ``address`` (from ``start_at``, else from
        where the group got to)."""
        qs = QueueState(mq, address, ProcessQueue())
        self.queues[mq] = qs
        fetcher = self._fetchers[mq] = QueueFetcher(self._fetch, qs, start_at)
        fetcher.start()

    async def release(self, mq: MessageQueue, commit: bool = True) -> None:
        """Stop fetching ``mq``, let its running listener calls finish (bounded), commit its
        offset (unless ``commit`` is false: it was reset) and unlock it."""
        qs = self.queues.pop(mq, None)
        if qs is None:
            return
        fetcher = self._fetchers.pop(mq)
        qs.pq.drop()
        qs.gone.set()
        qs.space.set()
        qs.lock_granted.set()  # wake a fetcher waiting for its lock; it sees the drop
        await fetcher.stop()
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
        qs.let_go = True
        self.sink.released(qs)
        try:
            if commit and qs.reading:
                if qs.next_offset >= 0:
                    self.committer.advance(mq, qs.pq.offset_to_commit())
                last = self.committer.held(mq)
                if last is not None and self._streams is not None:
                    # on the stream as well: after the commits that rode on it before (a
                    # commit overtaken by an older one would take the group's offset back)
                    self._streams.commit_released(mq, qs.address, last)
                await self.committer.release(mq, last)
            else:
                self.committer.forget(mq)
        finally:
            # the queue's subscription goes last, after the commit on its stream: until then
            # no other member of the group reads it, so the next owner starts once the
            # listener calls ended, from the offset just committed
            fetcher.let_go(keep_commit=commit and qs.reading)
        if self.locks is not None and qs.locked_until > 0:
            await self.locks.unlock(qs)

    # -- what the sink reports -----------------------------------------------------------------

    def finished(self, qs: QueueState, msgs: list[ReceivedMessage]) -> None:
        """The sink is done with ``msgs`` (consumed, or given up on): move the offset (a
        released queue's too, until its release commits)."""
        if qs.let_go:
            return
        self.committer.finished(qs, msgs)
        qs.space.set()

    def committed_orderly(self, qs: QueueState, offset: int) -> None:
        if qs.pq.dropped:
            return
        self.committer.advance(qs.mq, offset)
        qs.space.set()

    def retry_stored(self) -> None:
        """A message went to the retry topic: if its route was not known yet, it is now
        (the broker made the topic), so rebalance at once rather than at the next interval."""
        if self.retry_topic is not None and self.retry_topic not in self.rebalancer.routes:
            self.rebalancer.wake()

    async def persist_offsets(self) -> None:
        """Commit the offsets of every owned queue now."""
        await self.committer.commit_all()


#: What no tag expression holds but SQL92 conditions do: a comparison or a quote.
_LOOKS_LIKE_SQL = re.compile(r"[=<>']")


def check_subscription(topic: str, tag_expression: str, sql: str = "") -> Subscription:
    """The subscription as kept; raises naming the bad field (for an SQL92 condition that
    does not parse, the position too)."""
    validate_topic(topic)
    if not isinstance(tag_expression, str):
        raise InvalidArgumentError(
            field="tag_expression", rule=f"must be a string, got {type(tag_expression).__name__}"
        )
    if _LOOKS_LIKE_SQL.search(tag_expression):
        raise InvalidArgumentError(
            field="tag_expression",
            rule=f"{tag_expression!r} looks like an SQL92 condition, which a tag expression "
            "cannot hold (it would match no tag): pass it as the SQL filter (subscribe(topic, "
            "sql=...), apogee consume --sql); a tag with one of = < > ' is selected with "
            "sql=\"TAGS = '...'\"",
        )
    check_text("tag_expression", tag_expression)
    check_text("sql_expression", sql)
    sel = parse_selection(tag_expression, sql)
    return Subscription(tag_expression.strip() or "*", sql, sel)
