"""The producer's one send state machine, against a fake transport that reads the send records
as a broker does and answers as one: every mode (single, ordered, batch, oneway) goes through the
same attempts, retries skip the broker that just failed, a batch retries only what failed, and a
oneway send is tried once."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from apogee.client import Message, Producer
from apogee.client.producer.routes import TopicRoute
from apogee.codec import HEADER_SIZE, decode
from apogee.common.errors import (
    ApogeeError,
    InvalidQueueIdError,
    PermissionDeniedError,
    UnavailableError,
)
from apogee.rpc.errors import to_status
from apogee.v1 import broker_pb2

pytestmark = pytest.mark.unit

ADDRESSES = {"broker-a": "127.0.0.1:1", "broker-b": "127.0.0.1:2"}


@dataclass
class FakeBrokers:
    """Answers send requests: ``fail(broker, body) -> error or None`` decides per message;
    ``down`` brokers fail whole requests."""

    fail: Callable[[str, bytes], ApogeeError | None] = lambda broker, body: None
    down: set[str] = field(default_factory=set)
    seen: list[tuple[str, list[bytes]]] = field(default_factory=list)
    next_offset: int = 0
    #: queues each broker has (0: any queue id is accepted)
    write_queues: int = 0
    #: queue ids of the messages each broker stored
    queues_seen: dict[str, list[int]] = field(default_factory=dict)

    async def send(
        self, address: str, request: bytes, timeout: float, what: str, streams: int = 1
    ) -> broker_pb2.SendMessagesResponse:
        broker = next(name for name, a in ADDRESSES.items() if a == address)
        data = broker_pb2.SendMessagesRequest.FromString(request).records
        bodies = []
        resp = broker_pb2.SendMessagesResponse(broker_name=broker, store_timestamp_ms=99)
        offsets = []
        pos = 0
        while pos < len(data):
            size = int.from_bytes(data[pos : pos + 4], "little")
            assert size > HEADER_SIZE
            m = decode(data[pos : pos + size], "request", verify_crc=False)
            bodies.append(m.body)
            err = self.fail(broker, m.body)
            if err is None and self.write_queues and m.queue_id >= self.write_queues:
                err = InvalidQueueIdError(
                    value=m.queue_id, rule=f"topic 'T' has {self.write_queues} write queues"
                )
            if err is None:
                self.queues_seen.setdefault(broker, []).append(m.queue_id)
                offsets.append(self.next_offset)
                self.next_offset += 1
            else:
                offsets.append(-1)
                resp.results.add(index=len(bodies) - 1, status=to_status(err))
            pos += size
        self.seen.append((broker, bodies))
        await asyncio.sleep(0)
        if broker in self.down:
            raise UnavailableError(what=f"broker {broker}", detail="down")
        resp.queue_offsets = struct.pack(f"<{len(offsets)}q", *offsets)
        return resp


def wire_up(producer: Producer, brokers: FakeBrokers, topic: str = "T") -> None:
    """A cached route of two brokers of 2 queues each, and the fake transport."""
    route = TopicRoute.build(topic, [("broker-a", 2, 6), ("broker-b", 2, 6)], ADDRESSES)
    routes = producer._routes
    routes._routes[topic] = route
    routes._addresses.update(ADDRESSES)
    routes._min_refresh_interval = 1e9
    routes._fetched_at[topic] = routes._clock.monotonic()
    producer._pool.send = brokers.send  # type: ignore[method-assign]


def unavailable(broker: str) -> UnavailableError:
    return UnavailableError(what=f"broker {broker}", detail="busy")


async def test_a_single_send_is_retried_on_the_other_broker() -> None:
    brokers = FakeBrokers(fail=lambda b, _: unavailable(b) if b == "broker-a" else None)
    async with Producer("127.0.0.1:9", latency_fault_tolerance=False) as producer:
        wire_up(producer, brokers)
        results = [await producer.send(Message("T", f"m{i}".encode())) for i in range(4)]
        assert {r.broker_name for r in results} == {"broker-b"}
        assert all(r.store_timestamp_ms == 99 and r.topic == "T" for r in results)
        # every send that went to broker-a first went to broker-b next, never a again
        tried = [b for b, _ in brokers.seen]
        for i, b in enumerate(tried):
            if b == "broker-a":
                assert tried[i + 1] == "broker-b"
        assert producer.stats().retries == tried.count("broker-a")


async def test_a_batch_retries_only_the_messages_that_failed() -> None:
    def fail(broker: str, body: bytes) -> ApogeeError | None:
        return unavailable(broker) if broker == "broker-a" and body in (b"b1", b"b3") else None

    brokers = FakeBrokers(fail=fail)
    async with Producer("127.0.0.1:9", latency_fault_tolerance=False) as producer:
        wire_up(producer, brokers)
        for _ in range(3):  # round robin reaches broker-a within a few batches
            brokers.seen.clear()
            results = await producer.send_batch([Message("T", f"b{i}".encode()) for i in range(4)])
            assert [r.message_id for r in results] == sorted(
                {r.message_id for r in results}, key=[r.message_id for r in results].index
            )
            if brokers.seen[0][0] == "broker-a":
                assert brokers.seen == [
                    ("broker-a", [b"b0", b"b1", b"b2", b"b3"]),
                    ("broker-b", [b"b1", b"b3"]),
                ]
                assert [r.broker_name for r in results] == [
                    "broker-a",
                    "broker-b",
                    "broker-a",
                    "broker-b",
                ]
                break
        else:
            pytest.fail("no batch went to broker-a first")


async def test_a_non_retriable_error_ends_the_send_at_once() -> None:
    bad = PermissionDeniedError(what="topic 'T'", rule="is not writable on broker broker-a")
    brokers = FakeBrokers(fail=lambda b, body: bad if body == b"bad" else None)
    async with Producer("127.0.0.1:9") as producer:
        wire_up(producer, brokers)
        with pytest.raises(PermissionDeniedError, match="is not writable"):
            await producer.send(Message("T", b"bad"))
        assert len(brokers.seen) == 1
        assert producer.stats().retries == 0


@pytest.mark.parametrize("ordered", [False, True])
async def test_a_queue_the_broker_lacks_fetches_the_route_afresh_and_sends_again(
    ordered: bool,
) -> None:
    """The cached route says 2 queues per broker (fetched before the topic was created with 1):
    a send to queue 1 is refused with INVALID_QUEUE_ID, which is the route's fault, not the
    message's. The route is fetched again and the send goes to a queue that exists."""
    brokers = FakeBrokers(write_queues=1)
    async with Producer("127.0.0.1:9", latency_fault_tolerance=False) as producer:
        wire_up(producer, brokers)
        fetched: list[str] = []

        async def fetch(topic: str) -> TopicRoute:
            fetched.append(topic)
            route = TopicRoute.build(topic, [("broker-a", 1, 6), ("broker-b", 1, 6)], ADDRESSES)
            producer._routes._routes[topic] = route
            return route

        producer._routes.fetch = fetch  # type: ignore[method-assign]
        for i in range(4):
            msg = Message("T", f"m{i}".encode())
            result = await (
                producer.send_ordered(msg, sharding_key=f"k{i}") if ordered else producer.send(msg)
            )
            assert result.queue_id == 0
        assert fetched  # the stale route was replaced at the first refusal
        assert {q for queues in brokers.queues_seen.values() for q in queues} == {0}


async def test_an_ordered_send_keeps_its_queue_through_retries() -> None:
    calls = 0

    def fail(broker: str, body: bytes) -> ApogeeError | None:
        nonlocal calls
        calls += 1
        return unavailable(broker) if calls == 1 else None

    brokers = FakeBrokers(fail=fail)
    async with Producer("127.0.0.1:9", latency_fault_tolerance=False) as producer:
        wire_up(producer, brokers)
        result = await producer.send_ordered(Message("T", b"o"), "key-1")
        first, second = (b for b, _ in brokers.seen)
        assert first == second == result.broker_name


async def test_a_oneway_send_is_tried_once_and_its_failure_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    brokers = FakeBrokers(down={"broker-a", "broker-b"})
    async with Producer("127.0.0.1:9") as producer:
        wire_up(producer, brokers)
        with caplog.at_level(logging.WARNING):
            await producer.send_oneway(Message("T", b"lost"))
            await asyncio.wait_for(producer._all_done.wait(), 5)
        assert len(brokers.seen) == 1
        assert producer.stats().retries == 0
    assert "oneway send of topic T failed" in caplog.text


async def test_send_nowait_settles_its_future_and_callback_from_the_answer() -> None:
    brokers = FakeBrokers()
    seen: list[object] = []
    async with Producer("127.0.0.1:9") as producer:
        wire_up(producer, brokers)
        futs = [
            producer.send_nowait(Message("T", f"n{i}".encode()), lambda r, e: seen.append(r))
            for i in range(10)
        ]
        results = await asyncio.wait_for(asyncio.gather(*futs), 5)
    assert len(brokers.seen) < 10  # gathered into fewer requests
    assert sorted(seen, key=id) == sorted(results, key=id)  # the same objects
    assert len({r.message_id for r in results}) == 10
