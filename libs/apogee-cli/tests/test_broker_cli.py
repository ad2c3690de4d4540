"""``apogee broker describe`` and ``apogee broker elect``, and the replicas line of ``apogee
cluster status``, against a real replica group of three replicas of broker-a (on the file
coordination) and a lone broker-b, with one nameserver, all in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.cli.brokers import group_summary
from apogee.cli.main import main
from apogee.client import AdminClient
from apogee.local.commands import _replica_lines
from apogee.testkit.broker import small_settings
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.waiting import eventually
from apogee_broker.replication.node import ReplicaNode

pytestmark = pytest.mark.integration

GROUP = "broker-a"
LONE = "broker-b"


class Group:
    """Three replicas of broker-a beside a cluster's nameserver."""

    def __init__(self, root: Path, namesrv: str, cluster: str) -> None:
        self.root = root
        self.namesrv = namesrv
        self.cluster = cluster
        self.nodes: list[ReplicaNode] = []

    async def start(self, count: int) -> None:
        for i in range(count):
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
            )
            node = ReplicaNode(settings)
            self.nodes.append(node)
            await node.start()

    async def stop(self) -> None:
        for node in self.nodes:
            await node.stop()

    def leader(self) -> ReplicaNode:
        [leader] = [n for n in self.nodes if n.role == "LEADER" and n.app is not None]
        return leader


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[str, Group]]:
    async with InProcessCluster(tmp_path / "lone", nameservers=1, brokers=(LONE,)) as c:
        group = Group(tmp_path, c.namesrv, c.cluster)
        try:
            await group.start(3)
            async with AdminClient(c.namesrv) as admin:

                async def settled() -> bool:
                    try:
                        status = await admin.describe_broker(GROUP)
                    except Exception:
                        return False
                    return status.in_sync_count == 3 and all(r.reachable for r in status.replicas)

                await eventually(settled, 20, "broker-a led with its 3 replicas in sync")
            yield c.namesrv, group
        finally:
            await group.stop()


async def run(namesrv: str, *args: str) -> int:
    return await asyncio.to_thread(main, ["--namesrv", namesrv, *args])


def table(out: str) -> dict[str, list[str]]:
    """The replica rows of a describe, by replica id (its cells split on runs of spaces)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["ID", "ADDRESS"])
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1 :]:
        if not line.startswith("  ") or line.startswith("  replica "):
            break
        cells = [c for c in line.strip().split("  ") if c]
        rows[cells[0].strip()] = [c.strip() for c in cells]
    return rows


async def test_describe_names_the_leader_and_shows_every_replica_in_sync(
    cluster: tuple[str, Group], capsys: pytest.CaptureFixture[str]
) -> None:
    namesrv, group = cluster
    leader = group.leader()
    assert leader.leader is not None
    assert await run(namesrv, "broker", "describe", GROUP) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"broker {GROUP} (cluster ")
    assert f"  leader:          {leader.replica_id} at {leader.address}" in lines
    assert f"  epoch:           {leader.leader.epoch}" in lines
    assert "  acks:            all" in lines
    assert "  min in-sync:     2" in lines
    assert any(line.startswith("  high watermark:  ") for line in lines)
    assert "  in sync:         3/3" in lines
    rows = table(out)
    assert set(rows) == {n.replica_id for n in group.nodes}
    assert rows[leader.replica_id][1:4] == [leader.address, "LEADER", "yes"]
    followers = [rows[n.replica_id] for n in group.nodes if n is not leader]
    assert [(f[2], f[3]) for f in followers] == [("FOLLOWER", "yes"), ("FOLLOWER", "yes")]


async def test_describe_without_a_name_shows_every_broker_and_a_lone_one_has_no_replication(
    cluster: tuple[str, Group], capsys: pytest.CaptureFixture[str]
) -> None:
    namesrv, group = cluster
    assert await run(namesrv, "broker", "describe") == 0
    out = capsys.readouterr().out
    first, second = out.split("\n\n")
    assert first.startswith(f"broker {GROUP} ")
    assert f"leader:          {group.leader().replica_id}" in first
    assert second.startswith(f"broker {LONE} ")
    assert "  replication:     none (a lone broker, not a replica group)" in second.splitlines()

    assert await run(namesrv, "broker", "describe", LONE) == 0
    assert "replication:     none" in capsys.readouterr().out
    assert await run(namesrv, "broker", "describe", "broker-z") == 1
    assert "'broker-z' is not a live broker" in capsys.readouterr().err


async def test_elect_switches_the_leader_and_describe_shows_it_at_a_higher_epoch(
    cluster: tuple[str, Group], capsys: pytest.CaptureFixture[str]
) -> None:
    namesrv, group = cluster
    old = group.leader()
    assert old.leader is not None
    before = old.leader.epoch
    target = next(n for n in group.nodes if n is not old)
    assert await run(namesrv, "broker", "elect", GROUP, "--to", target.replica_id) == 0
    said = capsys.readouterr().out.strip()
    assert said.startswith(f"broker {GROUP}: replica {target.replica_id} at {target.address}")
    epoch = int(said.rsplit("epoch ", 1)[1])
    assert epoch > before

    async def switched() -> bool:
        assert await run(namesrv, "broker", "describe", GROUP) == 0
        out = capsys.readouterr().out
        return (
            f"leader:          {target.replica_id} at {target.address}" in out
            and "in sync:         3/3" in out  # the old leader follows, in sync again
        )

    await eventually(switched, 20, "describe naming the new leader, 3 replicas in sync")
    assert await run(namesrv, "broker", "describe", GROUP) == 0
    out = capsys.readouterr().out
    assert f"  epoch:           {epoch}" in out.splitlines()
    rows = table(out)
    assert rows[target.replica_id][2:4] == ["LEADER", "yes"]
    assert rows[old.replica_id][2:4] == ["FOLLOWER", "yes"]

    # without --to: the most caught-up in-sync follower, another switch
    assert await run(namesrv, "broker", "elect", GROUP) == 0
    again = capsys.readouterr().out.strip()
    assert target.replica_id not in again.split(" leads now")[0]
    assert int(again.rsplit("epoch ", 1)[1]) > epoch


async def test_elect_refuses_a_lone_broker_and_an_unknown_replica(
    cluster: tuple[str, Group], capsys: pytest.CaptureFixture[str]
) -> None:
    namesrv, group = cluster
    leader = group.leader()
    assert await run(namesrv, "broker", "elect", LONE) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"apogee: broker {LONE} at ")
    assert err.endswith("is a lone broker, not a replica group: no other replica can lead")
    assert await run(namesrv, "broker", "elect", GROUP, "--to", "nobody") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("apogee: replica_id: 'nobody' is not an in-sync follower")
    assert group.leader() is leader  # nothing moved


async def test_cluster_status_line_for_a_replica_group(cluster: tuple[str, Group]) -> None:
    namesrv, group = cluster
    leader = group.leader()
    assert leader.leader is not None
    async with AdminClient(namesrv) as admin:
        assert group_summary(await admin.describe_broker(LONE)) is None
    lines = await asyncio.to_thread(_replica_lines, namesrv)
    assert lines == {
        GROUP: (
            leader.address,
            f"replicas: 3/3 in sync, leader {leader.replica_id} epoch {leader.leader.epoch}",
        )
    }
