"""A replica group on the Kubernetes Lease (``replication = lease``), as the Helm chart runs it:
three replicas of broker-a in this process, the API server the in-test stand-in (no real API
server can run here), found through ``$KUBECONFIG`` as outside a pod. What an operator checks:
the Lease ``<lease_prefix>-<broker_name>`` names the leader and holds the group's record, sends
are acknowledged by the in-sync set, and when the leader stops another replica takes the Lease
with a higher epoch and everything acknowledged."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from apogee.client import Message, Producer, PullConsumer
from apogee.common.errors import InvalidArgumentError
from apogee.service.lease_group import RECORD_ANNOTATION
from apogee.service.replica_group import GroupRecord
from apogee.testkit.apiserver import FakeApiServer
from apogee.testkit.broker import small_settings
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.waiting import eventually
from apogee_broker.replication.node import ReplicaNode
from apogee_broker.settings import BrokerSettings

pytestmark = pytest.mark.integration

NS = "apogee-test"
LEASE = "apogee-replicas-broker-a"
TOPIC = "OnTheLease"


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield server


def settings(root: Path, namesrv: str, i: int) -> BrokerSettings:
    return small_settings(
        root / f"replica-{i}",
        broker_name="broker-a",
        namesrv=namesrv,
        shutdown_grace_s=0.5,
        replication="lease",
        lease_namespace=NS,
        replica_lease_s=2.0,
        replica_lag_max_s=2.0,
        replication_timeout_s=3.0,
        auto_create_topics=True,
    )


@pytest.fixture
async def group(
    api: FakeApiServer, tmp_path: Path
) -> AsyncIterator[tuple[str, list[ReplicaNode | None]]]:
    async with InProcessCluster(tmp_path / "ns", nameservers=1, brokers=()) as ns:
        nodes: list[ReplicaNode | None] = []
        try:
            for i in range(3):
                node = ReplicaNode(settings(tmp_path, ns.namesrv, i))
                nodes.append(node)
                await node.start()
            yield ns.namesrv, nodes
        finally:
            for node in sorted(  # the followers first: a leader stopping last hands off to none
                (n for n in nodes if n is not None), key=lambda n: n.role == "LEADER"
            ):
                await node.stop()


def lease_record(api: FakeApiServer) -> tuple[str, GroupRecord]:
    lease = api.get("leases", NS, LEASE)
    if lease is None:
        return "", GroupRecord()
    text = lease["metadata"].get("annotations", {}).get(RECORD_ANNOTATION, "{}")
    return lease["spec"].get("holderIdentity") or "", GroupRecord.from_json(text, LEASE)


def leader_of(nodes: list[ReplicaNode | None]) -> ReplicaNode | None:
    return next(
        (n for n in nodes if n is not None and n.app is not None and n.leader is not None), None
    )


async def test_the_lease_names_the_leader_and_a_stopped_leader_hands_it_on(
    api: FakeApiServer, group: tuple[str, list[ReplicaNode | None]]
) -> None:
    namesrv, nodes = group

    def whole() -> bool:
        holder, record = lease_record(api)
        lead = leader_of(nodes)
        return lead is not None and holder == lead.replica_id and len(record.in_sync) == 3

    await eventually(whole, 20, f"Lease {NS}/{LEASE} held by a leader with 3 in sync")
    old = leader_of(nodes)
    assert old is not None
    holder, record = lease_record(api)
    assert record.leader == holder == old.replica_id
    assert set(record.in_sync) == {n.replica_id for n in nodes if n is not None}
    first_epoch = record.epoch
    async with Producer(namesrv, route_refresh_interval=0.2) as producer:
        acked = {
            (await producer.send(Message(TOPIC, f"m{i}".encode()))).message_id for i in range(20)
        }
        i = nodes.index(old)
        nodes[i] = None
        await old.stop()  # SIGTERM's path: a handoff to an in-sync follower

        def moved() -> bool:
            holder, record = lease_record(api)
            lead = leader_of(nodes)
            return (
                lead is not None
                and holder == lead.replica_id != old.replica_id
                and record.epoch > first_epoch
            )

        await eventually(moved, 20, "the Lease held by another replica at a higher epoch")
        acked.add((await producer.send(Message(TOPIC, b"after"))).message_id)
    seen: set[str] = set()
    async with PullConsumer(namesrv, "lease-readers", consume_from="earliest") as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()

        async def all_read() -> bool:
            seen.update(m.unique_id for m in await consumer.poll(timeout=0.5))
            return acked <= seen

        await eventually(all_read, 20, "every acknowledged message read from the new leader")


def test_a_lease_name_that_kubernetes_refuses_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"lease_prefix.*replication = lease"):
        small_settings(
            tmp_path, broker_name="broker-a", replication="lease", lease_prefix="Not_A_Name"
        )
