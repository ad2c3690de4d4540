"""The producer's one send state machine, against a fake transport that reads the send records
as a broker does and answers as one: every mode (single, ordered, batch, oneway) goes through the
same attempts, retries skip the broker that just failed, a batch retries only what failed, and a
oneway send is tried once. A request that may have been stored before it failed ends a plain
send with an error that says so; an idempotent send tries it again where it went."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from apogee.client import Message, Producer
from apogee.client.producer.routes import TopicRoute
from apogee.codec import HEADER_SIZE, StoredMessage, decode
from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    InvalidArgumentError,
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
    ``down`` brokers fail whole requests; ``refuse`` brokers refuse the connection (nothing is
    sent); the first ``lost`` requests are stored but never answered (the broker died with
    them in flight)."""

    fail: Callable[[str, bytes], ApogeeError | None] = lambda broker, body: None
    down: set[str] = field(default_factory=set)
    refuse: set[str] = field(default_factory=set)
    lost: int = 0
    seen: list[tuple[str, list[bytes]]] = field(default_factory=list)
    #: every message of every request that reached a broker, as it arrived
    arrived: list[StoredMessage] = field(default_factory=list)
    next_offset: int = 0
    #: queues each broker has (0: any queue id is accepted)
    write_queues: int = 0
    #: queue ids of the messages each broker stored
    queues_seen: dict[str, list[int]] = field(default_factory=dict)

    async def send(
        self, address: str, request: bytes, timeout: float, what: str, streams: int = 1
    ) -> broker_pb2.SendMessagesResponse:
        broker = next(name for name, a in ADDRESSES.items() if a == address)
        if broker in self.refuse:
            raise UnavailableError(
                what=f"broker {broker}",
                detail="failed to connect to all addresses; last error: Connection refused",
            )
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
            self.arrived.append(m)
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
        if self.lost:
            self.lost -= 1
            raise UnavailableError(what=f"broker {broker}", detail="the stream broke")
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


async def test_a_request_that_may_have_been_stored_ends_a_plain_send_saying_so() -> None:
    brokers = FakeBrokers(lost=1)
    async with Producer("127.0.0.1:9", latency_fault_tolerance=False) as producer:
        wire_up(producer, brokers)
        with pytest.raises(UnavailableError) as caught:
            await producer.send(Message("T", b"maybe"))
        # not tried again: a second copy could be stored
        assert [m.body for m in brokers.arrived] == [b"maybe"]
        assert producer.stats().retries == 0
    err = caught.value
    uid = brokers.arrived[0].unique_id
    assert (err.outcome_unknown, err.message_id, err.message_ids) == (True, uid, (uid,))
    assert str(err).endswith(
        f"the stream broke; the message may have been stored (message id {uid}): look it up "
        "by id before sending again (a plain send again may store a second copy; idempotent "
        "sends, idempotent=True, are stored once)"
    )


async def test_a_send_refused_before_anything_was_sent_is_retried_and_stays_plain() -> None:
    brokers = FakeBrokers(refuse={"broker-a"})
    async with Producer("127.0.0.1:9", latency_fault_tolerance=False) as producer:
        wire_up(producer, brokers)
        results = [await producer.send(Message("T", f"r{i}".encode())) for i in range(4)]
        assert {r.broker_name for r in results} == {"broker-b"}  # moved on where refused
        brokers.refuse.add("broker-b")
        with pytest.raises(UnavailableError) as caught:
            await producer.send(Message("T", b"nowhere"))
    err = caught.value
    assert (err.outcome_unknown, err.message_id) == (False, None)
    assert "may have been stored" not in str(err)


async def test_an_idempotent_send_tries_again_on_the_same_queue_with_its_dedup_id() -> None:
    brokers = FakeBrokers(lost=1)
    async with Producer("127.0.0.1:9", latency_fault_tolerance=False, idempotent=True) as p:
        wire_up(p, brokers)
        result = await p.send(Message("T", b"once", properties={"a": "1"}))
        first, again = brokers.arrived
        assert (first.queue_id, again.queue_id) == (result.queue_id, result.queue_id)
        assert brokers.seen[0][0] == brokers.seen[1][0] == result.broker_name
        for m in (first, again):
            assert m.unique_id == result.message_id
            assert (m.properties["a"], m.properties["APOGEE_DEDUP_ID"]) == ("1", result.message_id)
        # the application's own retry goes under the same id to the same queue
        brokers.lost = 3  # every attempt of it: the producer gives up, saying so
        with pytest.raises(UnavailableError) as caught:
            await p.send(Message("T", b"once", properties={"a": "1"}), message_id="ID-7")
        assert {(m.unique_id, m.queue_id) for m in brokers.arrived[2:]} == {
            ("ID-7", brokers.arrived[2].queue_id)
        }
        assert caught.value.message_id == "ID-7"
        assert "send it again with idempotent sends on (message_id=err.message_id" in str(
            caught.value
        )
        # an application that chose its own dedup ids keeps them, and its queue follows them
        sent = [
            await p.send(Message("T", b"own", properties={"APOGEE_DEDUP_ID": "order-9"}))
            for _ in range(2)
        ]
        assert sent[0].queue_id == sent[1].queue_id
        assert brokers.arrived[-1].properties["APOGEE_DEDUP_ID"] == "order-9"
        assert sent[0].message_id != sent[1].message_id
        # and one that sends again under the id of an error (the sync producer's way) goes
        # where that id went
        by_property = await p.send(Message("T", b"once", properties={"APOGEE_DEDUP_ID": "ID-7"}))
        assert by_property.queue_id == brokers.arrived[2].queue_id


async def test_a_timeout_with_the_request_in_flight_leaves_the_outcome_unknown() -> None:
    arrived = asyncio.Event()

    async def never_answers(*_: object, **__: object) -> broker_pb2.SendMessagesResponse:
        arrived.set()
        await asyncio.sleep(10)
        raise AssertionError("not reached")

    async with Producer("127.0.0.1:9", send_timeout=0.2, close_timeout=0.1) as producer:
        wire_up(producer, FakeBrokers())
        producer._pool.send = never_answers  # type: ignore[method-assign]
        with pytest.raises(DeadlineExceededError) as caught:
            await producer.send(Message("T", b"slow"))
        assert arrived.is_set()
        assert caught.value.outcome_unknown
        assert "took longer than 0.2s; the message may have been stored" in str(caught.value)


async def test_a_message_id_is_refused_by_a_plain_producer_and_checked() -> None:
    async with Producer("127.0.0.1:9") as producer:
        with pytest.raises(InvalidArgumentError, match="message_id: is taken by idempotent"):
            await producer.send(Message("T", b"x"), message_id="ID-1")
    async with Producer("127.0.0.1:9", idempotent=True) as producer:
        with pytest.raises(InvalidArgumentError, match="message_id: 'a b' must not contain"):
            await producer.send(Message("T", b"x"), message_id="a b")
