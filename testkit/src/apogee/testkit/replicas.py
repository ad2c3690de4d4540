"""A replica group in this process, for tests: ``count`` replicas of ``broker-a`` on the file
coordination (:class:`~apogee_broker.replication.node.ReplicaNode`), beside a nameserver the test
starts (:class:`~apogee.testkit.cluster.InProcessCluster` with no broker).

    async with InProcessCluster(tmp_path / "ns", nameservers=1, brokers=()) as ns:
        async with ReplicaGroup(tmp_path, ns.namesrv, 3) as group:
            await group.start_all()
            leader = await group.wait_leader(in_sync=3)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from apogee.testkit.broker import small_settings
from apogee.testkit.waiting import eventually
from apogee_broker.replication.node import ReplicaNode

#: The test settings of every replica (a test's options override them).
REPLICA_SETTINGS: dict[str, Any] = {
    "broker_name": "broker-a",
    "shutdown_grace_s": 0.5,
    "replication": "file",
    "replica_lag_max_s": 2.0,
    "replication_timeout_s": 3.0,
    "auto_create_topics": True,
    "offset_persist_interval_s": 0.2,
}


class ReplicaGroup:
    """Replicas ``replica-<i>`` under ``root``, the group's record in ``root/group``; each
    started with :data:`REPLICA_SETTINGS`, then ``options``, then :meth:`start`'s own."""

    def __init__(self, root: Path, namesrv: str, count: int, **options: Any) -> None:
        self.root = root
        self.namesrv = namesrv
        self.options = options
        self.nodes: list[ReplicaNode | None] = [None] * count

    async def __aenter__(self) -> ReplicaGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_all()

    async def start(self, i: int, **options: Any) -> ReplicaNode:
        settings = small_settings(
            self.root / f"replica-{i}",
            namesrv=self.namesrv,
            replica_group_dir=self.root / "group",
            **(REPLICA_SETTINGS | self.options | options),
        )
        node = ReplicaNode(settings)
        await node.start()
        self.nodes[i] = node
        return node

    async def start_all(self) -> None:
        for i in range(len(self.nodes)):
            await self.start(i)

    async def stop(self, i: int) -> None:
        node = self.nodes[i]
        self.nodes[i] = None
        if node is not None:
            await node.stop()

    async def stop_all(self) -> None:
        """The followers first: a leader stopping last has nobody to hand over to, and does
        not wait for anyone."""
        lead = self.leader()
        for i, n in enumerate(self.nodes):
            if n is not lead:
                await self.stop(i)
        for i in range(len(self.nodes)):
            await self.stop(i)

    def leader(self) -> ReplicaNode | None:
        for n in self.nodes:
            if n is not None and n.app is not None and n.leader is not None and not n.leader.ended:
                return n
        return None

    async def wait_leader(self, in_sync: int = 1) -> ReplicaNode:
        async def led() -> bool:
            n = self.leader()
            return n is not None and n.leader is not None and len(n.leader.in_sync) >= in_sync

        await eventually(led, 20, f"a leader with {in_sync} in sync")
        found = self.leader()
        assert found is not None
        return found
