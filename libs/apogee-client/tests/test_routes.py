"""Route lookups against real nameservers: in order, past unreachable ones and past ones that
do not know the topic; unknown only when no nameserver knows it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.client import AdminClient
from apogee.client._rpc import ChannelPool, NameServerClient
from apogee.client.producer.routes import RouteCache
from apogee.common.errors import UnavailableError, UnknownTopicError
from apogee.testkit.cluster import InProcessCluster, eventually

pytestmark = pytest.mark.integration

DEAD = "127.0.0.1:1"  # nothing listens on port 1


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    """Two nameservers; broker-a registers with both, broker-solo with the second only."""
    async with InProcessCluster(tmp_path, brokers=["broker-a"]) as c:
        await c.create_topic("Everywhere", queues=2)
        await c.start_broker("broker-solo", namesrv=f"127.0.0.1:{c.nameservers[1].port}")
        yield c


def ns(cluster: InProcessCluster, i: int) -> str:
    return f"127.0.0.1:{cluster.nameservers[i].port}"


async def lookup(addresses: list[str], topic: str) -> tuple[list[str], dict[str, str]]:
    pool = ChannelPool()
    try:
        cache = RouteCache(NameServerClient(addresses, pool, timeout=2.0))
        route = await cache.get(topic)
        return [f"{q.broker_name}/{q.queue_id}" for q in route.queues], route.addresses
    finally:
        await pool.close()


async def test_route_lists_each_brokers_writable_queues(cluster: InProcessCluster) -> None:
    queues, addresses = await lookup([ns(cluster, 0)], "Everywhere")
    assert queues == ["broker-a/0", "broker-a/1"]
    assert addresses == {"broker-a": cluster.brokers["broker-a"].address}


async def test_a_nameserver_that_does_not_know_the_topic_is_passed_over(
    cluster: InProcessCluster,
) -> None:
    async with AdminClient(ns(cluster, 1)) as admin:
        await admin.create_or_update_topic("SoloOnly", queues=3, brokers=["broker-solo"])

    async def routed() -> bool:
        try:
            await lookup([ns(cluster, 1)], "SoloOnly")
        except UnknownTopicError:
            return False
        return True

    await eventually(routed, 5.0, "the route of SoloOnly at the second nameserver")
    # the first nameserver answers NOT_FOUND (broker-solo never registered there)
    with pytest.raises(UnknownTopicError):
        await lookup([ns(cluster, 0)], "SoloOnly")
    queues, _ = await lookup([ns(cluster, 0), ns(cluster, 1)], "SoloOnly")
    assert queues == ["broker-solo/0", "broker-solo/1", "broker-solo/2"]


async def test_an_unreachable_nameserver_is_passed_over(cluster: InProcessCluster) -> None:
    queues, _ = await lookup([DEAD, ns(cluster, 0)], "Everywhere")
    assert queues == ["broker-a/0", "broker-a/1"]


async def test_unknown_when_no_nameserver_knows_the_topic(cluster: InProcessCluster) -> None:
    with pytest.raises(UnknownTopicError) as info:
        await lookup([ns(cluster, 0), ns(cluster, 1)], "Nowhere")
    assert str(info.value) == (
        "topic 'Nowhere' has no route: no live broker has it and none creates topics automatically"
    )
    with pytest.raises(UnknownTopicError) as partly:
        await lookup([DEAD, ns(cluster, 0)], "Nowhere")
    assert str(partly.value).endswith(f"(nameservers {DEAD} did not answer)")


async def test_unavailable_when_no_nameserver_answers() -> None:
    with pytest.raises(UnavailableError) as info:
        await lookup([DEAD, "127.0.0.1:2"], "Anything")
    assert str(info.value).startswith(
        "every nameserver (127.0.0.1:1;127.0.0.1:2) is unavailable: route of topic 'Anything'"
    )
    assert info.value.retriable
