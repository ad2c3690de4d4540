"""Queue locks of orderly consumers (RocketMQ's lockBatchMQ / unlockBatchMQ).

An orderly consumer consumes a queue only while it holds the queue's lock at its broker. A
granted lock is trusted locally for :data:`LOCK_TRUST_S` (the broker keeps it for
``lock_expiry_ms``, 60 s by default), so a consumer that cannot renew stops in time; locks are
renewed every ``lock_renew_interval`` (by a :class:`LockRenewer`, one request per broker), and
a queue waiting for its lock asks again every :data:`LOCK_RETRY_S`. A lock that went to another
consumer pauses the queue. Trust is measured on the consumer's injected clock
(``ConsumerConfig.clock``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

import grpc
import grpc.aio

from apogee.client._rpc import ChannelPool, rpc
from apogee.client.consumer.config import ConsumerConfig
from apogee.client.consumer.queue_state import QueueState
from apogee.common.aio import cancel_and_wait
from apogee.common.errors import ApogeeError
from apogee.v1 import consumer_pb2

log = logging.getLogger(__name__)

#: A lock is trusted locally for this long after the broker granted it (the broker keeps it
#: for lock_expiry_ms, 60 s by default), so a consumer that cannot renew stops in time.
LOCK_TRUST_S = 30.0
#: How often a queue waiting for its lock asks again.
LOCK_RETRY_S = 0.5


class QueueLocker:
    """Locks, renews and unlocks the queues of one orderly consumer."""

    def __init__(self, cfg: ConsumerConfig, pool: ChannelPool) -> None:
        self.cfg = cfg
        self.pool = pool
        self.clock = cfg.clock

    def holds(self, qs: QueueState) -> bool:
        """Whether ``qs``'s lock is trusted now."""
        return qs.locked(self.clock.monotonic())

    async def until_locked(self, qs: QueueState) -> None:
        while not qs.pq.dropped and not self.holds(qs):
            await self.lock(qs.address, [qs])
            if self.holds(qs):
                return
            qs.lock_granted.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LOCK_RETRY_S):
                    await qs.lock_granted.wait()

    async def lock(self, address: str, states: list[QueueState]) -> None:
        now = self.clock.monotonic()
        try:
            resp = await rpc(
                f"broker at {address}",
                self.pool.consumer(address).LockQueues(
                    consumer_pb2.LockQueuesRequest(
                        group=self.cfg.group,
                        client_id=self.cfg.client_id,
                        queues=[
                            consumer_pb2.QueueRef(topic=s.mq.topic, queue_id=s.mq.queue_id)
                            for s in states
                        ],
                    ),
                    timeout=self.cfg.request_timeout,
                ),
            )
        except ApogeeError as err:
            log.warning("locking %d queue(s) at %s failed: %s", len(states), address, err)
            return
        granted = {(q.topic, q.queue_id) for q in resp.locked}
        for s in states:
            if (s.mq.topic, s.mq.queue_id) in granted:
                s.locked_until = now + LOCK_TRUST_S
                s.lock_granted.set()
            elif s.locked_until > 0:
                log.warning(
                    "%s queue %d: the lock went to another consumer; consumption paused",
                    s.mq.topic,
                    s.mq.queue_id,
                )
                s.locked_until = 0.0
                s.lock_granted.clear()

    async def unlock(self, qs: QueueState) -> None:
        with contextlib.suppress(ApogeeError, grpc.aio.AioRpcError):
            await rpc(
                f"broker at {qs.address}",
                self.pool.consumer(qs.address).UnlockQueues(
                    consumer_pb2.UnlockQueuesRequest(
                        group=self.cfg.group,
                        client_id=self.cfg.client_id,
                        queues=[consumer_pb2.QueueRef(topic=qs.mq.topic, queue_id=qs.mq.queue_id)],
                    ),
                    timeout=self.cfg.request_timeout,
                ),
            )
        qs.locked_until = 0.0

    async def renew(self, states: Iterable[QueueState]) -> None:
        """Renew the locks of ``states``, one request per broker."""
        by_address: dict[str, list[QueueState]] = {}
        for qs in states:
            by_address.setdefault(qs.address, []).append(qs)
        await asyncio.gather(*(self.lock(a, s) for a, s in by_address.items()))


class LockRenewer:
    """The background loop that renews an orderly consumer's locks every
    ``lock_renew_interval``: those of the queues ``states()`` gives at each turn."""

    def __init__(self, locker: QueueLocker, states: Callable[[], Iterable[QueueState]]) -> None:
        self._locker = locker
        self._states = states
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="apogee-locks")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._locker.cfg.lock_renew_interval)
            await self._locker.renew(list(self._states()))
