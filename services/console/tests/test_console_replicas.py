"""Replica groups in the console: a nameserver, a lone broker and three replicas of
``broker-a`` (the file coordination) in this process, shared by the module's tests. What a
user checks: GET /api/v1/brokers/{name}/replicas names the leader and the replicas in sync, a
lone broker says it is not replicated, an unknown name is a 404 naming it, and the cluster
page shows the leader and "in sync 3/3" with a table of the replicas."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from console_support import assert_problem, console_app

from apogee.client import AdminClient
from apogee.common.errors import ApogeeError
from apogee.testkit.broker import small_settings
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.waiting import eventually
from apogee_broker.replication.node import ReplicaNode
from apogee_console.app import static_dir

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

GROUP = "broker-a"
LONE = "broker-b"
RENDER = Path(__file__).parent / "support" / "render_page.mjs"


class Replicas:
    """The three replicas of :data:`GROUP` and the nameserver they register with."""

    def __init__(self, namesrv: str, nodes: list[ReplicaNode]) -> None:
        self.namesrv = namesrv
        self.nodes = nodes

    def leader_id(self) -> str:
        for n in self.nodes:
            if n.leader is not None and not n.leader.ended:
                return n.replica_id
        return ""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def group(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Replicas]:
    root = tmp_path_factory.mktemp("replicas")
    async with InProcessCluster(root / "ns", nameservers=1, brokers=(LONE,)) as ns:
        nodes: list[ReplicaNode] = []
        try:
            for i in range(3):
                node = ReplicaNode(
                    small_settings(
                        root / f"replica-{i}",
                        broker_name=GROUP,
                        namesrv=ns.namesrv,
                        shutdown_grace_s=0.5,
                        replication="file",
                        replica_group_dir=root / "group",
                        replica_lag_max_s=2.0,
                    )
                )
                nodes.append(node)
                await node.start()
            replicas = Replicas(ns.namesrv, nodes)
            async with AdminClient(ns.namesrv) as admin:

                async def all_in_sync() -> bool:
                    try:
                        g = await admin.describe_broker(GROUP)
                    except ApogeeError:  # not registered yet
                        return False
                    # eligible: each follower has read the record that counts it in sync
                    up = all(r.reachable and r.eligible for r in g.replicas)
                    return g.in_sync_count == 3 and up

                await eventually(all_in_sync, 30, f"the 3 replicas of {GROUP} in sync, eligible")
            yield replicas
        finally:  # the followers first: a leader stopping last has nobody to hand over to
            leader = replicas.leader_id() if nodes else ""
            for n in sorted(nodes, key=lambda n: n.replica_id == leader):
                await n.stop()


async def test_a_replica_group_names_its_leader_and_replicas_in_sync(group: Replicas) -> None:
    async with console_app(group.namesrv) as (_app, client):
        resp = await client.get(f"/api/v1/brokers/{GROUP}/replicas")
        assert resp.status_code == 200, resp.text
        body = resp.json()
    leader = group.leader_id()
    assert leader
    assert body["name"] == GROUP
    assert body["replicated"] is True
    assert body["leader_id"] == leader
    assert body["epoch"] >= 1
    assert body["acks"] == "all"
    assert body["min_insync_replicas"] == 2
    assert (body["in_sync_count"], body["replica_count"]) == (3, 3)
    assert sorted(body["in_sync"]) == sorted(n.replica_id for n in group.nodes)
    rows = body["replicas"]
    assert next(r["id"] for r in rows) == leader  # the leader first
    assert sorted(r["id"] for r in rows) == sorted(n.replica_id for n in group.nodes)
    assert [r["role"] for r in rows] == ["LEADER", "FOLLOWER", "FOLLOWER"]
    for r in rows:
        assert r["in_sync"]
        assert r["reachable"]
        assert r["eligible"]
        assert r["error"] is None
        assert r["address"]
        assert r["lag_bytes"] >= 0
        assert r["lag_seconds"] >= 0


async def test_a_lone_broker_is_not_replicated(group: Replicas) -> None:
    async with console_app(group.namesrv) as (_app, client):
        body = (await client.get(f"/api/v1/brokers/{LONE}/replicas")).json()
    assert body["name"] == LONE
    assert body["replicated"] is False
    assert (body["in_sync_count"], body["replica_count"]) == (1, 1)
    assert body["replicas"][0]["role"] == "LEADER"


async def test_an_unknown_broker_is_a_404_naming_it(group: Replicas) -> None:
    async with console_app(group.namesrv) as (_app, client):
        resp = await client.get("/api/v1/brokers/broker-zz/replicas")
    detail = assert_problem(resp, 404, "NOT_FOUND")["detail"]
    assert "broker 'broker-zz'" in detail
    assert GROUP in detail
    assert LONE in detail


async def test_the_cluster_lists_each_brokers_group(group: Replicas) -> None:
    async with console_app(group.namesrv) as (_app, client):
        brokers = (await client.get("/api/v1/cluster")).json()["brokers"]
    by_name = {b["name"]: b["replication"] for b in brokers}
    assert by_name[GROUP]["replicated"] is True
    assert by_name[GROUP]["leader_id"] == group.leader_id()
    assert by_name[GROUP]["in_sync_count"] == 3
    assert by_name[LONE]["replicated"] is False


def render_page(page: str, answers: dict[str, Any], work: Path) -> str:
    """The HTML the console page ``page`` renders from ``answers`` (API path to JSON),
    rendered by Node (support/render_page.mjs) without a browser."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the page cannot be rendered")
    js = work / "js"
    shutil.copytree(static_dir() / "js", js)
    (js / "package.json").write_text('{"type": "module"}\n')
    done = subprocess.run(
        [node, str(RENDER), str(js / "pages" / f"{page}.js")],
        input=json.dumps(answers),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_the_cluster_page_shows_the_leader_and_in_sync_3_of_3(
    group: Replicas, tmp_path: Path
) -> None:
    async with console_app(group.namesrv) as (_app, client):
        cluster = (await client.get("/api/v1/cluster")).json()
    html = render_page("cluster", {"/cluster": cluster}, tmp_path)
    leader = group.leader_id()
    assert f"leader {leader}, epoch " in html
    assert "in sync 3/3" in html
    assert "lone broker" in html  # broker-b
    assert html.count('data-testid="replica-row"') == 3
    assert f"<caption>Replica group {GROUP}: leader {leader}" in html
    assert '<th scope="col">Lag (bytes)</th>' in html
