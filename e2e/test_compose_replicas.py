"""docker-compose.yml with docker-compose.replicas.yml under ``podman-compose``: broker-a as a
replica group of three containers whose leadership is in the etcd container, beside broker-b,
a lone broker. One stack for the module (profile ``monitoring`` included), under a project name,
published ports and a /24 network of its own (:class:`e2e.containers.ComposeStack`), taken down
with its volumes at the end whatever happened. Checked as a user would, from this machine
through the published ports:

- ``AdminClient.describe_broker("broker-a")`` shows a leader and 3 replicas in sync, the
  console's API says the same, and both broker names register;
- Prometheus scrapes every replica and etcd;
- ``podman kill --signal KILL`` of the leading container while a producer sends 1,000 messages:
  another replica is described as leader within :data:`FAILOVER_DEADLINE_S`, every message is
  acknowledged in the end and a consumer reads back every one; the killed container, started
  again, rejoins the in-sync set;
- ``down -v`` leaves no container or volume of the project behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from apogee.client import AdminClient, Message, Producer, PullConsumer
from apogee.client.replicas import ReplicaGroupStatus
from apogee.common.errors import ApogeeError
from apogee.testkit.waiting import eventually
from e2e.containers import (
    ComposeStack,
    free_port,
    inspect,
    podman,
    run,
    wait_for,
    wait_healthy,
    wait_scraped,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

OVERRIDE = "docker-compose.replicas.yml"
GROUP = "broker-a"
#: the compose service of each replica of broker-a, by the name of its published port
REPLICAS = {"BROKER_A": "broker-a", "BROKER_A_1": "broker-a-1", "BROKER_A_2": "broker-a-2"}
SERVICES = ("nameserver", "etcd", *REPLICAS.values(), "broker-b", "schedule", "txn-checker")
TOPIC = "ComposeReplicated"
COUNT = 1000
#: acknowledged sends before the leader is killed
BEFORE_KILL = 200
#: seconds from the kill until another replica is described as leader (a 2 s lease, then the
#: election and the new leader's start)
FAILOVER_DEADLINE_S = 30.0
#: seconds for every send to be acknowledged, and for the consumer to read them back
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def stack(images: float) -> Iterator[ComposeStack]:
    run(
        ["bash", "scripts/images.sh", "etcd"],
        env={**os.environ, "ENGINE": "podman", "QUIET": "1"},
        timeout=600,
    )
    files = os.pathsep.join(("docker-compose.yml", OVERRIDE))
    s = ComposeStack(profiles=["monitoring"], extra_env={"COMPOSE_FILE": files})
    for name in (*REPLICAS, "CONSOLE"):
        s.ports.setdefault(name, free_port())
    try:
        s.up()
        for service in SERVICES:
            wait_healthy(s.container(service))
        yield s
    finally:
        s.down()


async def describe(s: ComposeStack) -> ReplicaGroupStatus | None:
    """broker-a's group as ``apogee broker describe broker-a`` shows it; None while no
    leader is registered or answers."""
    async with AdminClient(s.namesrv, timeout=5.0) as admin:
        try:
            return await admin.describe_broker(GROUP)
        except ApogeeError:
            return None


def service_at(s: ComposeStack, address: str) -> str:
    """The compose service of the replica advertising ``address`` (gateway:published port)."""
    host, _, port = address.rpartition(":")
    assert host == s.gateway, address
    [service] = [svc for name, svc in REPLICAS.items() if s.ports[name] == int(port)]
    return service


async def wait_group(
    s: ComposeStack, what: str, ok: Callable[[ReplicaGroupStatus], bool], timeout: float
) -> ReplicaGroupStatus:
    """Poll :func:`describe` until ``ok(group)`` holds; fail with the last description."""
    seen: list[ReplicaGroupStatus | None] = [None]

    async def check() -> bool:
        seen[0] = g = await describe(s)
        return g is not None and ok(g)

    await eventually(check, timeout, what, every=0.5, detail=lambda: repr(seen[0]))
    group = seen[0]
    assert group is not None
    return group


def all_in_sync(g: ReplicaGroupStatus) -> bool:
    return g.leader is not None and len(g.replicas) == 3 and g.in_sync_count == 3


async def test_broker_a_is_a_group_of_three_in_sync_beside_a_lone_broker_b(
    stack: ComposeStack,
) -> None:
    group = await wait_group(stack, "a leader and 3 replicas in sync", all_in_sync, 90)
    assert group.replicated
    assert (group.acks, group.min_insync_replicas) == ("all", 2)
    assert group.leader is not None
    assert group.leader_address == group.leader.address
    assert {service_at(stack, r.address) for r in group.replicas} == set(REPLICAS.values())
    async with AdminClient(stack.namesrv) as admin:
        registered = {b.broker_name: b.address for b in await admin.cluster_info()}
        lone = await admin.describe_broker("broker-b")
    # the leader alone registers broker-a; broker-b is a group of one, not replicated
    assert registered == {
        GROUP: group.leader_address,
        "broker-b": f"{stack.gateway}:{stack.ports['BROKER_B']}",
    }
    assert not lone.replicated
    # the console's view of the group (its Cluster page reads this)
    url = f"http://127.0.0.1:{stack.ports['CONSOLE']}/api/v1/brokers/{GROUP}/replicas"
    view: dict[str, object] = {}

    def console_shows_three() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                view.update(json.load(resp))
        except OSError:
            return False
        return view.get("in_sync_count") == 3

    try:
        wait_for("the console shows 3 replicas in sync", console_shows_three, 30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {view}") from None


def test_prometheus_scrapes_every_replica_and_etcd(stack: ComposeStack) -> None:
    wait_scraped(stack.ports["PROMETHEUS"], {*SERVICES, "console"})


async def test_kill_9_of_the_leading_container_loses_no_acknowledged_message(
    stack: ComposeStack,
) -> None:
    before = await wait_group(stack, "a leader and 3 replicas in sync", all_in_sync, 60)
    assert before.leader is not None
    old_id = before.leader_id
    killed = stack.container(service_at(stack, before.leader_address))
    async with AdminClient(stack.namesrv) as admin:
        await admin.create_or_update_topic(TOPIC, queues=4, brokers=[GROUP])

    acked: set[bytes] = set()
    failures: list[str] = []
    todo = [f"m{i}".encode() for i in reversed(range(COUNT))]

    async def worker(producer: Producer) -> None:
        # each message sent again until acknowledged: the outcome of a failed send may be
        # unknown, so the consumer may read one twice, but must read every one
        while todo:
            body = todo.pop()
            while body not in acked:
                try:
                    await producer.send(Message(TOPIC, body))
                except ApogeeError as err:
                    failures.append(f"{body!r}: {err}")
                    await asyncio.sleep(0.05)  # a pause between attempts, not a wait
                else:
                    acked.add(body)

    async with Producer(
        stack.namesrv, group="compose-replicas", send_timeout=5.0, route_refresh_interval=0.5
    ) as producer:
        sending = asyncio.gather(*(worker(producer) for _ in range(4)))
        try:
            await eventually(lambda: len(acked) >= BEFORE_KILL, 60, f"{BEFORE_KILL} acked")
            await asyncio.to_thread(podman, "kill", "--signal", "KILL", killed)
            killed_at = time.monotonic()
            assert inspect(killed)["State"]["Running"] is False
            after = await wait_group(
                stack,
                "another replica described as leader",
                lambda g: g.leader is not None and g.leader_id != old_id,
                FAILOVER_DEADLINE_S,
            )
            failover_s = time.monotonic() - killed_at
            await asyncio.wait_for(asyncio.shield(sending), DEADLINE_S)
        finally:
            if not sending.done():
                todo.clear()
                await asyncio.wait_for(sending, 30)
    assert after.epoch > before.epoch
    assert acked == {f"m{i}".encode() for i in range(COUNT)}

    seen: set[bytes] = set()
    async with PullConsumer(
        stack.namesrv, "compose-replicas-readers", consume_from="earliest", rebalance_interval=1.0
    ) as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        deadline = time.monotonic() + DEADLINE_S
        while not acked <= seen and time.monotonic() < deadline:
            seen.update(m.body for m in await consumer.poll(timeout=1.0))
    assert acked - seen == set(), f"{len(acked - seen)} of {len(acked)} acknowledged lost"

    # podman counts a kill as the user's stop: an operator (here the test) starts it again
    await asyncio.to_thread(podman, "start", killed)
    await asyncio.to_thread(wait_healthy, killed)
    back = await wait_group(
        stack,
        f"replica {old_id} back in the in-sync set",
        lambda g: all_in_sync(g) and old_id in g.in_sync,
        90,
    )
    [rejoined] = [r for r in back.replicas if r.replica_id == old_id]
    assert rejoined.role == "FOLLOWER"
    print(
        f"failover: leader {old_id} ({killed}) killed, {after.leader_id} described as leader "
        f"after {failover_s:.1f} s; {len(acked)} acknowledged, {len(failures)} failed attempts"
    )


def test_down_removes_every_container_and_volume(stack: ComposeStack) -> None:
    assert stack.down() == []
    label = f"label=io.podman.compose.project={stack.project}"
    assert podman("ps", "-a", "-q", "--filter", label) == ""
    assert podman("volume", "ls", "-q", "--filter", label) == ""
