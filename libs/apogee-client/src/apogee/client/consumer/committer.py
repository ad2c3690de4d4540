"""The offset committer: how far a consumer got in each owned queue, kept in memory as
messages are finished and committed in bulk on the consumer's clock.

A queue's offset is the smallest offset still in flight in its :class:`ProcessQueue` (or one
past the last one fetched when none is): :meth:`OffsetCommitter.finished` moves it as the sink
finishes messages, in any order. The committer persists the offsets of every owned queue at
once (one request per broker, or one file write) every ``offset_persist_interval`` as measured
on the injected clock (``ConsumerConfig.clock``), when the application asks
(:meth:`~OffsetCommitter.commit_all`), when a queue is released, and at close. In clustering
mode the offset also rides on each fetch (:meth:`~OffsetCommitter.piggyback`).

A queue's offset never moves back while the queue is owned: every move is increase-only but
:meth:`~OffsetCommitter.start_at`, where the queue starts (again): at its stored offset when it
is taken, at the offset it was reset to, at the one its broker names when the offset is out of
range. Every commit sends what is held when it goes out, and commits of a queue reach its broker
in order (see :mod:`~apogee.client.consumer.offset_store` and, for the ones riding on the
delivery stream, :mod:`~apogee.client.consumer.stream_source`), so what the broker holds does
not move back either.

The store behind it is an :class:`~apogee.client.consumer.offset_store.OffsetStore`: at the
brokers for clustering, in a local file for broadcasting (:func:`make_offset_store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection

from apogee.client._rpc import ChannelPool
from apogee.client.consumer.config import ConsumeMode, ConsumerConfig
from apogee.client.consumer.offset_store import (
    OFFSETS_FILE,
    LocalOffsetStore,
    OffsetStore,
    RemoteOffsetStore,
    default_offset_dir,
)
from apogee.client.consumer.queue_state import QueueState
from apogee.client.consumer.records import ReceivedMessage
from apogee.client.producer.routes import MessageQueue
from apogee.common.aio import cancel_and_wait
from apogee.common.clock import Clock

__all__ = ["OffsetCommitter", "make_offset_store"]

log = logging.getLogger(__name__)

#: The shortest wait of the commit loop (when a commit is already due).
_MIN_WAIT = 0.01


def make_offset_store(
    cfg: ConsumerConfig, pool: ChannelPool, address_of: Callable[[str], str | None]
) -> OffsetStore:
    """The group's offsets at the brokers (clustering) or in a local file (broadcasting)."""
    if cfg.mode is ConsumeMode.CLUSTERING:
        return RemoteOffsetStore(cfg.group, cfg.client_id, pool, address_of, cfg.request_timeout)
    # the file outlives this process: named by the group (and the client id only when the
    # user chose one), so a restarted broadcasting consumer finds its offsets
    name = cfg.client_id if cfg.client_id_given else ""
    path = (
        cfg.offset_dir / _file_name(cfg.group, name)
        if cfg.offset_dir is not None
        else default_offset_dir(cfg.group, name or "default") / OFFSETS_FILE
    )
    return LocalOffsetStore(path)


class OffsetCommitter:
    """Offsets of the queues ``owned()`` gives, moved in memory and committed in bulk."""

    def __init__(
        self,
        store: OffsetStore,
        owned: Callable[[], Collection[MessageQueue]],
        *,
        group: str,
        interval: float,
        clock: Clock,
        piggyback: bool,
    ) -> None:
        """``piggyback``: the offsets also ride on fetches (clustering)."""
        self.store = store
        self._owned = owned
        self._group = group
        self._interval = interval
        self._clock = clock
        self._piggyback = piggyback
        self._due = clock.monotonic() + interval
        self._task: asyncio.Task[None] | None = None

    # -- in memory ---------------------------------------------------------------------------

    def start_at(self, mq: MessageQueue, offset: int) -> None:
        """``mq`` starts (or starts again) at ``offset``, lower than before or not."""
        self.store.update(mq, offset, increase_only=False)

    def advance(self, mq: MessageQueue, offset: int) -> None:
        """``mq`` got as far as ``offset`` (a lower one than held is ignored)."""
        self.store.update(mq, offset)

    def finished(self, qs: QueueState, msgs: list[ReceivedMessage]) -> None:
        """The sink is done with ``msgs``: the offset moves to the smallest still in flight.
        Nothing moves once the queue's release committed (its next owner has it); calls that
        end while the release waits for them do count, so the next owner starts after them."""
        if not qs.let_go:
            self.store.update(qs.mq, qs.pq.remove(msgs))

    def held(self, mq: MessageQueue) -> int | None:
        """The in-memory offset of ``mq`` (None: none is known)."""
        return self.store.read(mq)

    def piggyback(self, mq: MessageQueue) -> int | None:
        """The offset to send along with the next fetch of ``mq`` (None: nothing to send)."""
        return self.store.read(mq) if self._piggyback else None

    async def load(self, mq: MessageQueue) -> int | None:
        """The stored offset of ``mq`` (None: nothing stored)."""
        return await self.store.load(mq)

    # -- committing --------------------------------------------------------------------------

    async def commit_all(self) -> None:
        """Commit the offsets of every owned queue now; a failure is logged, never raised."""
        try:
            await self.store.persist_all(list(self._owned()))
        except Exception:
            log.exception("committing offsets of group %s failed", self._group)

    async def tick(self) -> None:
        """Commit every owned queue's offset if ``interval`` has passed on the clock since the
        last periodic commit (or the start)."""
        now = self._clock.monotonic()
        if now < self._due:
            return
        self._due = now + self._interval
        await self.commit_all()

    async def release(self, mq: MessageQueue, offset: int | None) -> None:
        """``mq`` is no longer owned: commit ``offset`` (None: what is held; a lower one than
        held is ignored) and forget it."""
        if offset is not None:
            self.store.update(mq, offset)
        with contextlib.suppress(Exception):
            await self.store.persist(mq)
        self.store.remove(mq)

    def forget(self, mq: MessageQueue) -> None:
        """``mq`` is no longer owned and its offset is not committed (it was reset)."""
        self.store.remove(mq)

    # -- the periodic commit -----------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._due = self._clock.monotonic() + self._interval
            self._task = asyncio.get_running_loop().create_task(self._run(), name="apogee-offsets")

    async def stop(self) -> None:
        """Stop the periodic commit (the owned queues' offsets are committed as they are
        released). A commit already sent still runs to its answer, and the store sends the
        next one to that broker only after it (see :mod:`~.offset_store`)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def close(self) -> None:
        """Stop, and flush what the store still holds."""
        await self.stop()
        with contextlib.suppress(Exception):
            await self.store.persist_all([])

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(max(self._due - self._clock.monotonic(), _MIN_WAIT))
            await self.tick()


def _file_name(group: str, client_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_.@%" else "_" for c in client_id)
    return f"{group}@{safe}.json" if safe else f"{group}.json"
