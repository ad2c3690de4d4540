"""The official RocketMQ 5 Python client given a follower of a replica group as its access point,
as a Kubernetes Service in front of every broker pod (the Helm chart's ``<fullname>-endpoint``)
may give it: the follower answers the client's route query with the cluster's route, and the
client then sends, receives and acks at the group's leader. Real processes: a nameserver and
three replicas of ``broker-a`` on the file coordination (:mod:`e2e.replication_support`), the
client in a process of its own (:mod:`e2e.rocketmq_support`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apogee.client import AdminClient
from e2e.replication_support import ReplicaGroup
from e2e.rocketmq_support import OfficialClients, by_body, receive_until, unique

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_a_follower_as_access_point_leads_the_client_to_the_leader(tmp_path: Path) -> None:
    topic, group = unique("RmqReplicated"), unique("rmq-replicated")
    async with ReplicaGroup(tmp_path / "group") as replicas:
        leader = await replicas.wait_leader()
        follower = next(r for r in replicas.replicas if r is not leader)
        async with AdminClient(replicas.namesrv) as admin:
            await admin.create_or_update_topic(topic, queues=2, message_type="NORMAL")
        clients = OfficialClients(tmp_path / "clients")
        try:
            consumer = clients.simple(follower.address, group, topic)
            producer = clients.producer(follower.address, [topic])
            sent = {}
            for i in range(5):
                body = f"through a follower {i}"
                sent[body] = producer.call("send", topic=topic, body=body)
            got = receive_until(
                consumer,
                lambda ms: set(by_body(ms)) >= set(sent),
                invisible_s=10,
                timeout=60.0,
                what="the five messages received",
                ack=True,
            )
        finally:
            clients.close()
    deliveries = by_body(got)
    assert sorted(deliveries) == sorted(sent)
    for body, receipt in sent.items():
        assert [m["message_id"] for m in deliveries[body]] == [receipt["message_id"]]
