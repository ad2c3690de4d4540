"""The replica group's metrics as Prometheus scrapes them (the text format), from a replica in
each role: a leader with a follower caught up and one behind, a follower, a candidate with
nothing open yet; refusal counts that go on across terms; a scrape that never fails, whatever
the node holds; and the same read from a real group of three replicas after a few sends."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc.aio
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from apogee.testkit.broker import small_settings
from apogee.testkit.waiting import eventually
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from apogee_broker.replication.metrics import ReplicationCollector
from apogee_broker.replication.node import ReplicaNode

unit = pytest.mark.unit

BROKER = "broker-a"
NOW = 1000.0


def settings(replicas: int = 3, min_insync: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        broker_name=BROKER,
        cluster="DefaultCluster",
        replicas=replicas,
        min_insync_replicas=min_insync,
        acks="all",
    )


def store(end: int) -> SimpleNamespace:
    return SimpleNamespace(commitlog=SimpleNamespace(max_offset=end), closed=False)


def follower_state(rid: str, offset: int, caught_up_at: float) -> SimpleNamespace:
    return SimpleNamespace(
        replica_id=rid,
        address=f"{rid}:10911",
        offset=offset,
        last_heard=NOW,
        caught_up_at=caught_up_at,
        sent_end=offset,
    )


def leader(
    epoch: int = 4,
    in_sync: set[str] | None = None,
    followers: list[SimpleNamespace] | None = None,
    written_end: int = 5000,
    hw: int = 5000,
    not_enough: int = 0,
    not_replicated: int = 0,
) -> SimpleNamespace:
    return SimpleNamespace(
        epoch=epoch,
        in_sync=in_sync if in_sync is not None else {"r1"},
        followers={f.replica_id: f for f in followers or []},
        written_end=written_end,
        hw=hw,
        refusals={"not_enough_replicas": not_enough, "not_replicated": not_replicated},
    )


def node(**fields: Any) -> SimpleNamespace:
    base: dict[str, Any] = {
        "role": "CANDIDATE",
        "replica_id": "r1",
        "record": SimpleNamespace(epoch=3, leader="", in_sync=(), members=()),
        "terms": 0,
        "leader": None,
        "follower": None,
        "store": None,
        "settings": settings(),
    }
    return SimpleNamespace(**{**base, **fields})


def collector(n: Any) -> ReplicationCollector:
    return ReplicationCollector(n, monotonic=lambda: NOW)


def scrape(c: ReplicationCollector) -> set[str]:
    """The replica samples of one scrape, as the lines of the text format."""
    registry = CollectorRegistry()
    registry.register(c)
    text = generate_latest(registry).decode()
    return {line for line in text.splitlines() if line.startswith("apogee_broker_replica_")}


def roles(replica: str, current: str) -> set[str]:
    return {
        f'apogee_broker_replica_role{{broker="{BROKER}",replica="{replica}",role="{r}"}} '
        f"{1.0 if r == current else 0.0}"
        for r in ("LEADER", "FOLLOWER", "CANDIDATE")
    }


def refusals(not_enough: float, not_replicated: float) -> set[str]:
    return {
        f'apogee_broker_replica_refusals_total{{broker="{BROKER}",reason="not_enough_replicas"}} '
        f"{not_enough}",
        f'apogee_broker_replica_refusals_total{{broker="{BROKER}",reason="not_replicated"}} '
        f"{not_replicated}",
    }


@unit
def test_a_leader_exports_its_in_sync_set_and_each_followers_lag() -> None:
    n = node(
        role="LEADER",
        terms=2,
        store=store(5000),
        leader=leader(
            epoch=4,
            in_sync={"r1", "r2"},
            followers=[
                follower_state("r2", 5000, caught_up_at=NOW - 0.2),  # has everything
                follower_state("r3", 1000, caught_up_at=NOW - 12.5),  # 4000 bytes behind
            ],
            written_end=5000,
            hw=4200,
            not_enough=2,
            not_replicated=1,
        ),
    )
    assert scrape(collector(n)) == roles("r1", "LEADER") | refusals(2.0, 1.0) | {
        f'apogee_broker_replica_epoch{{broker="{BROKER}",replica="r1"}} 4.0',
        f'apogee_broker_replica_log_end_bytes{{broker="{BROKER}",replica="r1"}} 5000.0',
        f'apogee_broker_replica_high_watermark_bytes{{broker="{BROKER}",replica="r1"}} 4200.0',
        f'apogee_broker_replica_leader_terms_total{{broker="{BROKER}",replica="r1"}} 2.0',
        f'apogee_broker_replica_in_sync{{broker="{BROKER}"}} 2.0',
        f'apogee_broker_replica_min_in_sync{{broker="{BROKER}"}} 2.0',
        f'apogee_broker_replica_under_replicated{{broker="{BROKER}"}} 1.0',
        f'apogee_broker_replica_follower_lag_bytes{{broker="{BROKER}",follower="r2"}} 0.0',
        f'apogee_broker_replica_follower_lag_bytes{{broker="{BROKER}",follower="r3"}} 4000.0',
        f'apogee_broker_replica_follower_lag_seconds{{broker="{BROKER}",follower="r2"}} 0.0',
        f'apogee_broker_replica_follower_lag_seconds{{broker="{BROKER}",follower="r3"}} 12.5',
    }


@unit
def test_a_leader_with_every_replica_in_sync_is_not_under_replicated() -> None:
    n = node(
        role="LEADER",
        store=store(10),
        leader=leader(in_sync={"r1", "r2", "r3"}, written_end=10, hw=10),
    )
    got = scrape(collector(n))
    assert f'apogee_broker_replica_under_replicated{{broker="{BROKER}"}} 0.0' in got
    assert f'apogee_broker_replica_in_sync{{broker="{BROKER}"}} 3.0' in got


@unit
def test_a_follower_exports_the_high_watermark_its_leader_told_it_and_no_leader_metrics() -> None:
    n = node(
        role="FOLLOWER",
        replica_id="r2",
        terms=1,  # it led once, before
        record=SimpleNamespace(epoch=7, leader="r1", in_sync=("r1", "r2"), members=()),
        store=store(3500),
        follower=SimpleNamespace(high_watermark=3000, leader_end=3600, caught_up=False),
    )
    assert scrape(collector(n)) == roles("r2", "FOLLOWER") | refusals(0.0, 0.0) | {
        f'apogee_broker_replica_epoch{{broker="{BROKER}",replica="r2"}} 7.0',
        f'apogee_broker_replica_log_end_bytes{{broker="{BROKER}",replica="r2"}} 3500.0',
        f'apogee_broker_replica_high_watermark_bytes{{broker="{BROKER}",replica="r2"}} 3000.0',
        f'apogee_broker_replica_leader_terms_total{{broker="{BROKER}",replica="r2"}} 1.0',
    }


@unit
def test_a_candidate_with_no_store_leader_or_follower_scrapes() -> None:
    n = node(replica_id="")  # not started: no identity, no store yet
    assert scrape(collector(n)) == roles("", "CANDIDATE") | refusals(0.0, 0.0) | {
        f'apogee_broker_replica_epoch{{broker="{BROKER}",replica=""}} 3.0',
        f'apogee_broker_replica_leader_terms_total{{broker="{BROKER}",replica=""}} 0.0',
    }


@unit
def test_a_closed_store_has_no_log_end() -> None:
    closed = store(5000)
    closed.closed = True
    got = scrape(collector(node(role="CANDIDATE", store=closed)))
    assert not any(line.startswith("apogee_broker_replica_log_end_bytes") for line in got)


@unit
def test_refusals_add_up_over_terms_and_never_go_down() -> None:
    n = node(role="LEADER", terms=1, store=store(0), leader=leader(epoch=4, not_enough=2))
    c = collector(n)
    assert refusals(2.0, 0.0) <= scrape(c)
    n.leader.refusals["not_replicated"] = 3
    assert refusals(2.0, 3.0) <= scrape(c)
    # the term ends: a follower keeps what its terms counted
    n.role, n.leader = "FOLLOWER", None
    n.follower = SimpleNamespace(high_watermark=0)
    assert refusals(2.0, 3.0) <= scrape(c)
    # a new term counts from 0 on a new leader object: added to the earlier terms
    n.role, n.follower, n.terms = "LEADER", None, 2
    n.leader = leader(epoch=6, not_enough=1)
    assert refusals(3.0, 3.0) <= scrape(c)
    n.leader.refusals["not_enough_replicas"] = 4
    assert refusals(6.0, 3.0) <= scrape(c)
    # straight into another term, without a scrape in between
    n.leader = leader(epoch=7, not_replicated=1)
    assert refusals(6.0, 4.0) <= scrape(c)
    assert f'apogee_broker_replica_leader_terms_total{{broker="{BROKER}",replica="r1"}} 2.0' in (
        scrape(c)
    )


class Broken:
    """An attribute that raises when read, as a torn state might."""

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        raise RuntimeError("dictionary changed size during iteration")


class BrokenLeader(SimpleNamespace):
    followers = Broken()


class BrokenStore(SimpleNamespace):
    commitlog = Broken()


@unit
def test_a_part_that_cannot_be_read_is_left_out_and_the_rest_scraped() -> None:
    n = node(
        role="LEADER",
        terms=1,
        store=BrokenStore(closed=False),
        leader=BrokenLeader(
            epoch=4,
            in_sync={"r1"},
            written_end=0,
            hw=0,
            refusals={"not_enough_replicas": 0, "not_replicated": 0},
        ),
    )
    got = scrape(collector(n))
    # the log end and high watermark fail with the store: left out, the rest is there
    assert roles("r1", "LEADER") <= got
    assert refusals(0.0, 0.0) <= got
    assert f'apogee_broker_replica_leader_terms_total{{broker="{BROKER}",replica="r1"}} 1.0' in got
    assert not any(line.startswith("apogee_broker_replica_log_end") for line in got)
    assert not any(line.startswith("apogee_broker_replica_high_watermark") for line in got)
    # the leader's part fails at its followers: none of it is exported, not half
    assert not any(line.startswith("apogee_broker_replica_in_sync") for line in got)


@unit
def test_a_node_without_settings_scrapes_empty() -> None:
    assert scrape(collector(SimpleNamespace(role="LEADER"))) == set()


@pytest.mark.integration
async def test_a_real_group_of_three_scrapes_as_its_roles_say(tmp_path: Path) -> None:
    nodes: list[ReplicaNode] = []
    try:
        for i in range(3):
            node = ReplicaNode(
                small_settings(
                    tmp_path / f"replica-{i}",
                    broker_name=BROKER,
                    shutdown_grace_s=0.5,
                    replication="file",
                    replica_group_dir=tmp_path / "group",
                    replicas=3,
                    auto_create_topics=True,
                )
            )
            nodes.append(node)
            await node.start()
        collectors = {id(n): ReplicationCollector(n) for n in nodes}

        def leading() -> ReplicaNode | None:
            for n in nodes:
                if n.role == "LEADER" and n.app is not None and n.leader is not None:
                    return n
            return None

        def all_in_sync() -> bool:
            n = leading()
            return n is not None and n.leader is not None and len(n.leader.in_sync) == 3

        await eventually(all_in_sync, 20, "a leader with all 3 replicas in sync")
        lead = leading()
        assert lead is not None
        async with grpc.aio.insecure_channel(lead.address) as ch:
            reply = await broker_pb2_grpc.BrokerStub(ch).SendMessages(
                broker_pb2.SendMessagesRequest(
                    messages=[
                        common_pb2.Message(topic="Replicated", body=b"m%d" % i, queue_id=0)
                        for i in range(5)
                    ]
                ),
                timeout=10,
            )
        assert len(reply.results) == 5
        followers = [n for n in nodes if n is not lead]
        follower_ids = sorted(n.replica_id for n in followers)
        lag = "apogee_broker_replica_follower_lag_bytes"

        def caught_up() -> bool:
            got = scrape(collectors[id(lead)])
            return all(
                f'{lag}{{broker="{BROKER}",follower="{rid}"}} 0.0' in got for rid in follower_ids
            )

        await eventually(caught_up, 10, "both followers caught up, as the leader exports it")
        on_leader = scrape(collectors[id(lead)])
        assert roles(lead.replica_id, "LEADER") <= on_leader
        assert f'apogee_broker_replica_in_sync{{broker="{BROKER}"}} 3.0' in on_leader
        assert f'apogee_broker_replica_under_replicated{{broker="{BROKER}"}} 0.0' in on_leader
        assert refusals(0.0, 0.0) <= on_leader
        ends = [n.store.commitlog.max_offset for n in nodes if n.store is not None]
        end = ends[0]
        assert end > 0
        assert ends == [end] * 3  # every replica holds the five messages
        for n in nodes:
            got = scrape(collectors[id(n)])
            assert roles(n.replica_id, n.role) <= got
            assert (
                f'apogee_broker_replica_log_end_bytes{{broker="{BROKER}",replica="{n.replica_id}"}}'
                f" {float(end)}" in got
            )
            terms = 1.0 if n is lead else 0.0
            assert (
                f'apogee_broker_replica_leader_terms_total{{broker="{BROKER}",'
                f'replica="{n.replica_id}"}} {terms}' in got
            )
        for n in followers:
            assert n.role == "FOLLOWER"
            assert not any(
                line.startswith("apogee_broker_replica_in_sync")
                for line in scrape(collectors[id(n)])
            )
    finally:
        for n in nodes:
            await n.stop()
