"""Queue locks of orderly consumers on the injected clock: a granted lock is trusted for
LOCK_TRUST_S, renewed with one request per broker, and given up when another consumer got it."""

from __future__ import annotations

from typing import cast

import pytest

from apogee.client._rpc import ChannelPool
from apogee.client.consumer.config import ConsumerConfig
from apogee.client.consumer.locking import LOCK_TRUST_S, QueueLocker
from apogee.client.consumer.process_queue import ProcessQueue
from apogee.client.consumer.queue_state import QueueState
from apogee.client.producer.routes import MessageQueue
from apogee.common.clock import ManualClock
from apogee.v1 import consumer_pb2

pytestmark = pytest.mark.unit


class Broker:
    """Answers LockQueues, granting the queues in ``grant``; records each request."""

    def __init__(self) -> None:
        self.grant: set[tuple[str, int]] = set()
        self.requests: list[tuple[str, list[tuple[str, int]]]] = []

    def consumer(self, address: str) -> Broker.Stub:
        return Broker.Stub(self, address)

    class Stub:
        def __init__(self, broker: Broker, address: str) -> None:
            self.broker = broker
            self.address = address

        async def LockQueues(
            self, request: consumer_pb2.LockQueuesRequest, timeout: float
        ) -> consumer_pb2.LockQueuesResponse:
            asked = [(q.topic, q.queue_id) for q in request.queues]
            self.broker.requests.append((self.address, asked))
            return consumer_pb2.LockQueuesResponse(
                locked=[
                    consumer_pb2.QueueRef(topic=t, queue_id=i)
                    for t, i in asked
                    if (t, i) in self.broker.grant
                ]
            )


def setup(clock: ManualClock) -> tuple[QueueLocker, Broker]:
    cfg = ConsumerConfig.create(
        "127.0.0.1:9876", "g", {"client_id": "me", "orderly": True, "clock": clock}
    )
    broker = Broker()
    return QueueLocker(cfg, cast(ChannelPool, broker)), broker


def state(queue_id: int, address: str = "127.0.0.1:1") -> QueueState:
    return QueueState(MessageQueue("T", "b1", queue_id), address, ProcessQueue())


async def test_a_granted_lock_is_trusted_for_a_while_on_the_consumers_clock() -> None:
    clock = ManualClock()
    locker, broker = setup(clock)
    qs = state(0)
    broker.grant = {("T", 0)}
    await locker.until_locked(qs)
    assert locker.holds(qs)
    assert qs.lock_granted.is_set()
    clock.advance(LOCK_TRUST_S - 0.001)
    assert locker.holds(qs)
    clock.advance(0.001)
    assert not locker.holds(qs)  # not renewed in time: consumption stops


async def test_renewal_asks_each_broker_once_and_pauses_a_queue_another_consumer_got() -> None:
    clock = ManualClock()
    locker, broker = setup(clock)
    a, b, c = state(0), state(1), state(2, address="127.0.0.1:2")
    broker.grant = {("T", 0), ("T", 1), ("T", 2)}
    await locker.renew([a, b, c])
    assert sorted(broker.requests) == [
        ("127.0.0.1:1", [("T", 0), ("T", 1)]),
        ("127.0.0.1:2", [("T", 2)]),
    ]
    broker.grant = {("T", 0), ("T", 2)}
    clock.advance(10.0)
    await locker.renew([a, b, c])
    assert locker.holds(a)
    assert locker.holds(c)
    assert not locker.holds(b)
    assert not b.lock_granted.is_set()
    clock.advance(LOCK_TRUST_S - 1.0)
    assert locker.holds(a)  # renewed 10 s in: trusted until 10 + LOCK_TRUST_S
