"""The producer against real nameservers and brokers: every send mode stores each message
exactly once, where the result says; concurrent sends are batched; failures move to the other
broker; routes follow topic changes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.client import (
    AdminClient,
    Message,
    Producer,
    SendHook,
    SendResult,
    SendStatus,
    SyncProducer,
)
from apogee.client.producer.delivery import Delivery
from apogee.common.errors import UnavailableError, UnknownTopicError
from apogee.testkit.cluster import InProcessCluster, eventually

pytestmark = pytest.mark.integration


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    """Two nameservers and two brokers, in this process (see apogee.testkit.cluster)."""
    async with InProcessCluster(tmp_path) as c:
        yield c


TOPIC = "Orders"


async def stored_once(admin: AdminClient, result: SendResult, body: bytes, key: str) -> None:
    """The message of ``result`` is on the broker the result names, once, with ``body``."""
    found = await admin.get_message(result.message_id)
    assert found.body == body
    assert (found.topic, found.queue_id, found.queue_offset, found.broker_name) == (
        result.topic,
        result.queue_id,
        result.queue_offset,
        result.broker_name,
    )
    by_key = await admin.query_messages(result.topic, key)
    assert [m.unique_id for m in by_key] == [result.message_id]


async def test_await_send_stores_the_message_once(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    async with (
        Producer(cluster.namesrv, group="g") as producer,
        AdminClient(cluster.namesrv) as admin,
    ):
        result = await producer.send(
            Message(TOPIC, b"hello", tags="created", keys=["k-await"], properties={"a": "1"})
        )
        assert result.status is SendStatus.OK
        assert result.topic == TOPIC
        assert result.broker_name in cluster.brokers
        assert result.unique_id == result.message_id
        assert len(result.message_id) == 32
        await stored_once(admin, result, b"hello", "k-await")
        found = await admin.get_message(result.message_id)
        assert (found.tags, found.keys, found.properties.get("a")) == ("created", ("k-await",), "1")


async def test_send_nowait_with_callback_and_future(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    outcomes: list[tuple[SendResult | None, BaseException | None]] = []
    async with (
        Producer(cluster.namesrv, group="g") as producer,
        AdminClient(cluster.namesrv) as admin,
    ):
        futs = [
            producer.send_nowait(
                Message(TOPIC, f"m{i}".encode(), keys=[f"k-nowait-{i}"]),
                callback=lambda r, e: outcomes.append((r, e)),
            )
            for i in range(20)
        ]
        results = await asyncio.wait_for(asyncio.gather(*futs), 5.0)
        assert len(outcomes) == 20
        assert all(e is None for _, e in outcomes)
        assert {r.message_id for r, _ in outcomes if r} == {r.message_id for r in results}
        for i, r in enumerate(results):
            await stored_once(admin, r, f"m{i}".encode(), f"k-nowait-{i}")


async def test_oneway_messages_are_stored_and_close_flushes_them(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    async with Producer(cluster.namesrv, group="g") as producer:
        for i in range(200):
            await producer.send_oneway(Message(TOPIC, f"o{i}".encode(), keys=[f"k-oneway-{i}"]))
    # close() returned: every queued message has left and was stored
    async with AdminClient(cluster.namesrv) as admin:
        status = await admin.describe_topic(TOPIC)
        assert status.messages == 200
        for i in (0, 99, 199):
            [found] = await admin.query_messages(TOPIC, f"k-oneway-{i}")
            assert found.body == f"o{i}".encode()


async def test_batch_goes_to_one_queue_in_one_request(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    async with (
        Producer(cluster.namesrv, group="g") as producer,
        AdminClient(cluster.namesrv) as admin,
    ):
        msgs = [Message(TOPIC, f"b{i}".encode(), keys=[f"k-batch-{i}"]) for i in range(50)]
        results = await producer.send_batch(msgs)
        assert producer.stats().requests == 1
        assert len({(r.broker_name, r.queue_id) for r in results}) == 1
        offsets = [r.queue_offset for r in results]
        assert offsets == list(range(offsets[0], offsets[0] + 50))
        for i, r in enumerate(results):
            await stored_once(admin, r, f"b{i}".encode(), f"k-batch-{i}")


async def test_ordered_sends_of_a_key_share_one_queue_in_order(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    async with (
        Producer(cluster.namesrv, group="g") as producer,
        AdminClient(cluster.namesrv) as admin,
    ):
        placed: dict[str, list[SendResult]] = {}
        for step in range(5):
            for order in ("order-1", "order-2", "order-3"):
                r = await producer.send_ordered(
                    Message(TOPIC, f"{order}:{step}".encode(), keys=[f"{order}-{step}"]), order
                )
                placed.setdefault(order, []).append(r)
        for order, results in placed.items():
            assert len({(r.broker_name, r.queue_id) for r in results}) == 1
            offsets = [r.queue_offset for r in results]
            assert offsets == sorted(offsets)
            for step, r in enumerate(results):
                await stored_once(admin, r, f"{order}:{step}".encode(), f"{order}-{step}")


async def test_sync_producer_send_modes(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    callbacks: list[tuple[SendResult | None, BaseException | None]] = []
    called = threading.Event()

    def use_it() -> tuple[list[SendResult], int]:
        with SyncProducer(cluster.namesrv, group="g") as producer:
            results = [producer.send(Message(TOPIC, b"sync", keys=["k-sync"]))]

            def callback(r: SendResult | None, e: BaseException | None) -> None:
                callbacks.append((r, e))
                called.set()

            fut = producer.send_async(Message(TOPIC, b"async", keys=["k-async"]), callback)
            results.append(fut.result(5.0))
            assert called.wait(5.0)
            results.append(producer.send_ordered(Message(TOPIC, b"ordered", keys=["k-ord"]), "o1"))
            results += producer.send_batch(
                [Message(TOPIC, b"batch0", keys=["k-b0"]), Message(TOPIC, b"batch1", keys=["k-b1"])]
            )
            producer.send_oneway(Message(TOPIC, b"oneway", keys=["k-oneway"]))
            requests = producer.stats().requests
        return results, requests

    results, requests = await asyncio.to_thread(use_it)
    assert callbacks == [(results[1], None)]
    assert requests >= 4
    async with AdminClient(cluster.namesrv) as admin:
        for r, body, key in zip(
            results,
            [b"sync", b"async", b"ordered", b"batch0", b"batch1"],
            ["k-sync", "k-async", "k-ord", "k-b0", "k-b1"],
            strict=True,
        ):
            await stored_once(admin, r, body, key)
        [oneway] = await admin.query_messages(TOPIC, "k-oneway")  # close() flushed it
        assert oneway.body == b"oneway"


async def test_a_sync_idempotent_send_again_under_its_id_is_stored_once(
    cluster: InProcessCluster,
) -> None:
    await cluster.create_topic(TOPIC)

    def send_twice() -> tuple[SendResult, SendResult]:
        with SyncProducer(cluster.namesrv, group="g", idempotent=True) as producer:
            first = producer.send(Message(TOPIC, b"once", keys=["k-idem"]))
            again = producer.send(
                Message(TOPIC, b"once", keys=["k-idem"]), message_id=first.message_id
            )
        return first, again

    first, again = await asyncio.to_thread(send_twice)
    assert (again.message_id, again.queue_id) == (first.message_id, first.queue_id)
    async with AdminClient(cluster.namesrv) as admin:
        await stored_once(admin, first, b"once", "k-idem")


async def test_concurrent_sends_are_batched(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    async with Producer(cluster.namesrv, group="g") as producer:
        await producer.send(Message(TOPIC, b"warm-up"))  # the route is cached from here on
        before = producer.stats()
        results = await asyncio.wait_for(
            asyncio.gather(*(producer.send(Message(TOPIC, f"c{i}".encode())) for i in range(2000))),
            10.0,
        )
        after = producer.stats()
    assert len({r.message_id for r in results}) == 2000
    assert after.messages - before.messages == 2000
    requests = after.requests - before.requests
    print(f"2000 concurrent sends: {requests} requests, largest {after.largest_request}")
    assert requests <= 40, f"{requests} requests for 2000 concurrent sends"
    assert after.largest_request > 100
    async with AdminClient(cluster.namesrv) as admin:
        assert (await admin.describe_topic(TOPIC)).messages == 2001


async def test_settled_sends_are_freed_as_they_settle_not_at_their_deadline(
    cluster: InProcessCluster,
) -> None:
    """What a send holds (its delivery, future and bytes) is let go when it settles, by
    reference counting alone: memory does not grow with ``send_timeout`` times the send rate,
    and the garbage collector has nothing to walk through."""
    await cluster.create_topic(TOPIC)
    async with Producer(cluster.namesrv, group="g", send_timeout=60.0) as producer:
        await producer.send(Message(TOPIC, b"warm-up"))
        gc.collect()
        gc.disable()
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(producer.send(Message(TOPIC, b"x" * 1024)) for _ in range(500))),
                10.0,
            )
            futures = [producer.send_nowait(Message(TOPIC, b"y" * 1024)) for _ in range(500)]
            await asyncio.wait_for(asyncio.gather(*futures), 10.0)
            del futures
            alive = sum(1 for o in gc.get_objects() if type(o) is Delivery)
        finally:
            gc.enable()
    assert len(results) == 500
    assert alive == 0, f"{alive} settled deliveries still held"


async def test_sends_from_many_threads_are_batched(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)

    def from_threads() -> tuple[int, int]:
        with SyncProducer(cluster.namesrv, group="g") as producer:
            producer.send(Message(TOPIC, b"warm-up"))
            start = producer.stats().requests

            def worker(n: int) -> list[concurrent.futures.Future[SendResult]]:
                return [
                    producer.send_async(Message(TOPIC, f"{n}-{i}".encode())) for i in range(250)
                ]

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                futs = [f for batch in pool.map(worker, range(4)) for f in batch]
            done, _ = concurrent.futures.wait(futs, timeout=10.0)
            assert len(done) == 1000
            assert all(f.exception() is None for f in done)
            return producer.stats().requests - start, len({f.result().message_id for f in futs})

    requests, unique = await asyncio.to_thread(from_threads)
    print(f"1000 sends from 4 threads: {requests} requests")
    assert unique == 1000
    assert requests <= 100, f"{requests} requests for 1000 sends from 4 threads"


async def test_compressed_body_round_trip(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    body = b"a fairly repetitive body " * 1000  # 25 KB, well above compress_over
    async with (
        Producer(cluster.namesrv, group="g") as producer,
        AdminClient(cluster.namesrv) as admin,
    ):
        result = await producer.send(Message(TOPIC, body, keys=["k-zip"]))
        found = await admin.get_message(result.message_id)
        assert found.compressed
        assert found.body == body
        small = await producer.send(Message(TOPIC, b"tiny", keys=["k-small"]))
        assert not (await admin.get_message(small.message_id)).compressed


async def test_hooks_see_every_message_once(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    before: list[bytes] = []
    after: list[tuple[bytes, object]] = []
    hook = SendHook(
        before=lambda m: before.append(m.body),
        after=lambda m, outcome: after.append((m.body, outcome)),
    )
    async with Producer(cluster.namesrv, group="g", hooks=[hook]) as producer:
        r = await producer.send(Message(TOPIC, b"one"))
        with pytest.raises(UnknownTopicError):
            await producer.send(Message("NoSuchTopic", b"two"))
    assert before == [b"one", b"two"]
    assert after[0] == (b"one", r)
    assert after[1][0] == b"two"
    assert isinstance(after[1][1], UnknownTopicError)


async def test_retries_move_to_the_other_broker(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    # without fault tolerance every send keeps trying broker-b in turn: retries must save it
    async with Producer(
        cluster.namesrv, group="g", latency_fault_tolerance=False, route_refresh_interval=60
    ) as producer:
        warm = [await producer.send(Message(TOPIC, f"w{i}".encode())) for i in range(8)]
        assert {r.broker_name for r in warm} == {"broker-a", "broker-b"}
        await cluster.stop_broker("broker-b")
        results = await asyncio.gather(
            *(producer.send(Message(TOPIC, f"r{i}".encode())) for i in range(12))
        )
        assert {r.broker_name for r in results} == {"broker-a"}
        stats = producer.stats()
        assert stats.failed_requests >= 1  # some went to broker-b first ...
        assert stats.retries >= 1  # ... and were retried on broker-a


async def test_fault_tolerance_avoids_a_dead_broker(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    async with Producer(cluster.namesrv, group="g", route_refresh_interval=60) as producer:
        await producer.send(Message(TOPIC, b"warm"))
        await cluster.stop_broker("broker-b")
        results = await asyncio.gather(
            *(producer.send(Message(TOPIC, f"f{i}".encode())) for i in range(100))
        )
        assert {r.broker_name for r in results} == {"broker-a"}
        # broker-b is isolated now: later sends go straight to broker-a, first try
        before = producer.stats()
        for i in range(10):
            assert (await producer.send(Message(TOPIC, f"g{i}".encode()))).broker_name == "broker-a"
        after = producer.stats()
        assert (after.requests - before.requests, after.retries - before.retries) == (10, 0)


async def test_ordered_sends_do_not_fail_over_unless_asked(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    async with Producer(
        cluster.namesrv, group="g", send_timeout=2.0, route_refresh_interval=60
    ) as producer:
        keys = [f"key-{i}" for i in range(40)]
        first = {k: await producer.send_ordered(Message(TOPIC, b"x"), k) for k in keys}
        on_b = [k for k in keys if first[k].broker_name == "broker-b"]
        assert on_b
        await cluster.stop_broker("broker-b")
        with pytest.raises(UnavailableError):
            await producer.send_ordered(Message(TOPIC, b"y"), on_b[0])
        moved = await producer.send_ordered(Message(TOPIC, b"z"), on_b[0], failover=True)
        assert moved.broker_name == "broker-a"


async def test_route_follows_a_topic_created_after_the_first_send(
    cluster: InProcessCluster,
) -> None:
    async with (
        Producer(cluster.namesrv, group="g", route_refresh_interval=0.2) as producer,
        AdminClient(cluster.namesrv) as admin,
    ):
        with pytest.raises(UnknownTopicError) as info:
            await producer.send(Message("Later", b"x"))
        assert "'Later'" in str(info.value)
        await admin.create_or_update_topic("Later", queues=2, brokers=["broker-a"])
        await cluster.wait_route("Later", {"broker-a"})
        first = await producer.send(Message("Later", b"x"))
        assert first.broker_name == "broker-a"
        await admin.create_or_update_topic("Later", queues=2, brokers=["broker-b"])
        await cluster.wait_route("Later", {"broker-a", "broker-b"})

        async def reaches_b() -> bool:
            r = await producer.send(Message("Later", b"y"))
            return r.broker_name == "broker-b"

        await eventually(reaches_b, 5.0, "a send to broker-b after the route refresh")


async def test_a_dead_first_nameserver_is_skipped(cluster: InProcessCluster) -> None:
    await cluster.create_topic(TOPIC)
    namesrv = "127.0.0.1:1;" + cluster.namesrv
    async with Producer(namesrv, group="g") as producer:
        r = await producer.send(Message(TOPIC, b"x"))
        assert r.topic == TOPIC


async def test_auto_created_topic(tmp_path: Path) -> None:
    async with (
        InProcessCluster(tmp_path, brokers=["auto-a"], auto_create_topics=True) as c,
        Producer(c.namesrv, group="g") as producer,
        AdminClient(c.namesrv) as admin,
    ):
        r = await producer.send(Message("Fresh", b"first", keys=["k-fresh"]))
        assert r.broker_name == "auto-a"
        assert [b.topic.name for b in (await admin.describe_topic("Fresh")).brokers] == ["Fresh"]
        [found] = await admin.query_messages("Fresh", "k-fresh")
        assert found.body == b"first"


async def test_a_route_cached_before_the_topic_was_created_is_refreshed_not_failed(
    tmp_path: Path,
) -> None:
    """Where brokers create topics, the nameserver answers for a topic no broker has yet with
    the template's route (8 queues). A producer that cached it, then sent once the topic was
    created with 4 queues, had a send to queues 4 to 7 fail with INVALID_QUEUE_ID: the route
    was stale, not the message bad. Every send now succeeds."""
    async with (
        InProcessCluster(tmp_path, brokers=["auto-a"], auto_create_topics=True) as c,
        Producer(c.namesrv, group="g", latency_fault_tolerance=False) as producer,
        AdminClient(c.namesrv) as admin,
    ):
        template = await producer._routes.get("Young")  # cached: the template's queues
        assert len(template.queues) > 4
        await admin.create_or_update_topic("Young", queues=4)

        async def created() -> bool:
            return [len(b.queues) for b in (await admin.describe_topic("Young")).brokers] == [4]

        await eventually(created, 5.0, "the topic with its 4 queues")
        results = [await producer.send(Message("Young", f"m{i}".encode())) for i in range(12)]
        assert {r.queue_id for r in results} <= {0, 1, 2, 3}
        assert producer.stats().retries >= 1  # at least one went to a queue that is not there
