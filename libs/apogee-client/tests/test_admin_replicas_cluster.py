"""AdminClient's view of replica groups, against a real group of three replicas of broker-a (on
the file coordination) and a lone broker-b, with one nameserver, all in this process: who leads
at which epoch, each replica's lag, a follower that does not answer, a registration the
nameservers have not updated yet, a controlled switch of the leader, and a lone broker as a
group of one."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from apogee.client import AdminClient, Message, Producer
from apogee.client.admin import BrokerInfo, ReplicaGroupStatus
from apogee.common.errors import InvalidArgumentError, UnsupportedError
from apogee.testkit.broker import small_settings
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.waiting import eventually
from apogee_broker.replication.node import ReplicaNode

pytestmark = pytest.mark.integration

GROUP = "broker-a"
LONE = "broker-b"
TOPIC = "Replicated"


class Group:
    """Three replicas of broker-a beside ``cluster``'s nameserver."""

    def __init__(self, root: Path, namesrv: str, cluster: str) -> None:
        self.root = root
        self.namesrv = namesrv
        self.cluster = cluster
        self.nodes: list[ReplicaNode | None] = [None, None, None]

    async def start(self, i: int) -> None:
        settings = small_settings(
            self.root / f"replica-{i}",
            cluster=self.cluster,
            broker_name=GROUP,
            namesrv=self.namesrv,
            shutdown_grace_s=0.5,
            replication="file",
            replica_group_dir=self.root / "group",
            replica_lag_max_s=1.0,
            replication_timeout_s=3.0,
            auto_create_topics=True,
        )
        node = ReplicaNode(settings)
        self.nodes[i] = node
        await node.start()

    async def stop(self, i: int) -> None:
        node, self.nodes[i] = self.nodes[i], None
        if node is not None:
            await node.stop()

    def leader(self) -> ReplicaNode | None:
        for n in self.nodes:
            if n is not None and n.role == "LEADER" and n.app is not None:
                return n
        return None

    def follower(self) -> ReplicaNode:
        return next(n for n in self.nodes if n is not None and n is not self.leader())


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[InProcessCluster, Group]]:
    async with InProcessCluster(tmp_path / "lone", nameservers=1, brokers=(LONE,)) as c:
        group = Group(tmp_path, c.namesrv, c.cluster)
        try:
            for i in range(3):
                await group.start(i)
            yield c, group
        finally:
            for i in range(3):
                await group.stop(i)


@pytest.fixture
def refused() -> Iterator[str]:
    """An address nothing answers on (bound by this test, not listening)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


async def settled(admin: AdminClient, in_sync: int = 3, **expect: Any) -> ReplicaGroupStatus:
    """broker-a's group once a leader is registered, ``in_sync`` replicas are in sync and each
    of them answers (and ``expect``'s fields have their values)."""
    found: list[ReplicaGroupStatus] = []

    async def ready() -> bool:
        try:
            status = await admin.describe_broker(GROUP)
        except Exception:
            return False
        found[:] = [status]
        return (
            status.leader is not None
            and status.in_sync_count == in_sync
            and all(r.reachable for r in status.replicas if r.in_sync)
            and all(getattr(status, k) == v for k, v in expect.items())
        )

    await eventually(ready, 20, f"broker-a led with {in_sync} in sync ({expect})")
    return found[0]


async def test_a_group_shows_its_leader_epoch_and_each_replica_in_sync(
    cluster: tuple[InProcessCluster, Group],
) -> None:
    c, group = cluster
    async with AdminClient(c.namesrv) as admin:
        await settled(admin)
        async with Producer(c.namesrv) as producer:
            for i in range(20):
                await producer.send(Message(TOPIC, f"m{i}".encode()))
        status = await settled(admin)
        leader = group.leader()
        assert leader is not None
        assert leader.leader is not None
        assert status.replicated
        assert (status.leader_id, status.leader_address) == (leader.replica_id, leader.address)
        assert status.epoch == leader.leader.epoch >= 1
        assert (status.acks, status.min_insync_replicas) == (
            leader.settings.acks,
            leader.settings.min_insync_replicas,
        )
        ids = {n.replica_id for n in group.nodes if n is not None}
        assert set(status.in_sync) == ids
        assert {r.replica_id for r in status.replicas} == ids
        assert [r.role for r in status.replicas] == ["LEADER", "FOLLOWER", "FOLLOWER"]
        assert status.replicas[0].address == leader.address
        assert status.log_end > 0
        assert status.high_watermark == status.log_end  # every send was acknowledged by all

        async def caught_up() -> bool:
            s = await admin.describe_broker(GROUP)
            return all(r.log_end == s.log_end and r.lag_bytes == 0 for r in s.replicas)

        await eventually(caught_up, 10, "every replica at the leader's log end")


async def test_a_follower_that_is_down_is_reported_unreachable_not_raised(
    cluster: tuple[InProcessCluster, Group],
) -> None:
    c, group = cluster
    async with AdminClient(c.namesrv, timeout=1.0) as admin:
        await settled(admin)
        gone = group.follower()
        await group.stop(group.nodes.index(gone))
        status = await settled(admin, in_sync=2)
        [down] = [r for r in status.replicas if r.replica_id == gone.replica_id]
        assert not down.reachable
        assert down.error is not None
        assert down.role == ""
        assert not down.in_sync
        assert not down.eligible
        assert down.address == gone.address
        assert sum(r.reachable for r in status.replicas) == 2


async def test_a_stale_registration_leads_to_the_leader_the_replica_names(
    cluster: tuple[InProcessCluster, Group],
) -> None:
    c, group = cluster
    async with AdminClient(c.namesrv) as admin:
        await settled(admin)
        # a follower that started after the leader began to serve knows its client address
        i = group.nodes.index(group.follower())
        await group.stop(i)
        await group.start(i)
        await settled(admin)
    follower = group.nodes[i]
    assert follower is not None
    stale = follower.address

    class Stale(AdminClient):
        """Nameservers that still list a follower's address for broker-a."""

        async def cluster_info(self) -> list[BrokerInfo]:
            return [
                BrokerInfo(b.cluster, b.broker_name, stale, 1, 0, False)
                if b.broker_name == GROUP
                else b
                for b in await super().cluster_info()
            ]

    async with Stale(c.namesrv) as admin:
        status = await admin.describe_broker(GROUP)
    leader = group.leader()
    assert leader is not None
    assert status.leader_id == leader.replica_id
    assert status.replicas[0].address == leader.address


async def test_elect_hands_leadership_to_the_follower_named(
    cluster: tuple[InProcessCluster, Group],
) -> None:
    c, group = cluster
    async with AdminClient(c.namesrv) as admin:
        before = await settled(admin)
        target = group.follower()
        done = await admin.elect(GROUP, target.replica_id)
        epoch, leader_id, leader_address = done
        assert (leader_id, leader_address) == (target.replica_id, target.address)
        assert epoch > before.epoch
        # the old leader follows the new one and, caught up, is back in the in-sync set
        after = await settled(admin, leader_id=target.replica_id)
        assert after.epoch == epoch
        assert after.leader_address == target.address
        assert [r.replica_id for r in after.replicas if r.role == "LEADER"] == [target.replica_id]
        old = before.leader_id
        assert [r.role for r in after.replicas if r.replica_id == old] == ["FOLLOWER"]


async def test_elect_refuses_a_replica_that_is_not_in_the_group(
    cluster: tuple[InProcessCluster, Group],
) -> None:
    c, _ = cluster
    async with AdminClient(c.namesrv) as admin:
        before = await settled(admin)
        with pytest.raises(InvalidArgumentError, match="replica_id: 'nobody'"):
            await admin.elect(GROUP, "nobody")
        with pytest.raises(InvalidArgumentError, match="replica_id: must be a replica id"):
            await admin.elect(GROUP, " padded ")
        after = await admin.describe_broker(GROUP)
    assert (after.leader_id, after.epoch) == (before.leader_id, before.epoch)


async def test_a_lone_broker_is_a_group_of_one_and_cannot_elect(
    cluster: tuple[InProcessCluster, Group],
) -> None:
    c, _ = cluster
    lone = c.brokers[LONE]
    address = f"127.0.0.1:{lone.port}"
    async with AdminClient(c.namesrv) as admin:
        await admin.create_or_update_topic("Alone", queues=1, brokers=[LONE])
        await c.wait_route("Alone", {LONE})
        async with Producer(c.namesrv) as producer:
            await producer.send(Message("Alone", b"on the lone broker"))
        status = await admin.describe_broker(LONE)
        assert not status.replicated
        assert status.epoch == 0
        assert status.leader_address == address
        [only] = status.replicas
        assert (only.address, only.role, only.in_sync, only.reachable) == (
            address,
            "LEADER",
            True,
            True,
        )
        assert only.log_end == status.log_end == status.high_watermark > 0
        with pytest.raises(UnsupportedError, match="is a lone broker, not a replica group"):
            await admin.elect(LONE)
        with pytest.raises(InvalidArgumentError, match="'broker-z' is not a live broker"):
            await admin.describe_broker("broker-z")
        await settled(admin)
        answers = {a.broker.broker_name: a.value for a in await admin.replica_groups()}
    assert set(answers) == {GROUP, LONE}
    alone, grouped = answers[LONE], answers[GROUP]
    assert alone is not None
    assert not alone.replicated
    assert grouped is not None
    assert grouped.replicated


async def test_a_broker_whose_address_does_not_answer_is_an_error_in_its_answer(
    cluster: tuple[InProcessCluster, Group], refused: str
) -> None:
    c, _ = cluster

    class WithGhost(AdminClient):
        async def cluster_info(self) -> list[BrokerInfo]:
            ghost = BrokerInfo(c.cluster, "broker-z", refused, 1, 0, False)
            return [*await super().cluster_info(), ghost]

    async with WithGhost(c.namesrv, timeout=1.0) as admin:
        answers = {a.broker.broker_name: a for a in await admin.replica_groups()}
    assert answers["broker-z"].value is None
    assert answers["broker-z"].error is not None
    assert answers["broker-z"].error.kind.name == "UNAVAILABLE"
    assert answers[LONE].ok
