"""KubeLeaseCoordination with the real ``kubernetes`` client against the in-test stand-in for the
API server (apogee.testkit.apiserver; not a real Kubernetes API server): what the Lease holds,
the record changed only by compare-and-set (a leader's own renewals aside), one campaign of
several wins, the claim lapses when its leader stops renewing and goes at once when it resigns,
an API server that does not answer (paused) or is gone fails every call within the timeout
while renew() holds on for lease_s, one that refuses, and an annotation that holds no record
named in the error."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from apogee.common.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    UnavailableError,
)
from apogee.service.lease_group import (
    RECORD_ANNOTATION,
    KubeLeaseCoordination,
    group_lease_name,
)
from apogee.service.replica_group import GroupRecord
from apogee.testkit.apiserver import FakeApiServer
from apogee.testkit.waiting import eventually

pytestmark = pytest.mark.integration

NS = "apogee"

Replica = Callable[..., KubeLeaseCoordination]


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def lease_name() -> str:
    return group_lease_name(f"t{uuid.uuid4().hex[:8]}", "broker-a")


@pytest.fixture
async def replica(api: FakeApiServer, lease_name: str) -> AsyncIterator[Replica]:
    """replica(id, lease_s=..., timeout_s=..., on=server): a replica of this test's group;
    each gives up its claim after the test and its client is closed."""
    made: list[tuple[KubeLeaseCoordination, Any]] = []

    def make(
        replica_id: str,
        lease_s: float = 3.0,
        timeout_s: float = 1.0,
        on: FakeApiServer = api,
    ) -> KubeLeaseCoordination:
        client = on.api_client()
        coordination = KubeLeaseCoordination(
            client, NS, lease_name, replica_id, lease_s=lease_s, timeout_s=timeout_s
        )
        made.append((coordination, client))
        return coordination

    yield make
    for coordination, client in made:
        await coordination.close()
        client.close()


def leading(replica_id: str, epoch: int, in_sync: tuple[str, ...] = ()) -> GroupRecord:
    return GroupRecord(
        epoch=epoch,
        leader=replica_id,
        leader_address=f"{replica_id}.example:1",
        client_address=f"{replica_id}.example:2",
        in_sync=in_sync or (replica_id,),
        members=("r1", "r2", "r3"),
    )


def stored(api: FakeApiServer, name: str) -> dict[str, Any]:
    lease = api.get("leases", NS, name)
    assert lease is not None
    return lease


async def test_an_empty_group(replica: Replica) -> None:
    seen = await replica("r1").read()
    assert (seen.record, seen.version, seen.leader_alive) == (GroupRecord(), "", False)


async def test_the_lease_holds_the_record_and_the_claim(
    api: FakeApiServer, lease_name: str, replica: Replica
) -> None:
    r1, r2 = replica("r1", lease_s=2.5), replica("r2", lease_s=2.5)
    won = await r1.campaign(leading("r1", 1), "")
    assert won is not None
    lease = stored(api, lease_name)
    assert lease["apiVersion"] == "coordination.k8s.io/v1"
    assert json.loads(lease["metadata"]["annotations"][RECORD_ANNOTATION]) == json.loads(
        leading("r1", 1).to_json()
    )
    assert lease["spec"]["holderIdentity"] == "r1"
    assert lease["spec"]["leaseDurationSeconds"] == 3  # 2.5 rounded up
    assert won.version == lease["metadata"]["resourceVersion"]
    seen = await r2.read()
    assert (seen.record, seen.version, seen.leader_alive) == (won.record, won.version, True)
    assert seen.extra["claim_holder"] == "r1"

    # a label someone else put on the Lease survives the writes of the group
    lease["metadata"]["labels"] = {"app.kubernetes.io/name": "apogee"}
    api.put("leases", NS, lease)
    renewed_from = stored(api, lease_name)["spec"]["renewTime"]
    assert await r1.renew()
    after = stored(api, lease_name)
    assert after["spec"]["renewTime"] != renewed_from
    assert after["metadata"]["labels"] == {"app.kubernetes.io/name": "apogee"}
    assert (await r2.read()).record == leading("r1", 1)  # a renewal leaves the record


async def test_update_is_compare_and_set(replica: Replica) -> None:
    r1, r2 = replica("r1"), replica("r2")
    first = await r1.update(leading("r1", 1), "")
    assert first is not None
    assert await r2.update(leading("r2", 1), 0) is None  # there is a Lease now

    at = await r2.read()
    assert at.version == first.version
    a, b = leading("r1", 1, ("r1", "r2")), leading("r1", 1, ("r1", "r3"))
    results = await asyncio.gather(r1.update(a, at.version), r2.update(b, at.version))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    seen = await r1.read()
    assert (seen.record, seen.version) == (winners[0].record, winners[0].version)
    assert seen.version != first.version
    assert seen.leader_alive is False  # an update takes no claim
    assert await r1.update(a if winners[0].record == b else b, first.version) is None  # stale
    assert await r2.update(leading("r1", 2), seen.version) is not None


async def test_a_leaders_renewals_do_not_move_its_record(
    api: FakeApiServer, lease_name: str, replica: Replica
) -> None:
    r1, r2 = replica("r1"), replica("r2")
    won = await r1.campaign(leading("r1", 1), "")
    assert won is not None
    assert await r2.read()  # r2 saw the Lease at won.version
    assert await r1.renew()
    assert await r1.renew()
    assert stored(api, lease_name)["metadata"]["resourceVersion"] != won.version
    # the record is still the one written at won.version: the leader's update goes through
    grown = await r1.update(leading("r1", 1, ("r1", "r2")), won.version)
    assert grown is not None
    assert grown.leader_alive
    assert (await r2.read()).record == leading("r1", 1, ("r1", "r2"))
    # a write of the record does move it: an update at the older version loses
    assert await r2.update(leading("r1", 1, ("r1", "r3")), won.version) is None

    # the record written by someone else (this leader elsewhere, say): renew() reads the Lease
    # again after the conflict, finds itself still the holder and renews at the new version
    lease = stored(api, lease_name)
    lease["metadata"]["annotations"][RECORD_ANNOTATION] = leading("r1", 1, ("r1",)).to_json()
    api.put("leases", NS, lease)
    before = stored(api, lease_name)["spec"]["renewTime"]
    assert await r1.renew()
    after = stored(api, lease_name)
    assert after["spec"]["renewTime"] != before
    assert after["spec"]["holderIdentity"] == "r1"
    assert (await r2.read()).record == leading("r1", 1, ("r1",))


async def test_one_campaign_of_many_wins(replica: Replica) -> None:
    replicas = [replica(f"r{i}") for i in range(1, 6)]

    async def race(epoch: int, version: int | str) -> KubeLeaseCoordination:
        results = await asyncio.gather(
            *(r.campaign(leading(r.replica_id, epoch), version) for r in replicas)
        )
        winners = [(r, w) for r, w in zip(replicas, results, strict=True) if w is not None]
        assert len(winners) == 1, winners
        winner, won = winners[0]
        seen = await replicas[0].read()
        assert seen.record == won.record == leading(winner.replica_id, epoch)
        assert seen.version == won.version
        assert seen.leader_alive
        assert seen.extra["claim_holder"] == winner.replica_id
        assert await winner.renew()
        for loser in replicas:
            if loser is not winner:
                assert await loser.renew() is False  # it holds nothing
        return winner

    first = await race(1, "")  # no Lease yet: one create wins
    # the record at the current version is not enough while the claim is held
    other = next(r for r in replicas if r is not first)
    now = await other.read()
    assert await other.campaign(leading(other.replica_id, 2), now.version) is None

    await first.resign()  # the claim is free: every replica campaigns at the version read
    at = [await r.read() for r in replicas]
    assert {v.version for v in at} == {at[0].version}
    assert not at[0].leader_alive
    await race(2, at[0].version)


async def test_a_campaign_needs_the_version_read(replica: Replica) -> None:
    r1, r2 = replica("r1"), replica("r2")
    base = await r1.update(leading("r1", 1), "")
    assert base is not None
    assert await r2.update(leading("r1", 1, ("r1", "r2")), base.version) is not None
    assert await r2.campaign(leading("r2", 2), base.version) is None  # moved since
    seen = await r2.read()
    assert seen.leader_alive is False  # a lost campaign takes no claim
    assert await r2.campaign(leading("r2", 2), seen.version) is not None


async def test_the_claim_lapses_when_the_leader_stops_renewing(
    api: FakeApiServer, lease_name: str, replica: Replica
) -> None:
    r1, r2 = replica("r1", lease_s=1, timeout_s=0.5), replica("r2", lease_s=1, timeout_s=0.5)
    started = time.monotonic()
    won = await r1.campaign(leading("r1", 1), "")
    assert won is not None
    assert (await r2.read()).leader_alive
    assert await r2.campaign(leading("r2", 2), won.version) is None

    async def claim_gone() -> bool:
        return not (await r2.read()).leader_alive

    await eventually(claim_gone, 10, "r1's claim lapsed", every=0.05)
    assert time.monotonic() - started >= 1.0  # not before its lease
    seen = await r2.read()
    assert seen.record == won.record  # the record stays; only the claim went
    assert await r2.campaign(leading("r2", 2), seen.version) is not None
    assert await r1.renew() is False  # someone else holds it now
    seen = await r1.read()
    assert (seen.extra["claim_holder"], seen.record.epoch) == ("r2", 2)
    assert stored(api, lease_name)["spec"]["leaseTransitions"] == 1


async def test_renewing_keeps_the_claim_past_its_lease(replica: Replica) -> None:
    r1, r2 = replica("r1", lease_s=1, timeout_s=0.5), replica("r2", lease_s=1, timeout_s=0.5)
    assert await r1.campaign(leading("r1", 1), "") is not None
    started = time.monotonic()

    async def renewed_past_two_leases() -> bool:
        assert await r1.renew()
        assert (await r2.read()).leader_alive
        return time.monotonic() - started > 2.0

    await eventually(renewed_past_two_leases, 10, "renewals past two leases", every=0.2)


async def test_resign_frees_the_claim_at_once(
    api: FakeApiServer, lease_name: str, replica: Replica
) -> None:
    r1, r2 = replica("r1", lease_s=30), replica("r2", lease_s=30)
    won = await r1.campaign(leading("r1", 1), "")
    assert won is not None
    assert (await r2.read()).leader_alive
    await r1.resign()
    spec = stored(api, lease_name)["spec"]
    assert spec.get("holderIdentity") in (None, "")
    assert spec["leaseDurationSeconds"] == 1
    seen = await r2.read()
    assert seen.leader_alive is False
    assert seen.record == won.record
    assert await r2.campaign(leading("r2", 2), seen.version) is not None
    assert await r1.renew() is False
    await r1.resign()  # holds nothing: no error
    assert stored(api, lease_name)["spec"]["holderIdentity"] == "r2"


async def test_an_api_server_that_does_not_answer(
    api: FakeApiServer, lease_name: str, replica: Replica
) -> None:
    lease_s, timeout_s = 2.0, 0.3
    leader = replica("r1", lease_s=lease_s, timeout_s=timeout_s)
    follower = replica("r2", lease_s=lease_s, timeout_s=timeout_s)
    won = await leader.campaign(leading("r1", 1), "")
    assert won is not None
    before = time.monotonic()
    assert await leader.renew()
    after = time.monotonic()

    outcomes: list[tuple[float, float, bool]] = []
    with api.paused():
        for call in (
            leader.read(),
            leader.update(leading("r1", 1, ("r1", "r2")), won.version),
            follower.campaign(leading("r2", 2), won.version),
        ):
            started = time.monotonic()
            with pytest.raises(UnavailableError, match=f"Lease {NS}/{lease_name}"):
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

    assert len(outcomes) >= 2  # True while the API server was away, then unavailable
    assert all(started - after < lease_s for started, _, held in outcomes if held)
    assert outcomes[-1][1] - before >= lease_s  # not before lease_s had passed
    # it answers again: renew() tells what the Lease says, the claim kept or gone
    held = await leader.renew()
    assert held == ((await follower.read()).extra.get("claim_holder") == "r1")

    await leader.resign()
    seen = await follower.read()
    assert seen.leader_alive is False
    assert await follower.campaign(leading("r2", 2), seen.version) is not None


async def test_an_api_server_that_is_gone(replica: Replica) -> None:
    lease_s, timeout_s = 1.0, 0.5
    gone = FakeApiServer().start()
    leader = replica("r1", lease_s=lease_s, timeout_s=timeout_s, on=gone)
    assert await leader.campaign(leading("r1", 1), "") is not None
    renewed = time.monotonic()
    assert await leader.renew()
    gone.stop()  # its port is closed now
    outcomes: list[tuple[float, bool]] = []

    async def unavailable() -> bool:
        try:
            outcomes.append((time.monotonic(), await leader.renew()))
        except UnavailableError:
            return True
        return False

    await eventually(unavailable, 10 * lease_s, "renew() gave up", every=0.05)
    assert outcomes
    assert all(held for _, held in outcomes)
    assert all(at - renewed < lease_s + timeout_s for at, _ in outcomes)
    assert time.monotonic() - renewed >= lease_s

    for call in (leader.read(), leader.update(leading("r1", 2), ""), leader.renew()):
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="the Kubernetes API server is unavailable"):
            await call
        assert time.monotonic() - started < timeout_s + 0.4
    await leader.resign()  # no error: the claim lapses instead


async def test_an_api_server_that_refuses(api: FakeApiServer, replica: Replica) -> None:
    r1 = replica("r1")
    api.fail_with(403)
    with pytest.raises(PermissionDeniedError, match=r"get, create and update on coordination"):
        await r1.read()
    api.fail_with(503)
    with pytest.raises(UnavailableError, match="503"):
        await r1.campaign(leading("r1", 1), "")
    api.fail_with(None)
    assert await r1.campaign(leading("r1", 1), "") is not None


async def test_an_annotation_that_holds_no_record(
    api: FakeApiServer, lease_name: str, replica: Replica
) -> None:
    r1 = replica("r1")
    api.put(
        "leases",
        NS,
        {
            "metadata": {"name": lease_name, "annotations": {RECORD_ANNOTATION: "{not json"}},
            "spec": {},
        },
    )
    with pytest.raises(InvalidArgumentError) as caught:
        await r1.read()
    assert f"annotation {RECORD_ANNOTATION} of Lease {NS}/{lease_name}" in str(caught.value)
    assert "JSON" in str(caught.value)

    lease = stored(api, lease_name)
    lease["metadata"]["annotations"][RECORD_ANNOTATION] = '{"epoch": "one"}'
    api.put("leases", NS, lease)
    with pytest.raises(InvalidArgumentError, match="epoch: must be a non-negative integer"):
        await r1.read()
    # a record written over it mends the group
    version = stored(api, lease_name)["metadata"]["resourceVersion"]
    assert await r1.update(leading("r1", 1), version) is not None
    assert (await r1.read()).record == leading("r1", 1)


async def test_a_lease_without_the_annotation_is_an_empty_group(
    api: FakeApiServer, lease_name: str, replica: Replica
) -> None:
    api.put("leases", NS, {"metadata": {"name": lease_name}, "spec": {}})
    r1 = replica("r1")
    seen = await r1.read()
    assert (seen.record, seen.leader_alive) == (GroupRecord(), False)
    assert seen.version == stored(api, lease_name)["metadata"]["resourceVersion"]
    assert await r1.campaign(leading("r1", 1), seen.version) is not None


async def test_bad_arguments(api: FakeApiServer, replica: Replica) -> None:
    client = api.api_client()
    try:
        with pytest.raises(InvalidArgumentError, match=r"namespace: 'a\.b' is not a namespace"):
            KubeLeaseCoordination(client, "a.b", "apogee-broker-a", "r1")
        with pytest.raises(InvalidArgumentError, match="lease_name: 'Broker_A' is not a"):
            KubeLeaseCoordination(client, NS, "Broker_A", "r1")
        with pytest.raises(InvalidArgumentError, match="replica_id: must be non-empty"):
            KubeLeaseCoordination(client, NS, "apogee-broker-a", "")
        with pytest.raises(InvalidArgumentError, match="lease_s: must be at least 1"):
            KubeLeaseCoordination(client, NS, "apogee-broker-a", "r1", lease_s=0.5)
        with pytest.raises(InvalidArgumentError, match=r"timeout_s: must be above 0 and below"):
            KubeLeaseCoordination(client, NS, "apogee-broker-a", "r1", lease_s=2, timeout_s=2)
    finally:
        client.close()
    with pytest.raises(InvalidArgumentError, match="version: must be the Lease's resourceVersion"):
        await replica("r1").update(GroupRecord(), 7)
    assert group_lease_name("apogee", "broker-a") == "apogee-broker-a"
    with pytest.raises(InvalidArgumentError, match="broker_name: 'apogee-Broker_A'"):
        group_lease_name("apogee", "Broker_A")
    with pytest.raises(InvalidArgumentError, match="prefix: must be non-empty"):
        group_lease_name("", "broker-a")
