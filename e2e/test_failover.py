"""Members die: a nameserver (nothing changes), a broker under load (sends move to the other
broker within seconds, nothing acknowledged is lost), a silent broker (the nameservers drop it
from routes once it expires)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from apogee.client import AdminClient, Message, Producer, SendResult
from apogee.common.errors import ApogeeError
from e2e.harness import (
    ClusterFactory,
    eventually,
    live_brokers,
    route_brokers,
    wait_for_route,
    wait_registered,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BROKERS = {"broker-a", "broker-b"}
#: Sends must have moved to the surviving broker this long after a broker is killed.
FAILOVER_S = 5.0


@dataclass
class Outcome:
    started: float
    ended: float
    result: SendResult | None = None
    error: ApogeeError | None = None


@dataclass
class Traffic:
    """Sends made by a few workers in a loop until stopped, each outcome recorded."""

    producer: Producer
    topic: str
    workers: int = 4
    outcomes: list[Outcome] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        await asyncio.gather(*(self._worker(w) for w in range(self.workers)))

    async def _worker(self, w: int) -> None:
        n = 0
        while not self.stop.is_set():
            msg = Message(self.topic, f"w{w}-{n}".encode())
            n += 1
            started = time.monotonic()
            try:
                result = await self.producer.send(msg)
            except ApogeeError as err:  # reported by the SDK: allowed only around a failure
                self.outcomes.append(Outcome(started, time.monotonic(), error=err))
            else:
                self.outcomes.append(Outcome(started, time.monotonic(), result=result))

    def ok(self) -> list[SendResult]:
        return [o.result for o in self.outcomes if o.result is not None]

    async def until(self, count: int, timeout: float) -> None:
        """Wait until ``count`` more sends succeeded."""
        target = len(self.ok()) + count

        async def enough() -> bool:
            return len(self.ok()) >= target

        await eventually(enough, timeout, f"{count} more successful sends")


async def test_killing_one_nameserver_changes_nothing(start_cluster: ClusterFactory) -> None:
    cluster = await asyncio.to_thread(start_cluster, "nameserver-kill")
    topic = "E2ENameserverKill"
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=4)
    await wait_for_route(cluster.nameservers, topic, BROKERS)

    # routes are refreshed twice a second, so refreshes meet the dead nameserver too
    async with Producer(cluster.namesrv, route_refresh_interval=0.5) as producer:
        traffic = Traffic(producer, topic)
        sending = asyncio.create_task(traffic.run())
        await traffic.until(200, 10)
        # the first nameserver of the list: the one every client asks first
        dead = cluster.nameservers[0]
        cluster.kill(dead.name)
        await traffic.until(500, 10)
        await asyncio.sleep(1.5)  # keep sending through several route refreshes
        traffic.stop.set()
        await asyncio.wait_for(sending, 10)
    failed = [o.error for o in traffic.outcomes if o.error is not None]
    assert not failed, f"{len(failed)} sends failed, e.g. {failed[0]}"
    assert {r.broker_name for r in traffic.ok()} == BROKERS

    # a new client, with the dead nameserver first in its list, still gets routes and answers
    async with AdminClient(cluster.namesrv) as admin:
        assert {b.broker_name for b in await admin.cluster_info()} == BROKERS
        fresh = "E2EAfterNameserverKill"  # a topic the dead nameserver never knew
        await admin.create_or_update_topic(fresh, queues=4)
        await wait_for_route(cluster.nameservers[1:], fresh, BROKERS)
    async with Producer(cluster.namesrv) as producer:
        results = await asyncio.gather(
            *(producer.send(Message(t, b"after")) for t in (topic, fresh) for _ in range(20))
        )
    assert {r.broker_name for r in results} == BROKERS


async def test_kill_9_of_a_broker_moves_sends_to_the_other_and_loses_nothing_acknowledged(
    start_cluster: ClusterFactory,
) -> None:
    cluster = await asyncio.to_thread(start_cluster, "broker-kill")
    topic = "E2EBrokerKill"
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=4)
    await wait_for_route(cluster.nameservers, topic, BROKERS)

    async with Producer(cluster.namesrv, group="e2e-failover") as producer:
        traffic = Traffic(producer, topic)
        sending = asyncio.create_task(traffic.run())
        await traffic.until(300, 10)

        async def both_brokers() -> bool:
            return {r.broker_name for r in traffic.ok()} == BROKERS

        await eventually(both_brokers, 10, "both brokers acknowledging sends")
        killed_at = cluster.kill("broker-a")
        await asyncio.sleep(FAILOVER_S + 2)  # keep sending past the failover window
        await traffic.until(100, 10)
        traffic.stop.set()
        await asyncio.wait_for(sending, 10)
        retries = producer.stats().retries

    after = [o for o in traffic.outcomes if o.started > killed_at]
    first_on_b = min(o.ended for o in after if o.result and o.result.broker_name == "broker-b")
    failover = first_on_b - killed_at
    failures = [o for o in traffic.outcomes if o.error is not None]
    late = [o for o in after if o.started > killed_at + FAILOVER_S]
    slowest = max(o.ended - o.started for o in traffic.outcomes if o.ended > killed_at)
    print(
        f"failover: first send acknowledged by broker-b {failover:.3f}s after the kill, "
        f"slowest send meeting the kill {slowest:.3f}s; {len(failures)} sends failed, "
        f"{retries} retried; {len(late)} sends after the window"
    )
    assert failover < FAILOVER_S
    assert slowest < FAILOVER_S
    for o in failures:  # only sends that met the kill may fail, and only for a while
        assert killed_at < o.ended < killed_at + FAILOVER_S, f"a send failed: {o.error}"
    assert late
    assert all(o.result and o.result.broker_name == "broker-b" for o in late)
    assert not [o for o in after if o.result and o.result.broker_name == "broker-a"]

    # everything broker-a acknowledged before the kill is there once it is back
    acked_a = {r.message_id: r for r in traffic.ok() if r.broker_name == "broker-a"}
    await asyncio.to_thread(cluster.restart, "broker-a")
    await wait_registered(cluster.nameservers, "broker-a")
    async with AdminClient(cluster.namesrv) as admin:
        sem = asyncio.Semaphore(64)

        async def check(r: SendResult) -> None:
            async with sem:
                m = await admin.get_message(r.message_id)
            assert (m.broker_name, m.topic, m.queue_id, m.queue_offset) == (
                "broker-a",
                topic,
                r.queue_id,
                r.queue_offset,
            )

        await asyncio.gather(*(check(r) for r in acked_a.values()))

        # the broker says what its recovery did, and that it followed a crash
        reports = {r.broker_name: r for r in await admin.last_recoveries()}
        crashed = reports["broker-a"]
        assert not crashed.clean
        assert crashed.records_checked >= 1
        assert crashed.summary.startswith("recovery after a crash: checked ")
        assert reports["broker-b"].clean

    # and in the store itself, after a clean stop: every acknowledged message, on both brokers
    await asyncio.to_thread(cluster.stop)
    for broker in sorted(BROKERS):
        stored = {
            m.unique_id: (m.queue_id, m.queue_offset)
            for m in await asyncio.to_thread(cluster.read_topic, broker, topic)
        }
        for r in traffic.ok():
            if r.broker_name == broker:
                assert stored.get(r.message_id) == (r.queue_id, r.queue_offset), r


async def test_an_expired_broker_leaves_the_routes(start_cluster: ClusterFactory) -> None:
    expiry, scan, heartbeat = 3.0, 0.5, 1.0
    cluster = await asyncio.to_thread(
        start_cluster,
        "expiry",
        nameserver_env={
            "APOGEE_NAMESERVER_BROKER_EXPIRY_S": str(expiry),
            "APOGEE_NAMESERVER_SCAN_INTERVAL_S": str(scan),
        },
        broker_env={"APOGEE_BROKER_HEARTBEAT_INTERVAL_S": str(heartbeat)},
    )
    topic = "E2EExpiry"
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=4)
    await wait_for_route(cluster.nameservers, topic, BROKERS)

    killed_at = cluster.kill("broker-b")
    # until it expires, a silent broker is still routed to (its last heartbeat is recent)
    for ns in cluster.nameservers:
        assert await route_brokers(ns.address, topic) == BROKERS
    margin = 2.0
    for ns in cluster.nameservers:

        async def gone(address: str = ns.address) -> bool:
            return await route_brokers(address, topic) == {"broker-a"} and await live_brokers(
                address
            ) == {"broker-a"}

        left = killed_at + expiry + scan + margin - time.monotonic()
        await eventually(gone, left, f"{ns.name} drops broker-b from routes and cluster info")
    dropped_after = time.monotonic() - killed_at
    print(f"broker-b left the routes of both nameservers {dropped_after:.2f}s after the kill")
    assert dropped_after > expiry - heartbeat - 0.5  # not before it expired

    async with Producer(cluster.namesrv) as producer:
        results = await asyncio.gather(*(producer.send(Message(topic, b"x")) for _ in range(50)))
    assert {r.broker_name for r in results} == {"broker-a"}
    async with AdminClient(cluster.namesrv) as admin:
        assert [b.broker_name for b in await admin.cluster_info()] == ["broker-a"]
        assert topic in await admin.list_topics()
