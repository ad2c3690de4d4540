"""Messages arrive, once each, where the producers were told they went; ordered sends keep
their order per sharding key.

Exactly once is checked on the stores themselves: after a graceful stop, each broker's store
is opened directly and every queue of the topic read from offset 0.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from dataclasses import dataclass

import pytest

from apogee.client import AdminClient, Message, Producer, SendResult, SyncProducer
from apogee.store import StoredMessage
from e2e.harness import Cluster, ClusterFactory, wait_for_route

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BROKERS = {"broker-a", "broker-b"}
PER_PRODUCER = 2_500
BATCH = 50
PAD = b"." * 100


@dataclass(frozen=True)
class Sent:
    """What the producers were told: results by message id, and the keys of oneway sends."""

    results: dict[str, SendResult]
    bodies: dict[str, bytes]
    oneway_keys: set[str]


def body(mode: str, i: int) -> bytes:
    return f"{mode}-{i}|".encode() + PAD


async def send_with_four_producers(namesrv: str, topic: str) -> Sent:
    """2,500 messages from each of four producers at once: sync (SyncProducer.send from eight
    threads), async (send_nowait), batches of 50 (send_batch) and oneway (send_oneway)."""

    def sync_sends() -> list[tuple[bytes, SendResult]]:
        bodies = [body("sync", i) for i in range(PER_PRODUCER)]
        with (
            SyncProducer(namesrv, group="e2e-sync") as producer,
            concurrent.futures.ThreadPoolExecutor(8) as pool,
        ):
            results = pool.map(producer.send, [Message(topic, b) for b in bodies])
            return list(zip(bodies, results, strict=True))

    async def async_sends() -> list[tuple[bytes, SendResult]]:
        bodies = [body("async", i) for i in range(PER_PRODUCER)]
        async with Producer(namesrv, group="e2e-async") as producer:
            futures = [producer.send_nowait(Message(topic, b)) for b in bodies]
            return list(zip(bodies, await asyncio.gather(*futures), strict=True))

    async def batch_sends() -> list[tuple[bytes, SendResult]]:
        async with Producer(namesrv, group="e2e-batch") as producer:

            async def batches(first: int) -> list[tuple[bytes, SendResult]]:
                out: list[tuple[bytes, SendResult]] = []
                for start in range(first, PER_PRODUCER, 4 * BATCH):  # four senders, interleaved
                    bodies = [body("batch", i) for i in range(start, start + BATCH)]
                    results = await producer.send_batch([Message(topic, b) for b in bodies])
                    # one batch, one queue
                    assert len({(r.broker_name, r.queue_id) for r in results}) == 1
                    out += zip(bodies, results, strict=True)
                return out

            parts = await asyncio.gather(*(batches(k * BATCH) for k in range(4)))
            return [r for part in parts for r in part]

    async def oneway_sends() -> set[str]:
        keys = set()
        async with Producer(namesrv, group="e2e-oneway") as producer:
            for i in range(PER_PRODUCER):
                key = f"oneway-{i}"
                await producer.send_oneway(Message(topic, body("oneway", i), keys=key))
                keys.add(key)
        # leaving the block waited until every queued message had left and was answered
        return keys

    sync_results, async_results, batch_results, oneway_keys = await asyncio.gather(
        asyncio.to_thread(sync_sends), async_sends(), batch_sends(), oneway_sends()
    )
    results: dict[str, SendResult] = {}
    bodies: dict[str, bytes] = {}
    for got in (sync_results, async_results, batch_results):
        assert len(got) == PER_PRODUCER
        for b, r in got:
            assert r.message_id not in results, f"id {r.message_id} returned twice"
            assert r.topic == topic
            assert r.broker_name in BROKERS
            results[r.message_id] = r
            bodies[r.message_id] = b
    return Sent(results, bodies, oneway_keys)


@pytest.mark.parametrize("flush_mode", ["async", "sync"])
async def test_ten_thousand_messages_from_four_producers_are_stored_exactly_once(
    start_cluster: ClusterFactory, flush_mode: str
) -> None:
    cluster = await asyncio.to_thread(start_cluster, "exactly-once", flush_mode=flush_mode)
    topic = "E2EExactlyOnce"
    async with AdminClient(cluster.namesrv) as admin:
        updates = await admin.create_or_update_topic(topic, queues=8)
    assert {u.broker_name for u in updates} == BROKERS
    await wait_for_route(cluster.nameservers, topic, BROKERS)

    sent = await send_with_four_producers(cluster.namesrv, topic)

    await asyncio.to_thread(cluster.stop)
    stored: dict[str, list[StoredMessage]] = {
        b: await asyncio.to_thread(cluster.read_topic, b, topic) for b in sorted(BROKERS)
    }
    ids: collections.Counter[str] = collections.Counter()
    oneway: collections.Counter[str] = collections.Counter()
    for broker, messages in stored.items():
        assert messages, f"{broker} got none of the messages"
        for m in messages:
            ids[m.unique_id] += 1
            if m.keys and m.keys[0].startswith("oneway-"):
                oneway[m.keys[0]] += 1
                assert m.body.startswith(f"{m.keys[0]}|".encode())
                continue
            # stored where the producer was told, with the body it sent
            r = sent.results[m.unique_id]
            assert (broker, m.queue_id, m.queue_offset) == (
                r.broker_name,
                r.queue_id,
                r.queue_offset,
            )
            assert m.body == sent.bodies[m.unique_id]
    twice = [uid for uid, n in ids.items() if n > 1]
    assert not twice, f"{len(twice)} ids stored more than once, e.g. {twice[:3]}"
    assert set(oneway) == sent.oneway_keys
    assert max(oneway.values()) == 1
    assert {uid for uid in ids if uid in sent.results} == set(sent.results)
    assert sum(ids.values()) == 4 * PER_PRODUCER


async def test_ordered_sends_keep_each_keys_order_in_one_queue(cluster: Cluster) -> None:
    topic = "E2EOrdered"
    keys = [f"order-{k}" for k in range(100)]
    per_key = 12
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=8)
        await wait_for_route(cluster.nameservers, topic, BROKERS)

        async with Producer(cluster.namesrv, group="e2e-ordered") as producer:

            async def one_key(key: str) -> list[SendResult]:
                out = []
                for seq in range(per_key):  # each send waits for the one before: its order
                    msg = Message(topic, f"{key}:{seq}".encode(), keys=key)
                    out.append(await producer.send_ordered(msg, key))
                return out

            per_key_results = await asyncio.gather(*(one_key(k) for k in keys))

        for key, results in zip(keys, per_key_results, strict=True):
            assert len({(r.broker_name, r.queue_id) for r in results}) == 1, key
        used = {(rs[0].broker_name, rs[0].queue_id) for rs in per_key_results}
        assert {b for b, _ in used} == BROKERS
        assert len(used) > 8

        # read back from the brokers: each key's messages in one queue, in sequence order
        async def stored(key: str) -> list[tuple[str, int, int, int]]:
            found = await admin.query_messages(topic, key, max_messages=100)
            return [
                (m.broker_name, m.queue_id, m.queue_offset, int(m.body.split(b":")[1]))
                for m in found
            ]

        for key, found in zip(keys, await asyncio.gather(*(stored(k) for k in keys)), strict=True):
            assert len(found) == per_key, key
            assert len({(b, q) for b, q, _, _ in found}) == 1, f"{key} is in several queues"
            by_offset = [seq for _, _, _, seq in sorted(found, key=lambda f: f[2])]
            assert by_offset == list(range(per_key)), f"{key} out of order: {by_offset}"
