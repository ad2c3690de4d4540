"""EtcdCoordination against a real etcd (apogee.testkit.etcd, one for the module): the record
changes only by compare-and-set, one campaign of several wins, the claim lapses when its leader
stops renewing and goes at once when it resigns, an etcd that does not answer (SIGSTOP) fails
every call within the client's timeout while renew() holds on for lease_s, and a record key
that holds no record is named in the error."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from apogee.common.errors import InvalidArgumentError, UnavailableError
from apogee.service.etcd import EtcdClient
from apogee.service.etcd_group import EtcdCoordination
from apogee.service.replica_group import GroupRecord
from apogee.testkit import etcd as etcd_kit
from apogee.testkit.etcd import EtcdServer
from apogee.testkit.waiting import eventually

pytestmark = pytest.mark.integration

#: one etcd for the module
etcd_server = etcd_kit.etcd_server

Replica = Callable[..., EtcdCoordination]


@pytest.fixture
async def client(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([etcd_server.endpoint], timeout_s=2.0) as c:
        yield c


@pytest.fixture
async def replica(client: EtcdClient) -> AsyncIterator[Replica]:
    """replica(id, lease_s=..., on=client): a replica of this test's own group (a cluster name
    of its own on the module's etcd); each gives up its claim after the test."""
    cluster = f"c{uuid.uuid4().hex[:12]}"
    made: list[EtcdCoordination] = []

    def make(replica_id: str, lease_s: float = 3.0, on: EtcdClient = client) -> EtcdCoordination:
        coordination = EtcdCoordination(on, cluster, "broker-a", replica_id, lease_s=lease_s)
        made.append(coordination)
        return coordination

    yield make
    for coordination in made:
        await coordination.close()


def leading(replica_id: str, epoch: int, in_sync: tuple[str, ...] = ()) -> GroupRecord:
    return GroupRecord(
        epoch=epoch,
        leader=replica_id,
        leader_address=f"{replica_id}.example:1",
        client_address=f"{replica_id}.example:2",
        in_sync=in_sync or (replica_id,),
        members=("r1", "r2", "r3"),
    )


async def test_an_empty_group(replica: Replica) -> None:
    seen = await replica("r1").read()
    assert (seen.record, seen.version, seen.leader_alive) == (GroupRecord(), 0, False)


async def test_update_is_compare_and_set(replica: Replica) -> None:
    r1, r2 = replica("r1"), replica("r2")
    first = await r1.update(leading("r1", 1), 0)
    assert first is not None
    assert await r2.update(leading("r2", 1), 0) is None  # not absent any more

    a, b = leading("r1", 1, ("r1", "r2")), leading("r1", 1, ("r1", "r3"))
    results = await asyncio.gather(r1.update(a, first.version), r2.update(b, first.version))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    seen = await r1.read()
    assert (seen.record, seen.version) == (winners[0].record, winners[0].version)
    assert int(seen.version) > int(first.version)
    assert seen.leader_alive is False  # an update takes no claim
    assert await r1.update(a, first.version) is None  # stale
    assert await r1.update(a, str(seen.version)) is not None  # a version read as text


async def test_one_campaign_of_many_wins(replica: Replica) -> None:
    replicas = [replica(f"r{i}") for i in range(1, 6)]
    at = await replicas[0].read()
    results = await asyncio.gather(
        *(r.campaign(leading(r.replica_id, 1), at.version) for r in replicas)
    )
    winners = [(r, won) for r, won in zip(replicas, results, strict=True) if won is not None]
    assert len(winners) == 1
    winner, won = winners[0]
    seen = await replicas[0].read()
    assert seen.record == won.record == leading(winner.replica_id, 1)
    assert seen.version == won.version
    assert seen.leader_alive
    assert seen.extra["claim_holder"] == winner.replica_id
    assert await winner.renew()
    for loser in replicas:
        if loser is not winner:
            assert await loser.renew() is False  # it holds nothing

    # the record at the current version is not enough while the claim is held
    other = next(r for r in replicas if r is not winner)
    assert await other.campaign(leading(other.replica_id, 2), seen.version) is None


async def test_a_campaign_needs_the_version_read(replica: Replica) -> None:
    r1, r2 = replica("r1"), replica("r2")
    base = await r1.update(leading("r1", 1), 0)
    assert base is not None
    assert await r2.update(leading("r1", 1, ("r1", "r2")), base.version) is not None
    assert await r2.campaign(leading("r2", 2), base.version) is None  # moved since
    seen = await r2.read()
    assert seen.leader_alive is False  # a lost campaign takes no claim
    assert await r2.campaign(leading("r2", 2), seen.version) is not None


async def test_the_claim_lapses_when_the_leader_stops_renewing(replica: Replica) -> None:
    r1, r2 = replica("r1", lease_s=1), replica("r2", lease_s=1)
    started = time.monotonic()
    won = await r1.campaign(leading("r1", 1), 0)
    assert won is not None
    assert await r2.campaign(leading("r2", 2), won.version) is None

    async def claim_gone() -> bool:
        return not (await r2.read()).leader_alive

    await eventually(claim_gone, 10, "r1's claim lapsed", every=0.05)
    assert time.monotonic() - started >= 1.0  # not before its lease
    seen = await r2.read()
    assert seen.record == won.record  # the record stays; only the claim went
    assert await r2.campaign(leading("r2", 2), seen.version) is not None
    assert await r1.renew() is False  # its lease is gone
    assert (await r1.read()).extra["claim_holder"] == "r2"


async def test_renewing_keeps_the_claim_past_its_lease(replica: Replica) -> None:
    r1, r2 = replica("r1", lease_s=1), replica("r2", lease_s=1)
    assert await r1.campaign(leading("r1", 1), 0) is not None
    started = time.monotonic()

    async def renewed_past_two_leases() -> bool:
        assert await r1.renew()
        assert (await r2.read()).leader_alive
        return time.monotonic() - started > 2.0

    await eventually(renewed_past_two_leases, 10, "renewals past two leases", every=0.2)


async def test_resign_frees_the_claim_at_once(replica: Replica) -> None:
    r1, r2 = replica("r1", lease_s=30), replica("r2", lease_s=30)
    won = await r1.campaign(leading("r1", 1), 0)
    assert won is not None
    assert (await r2.read()).leader_alive
    await r1.resign()
    seen = await r2.read()
    assert seen.leader_alive is False
    assert await r2.campaign(leading("r2", 2), seen.version) is not None
    assert await r1.renew() is False
    await r1.resign()  # holds nothing: no error


async def test_an_etcd_that_does_not_answer(
    etcd_server: EtcdServer, client: EtcdClient, replica: Replica
) -> None:
    lease_s, timeout_s = 2.0, 0.3
    async with EtcdClient([etcd_server.endpoint], timeout_s=timeout_s) as quick:
        leader = replica("r1", lease_s=lease_s, on=quick)
        won = await leader.campaign(leading("r1", 1), 0)
        assert won is not None
        before = time.monotonic()
        assert await leader.renew()
        after = time.monotonic()

        outcomes: list[tuple[float, float, bool]] = []
        with etcd_server.paused():
            for call in (
                leader.read(),
                leader.update(leading("r1", 1, ("r1", "r2")), won.version),
                leader.campaign(leading("r1", 2), won.version),
            ):
                started = time.monotonic()
                with pytest.raises(UnavailableError, match=etcd_server.endpoint):
                    await call
                assert time.monotonic() - started < timeout_s + 0.4

            while not outcomes or outcomes[-1][2]:  # each try takes timeout_s
                started = time.monotonic()
                try:
                    held = await leader.renew()
                except UnavailableError:
                    held = False  # lease_s passed: the claim may have lapsed
                outcomes.append((started, time.monotonic(), held))
                assert started - before < 10 * lease_s, "renew() never gave up"
            with pytest.raises(UnavailableError):  # still away: it keeps saying so
                await leader.renew()

        assert len(outcomes) >= 2  # True while etcd was away, then unavailable
        assert all(started - after < lease_s for started, _, held in outcomes if held)
        assert outcomes[-1][1] - before >= lease_s  # not before lease_s had passed
        # etcd is back: renew() tells what etcd holds, the claim kept or gone
        held = await leader.renew()
        assert held == (await leader.read()).leader_alive

        await leader.resign()
        follower = replica("r2", lease_s=lease_s)
        seen = await follower.read()
        assert seen.leader_alive is False
        assert await follower.campaign(leading("r2", 2), seen.version) is not None


async def test_a_record_key_that_holds_no_record(client: EtcdClient, replica: Replica) -> None:
    r1 = replica("r1")
    await client.put(r1.record_key, b"{not json")
    with pytest.raises(InvalidArgumentError) as caught:
        await r1.read()
    assert f"etcd key {r1.record_key}" in str(caught.value)
    assert "JSON" in str(caught.value)

    await client.put(r1.record_key, '{"epoch": "one"}')
    with pytest.raises(InvalidArgumentError, match="epoch: must be a non-negative integer"):
        await r1.read()
    # a record written over it mends the group
    stored = await client.get(r1.record_key)
    assert stored is not None
    assert await r1.update(leading("r1", 1), stored.mod_revision) is not None
    assert (await r1.read()).record == leading("r1", 1)


async def test_bad_arguments(client: EtcdClient, replica: Replica) -> None:
    with pytest.raises(InvalidArgumentError, match="cluster: must be non-empty and without '/'"):
        EtcdCoordination(client, "a/b", "broker-a", "r1")
    with pytest.raises(InvalidArgumentError, match="broker_name"):
        EtcdCoordination(client, "c", "", "r1")
    with pytest.raises(InvalidArgumentError, match="lease_s: must be at least 1"):
        EtcdCoordination(client, "c", "broker-a", "r1", lease_s=0.5)
    with pytest.raises(InvalidArgumentError, match="version: must be the record's etcd"):
        await replica("r1").update(GroupRecord(), "v1")
