"""LeaseLeadership with the real ``kubernetes`` client against the in-test stand-in for the API
server (apogee.testkit.apiserver; not a real Kubernetes API server), beyond what every
leadership backend promises (test_leadership_contract.py: one holder at a time, handing over on
release and after a holder's death): what the Lease records and how it is renewed, leadership
lost when renewals fail past the renew deadline or someone else holds the Lease, an API server
that forbids or fails, and the settings that choose it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from apogee.common.errors import InvalidArgumentError
from apogee.common.settings import load
from apogee.service.leader_settings import (
    LeaderServiceSettings,
    LeadershipKind,
    new_leadership,
)
from apogee.service.leadership import FileLockLeadership
from apogee.service.lease import LeaseLeadership, lease_leadership
from apogee.testkit.apiserver import FakeApiServer
from apogee.testkit.waiting import eventually

pytestmark = pytest.mark.integration

NS = "apogee"
NAME = "apogee-schedule"
DURATION = 2
DEADLINE = 1.0
RETRY = 0.2


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


def candidate(api: FakeApiServer, identity: str) -> LeaseLeadership:
    return lease_leadership(
        NS, NAME, identity, DURATION, DEADLINE, RETRY, api_client_factory=api.api_client
    )


def spec(api: FakeApiServer) -> dict[str, object]:
    lease = api.get("leases", NS, NAME)
    assert lease is not None
    return dict(lease["spec"])


async def test_a_lease_records_its_holder_and_is_renewed_every_retry_period(
    api: FakeApiServer,
) -> None:
    lead = candidate(api, "pod-a")
    try:
        assert await lead.try_acquire()
        created = spec(api)
        assert created["holderIdentity"] == "pod-a"
        assert created["leaseDurationSeconds"] == DURATION
        assert created["leaseTransitions"] == 0
        renewed = await eventually(
            lambda: spec(api)["renewTime"] != created["renewTime"], 2, "a renewal"
        )
        assert renewed < RETRY * 5
        assert spec(api)["acquireTime"] == created["acquireTime"]
        assert spec(api)["holderIdentity"] == "pod-a"
    finally:
        await lead.release()


async def test_a_release_clears_the_holder_and_ends_the_term(api: FakeApiServer) -> None:
    first, second = candidate(api, "pod-a"), candidate(api, "pod-b")
    try:
        assert await first.try_acquire()
        assert not await second.try_acquire()
        await first.release()
        released = spec(api)
        assert released.get("holderIdentity") in (None, "")  # cleared
        assert released["leaseDurationSeconds"] == 1
        await asyncio.wait_for(first.wait_lost(), 1)  # a released term counts as ended
        assert await second.try_acquire()  # at its next try, not after the lease duration
        assert spec(api)["holderIdentity"] == "pod-b"
        assert spec(api)["leaseTransitions"] == 1
    finally:
        await first.release()
        await second.release()


async def test_renewals_failing_past_the_renew_deadline_end_leadership(
    api: FakeApiServer,
) -> None:
    lead = candidate(api, "pod-a")
    try:
        assert await lead.try_acquire()
        renewed = spec(api)["renewTime"]
        await eventually(lambda: spec(api)["renewTime"] != renewed, 2, "a renewal")
        api.fail_with(503)  # the API server stops answering well
        failing = time.monotonic()
        await asyncio.wait_for(lead.wait_lost(), DEADLINE + 2)
        lost_after = time.monotonic() - failing
        # the deadline counts from the last renewal sent, at most a retry period before
        assert lost_after <= DEADLINE + 0.3, lost_after
        assert not lead.held
        # before any standby could see the Lease expire
        assert lost_after < DURATION
        api.fail_with(None)
        assert await lead.try_acquire()  # still named in the Lease: it takes it back
    finally:
        api.fail_with(None)
        await lead.release()


async def test_another_holder_in_the_lease_ends_leadership(api: FakeApiServer) -> None:
    lead = candidate(api, "pod-a")
    try:
        assert await lead.try_acquire()
        lease = api.get("leases", NS, NAME)
        assert lease is not None
        lease["spec"]["holderIdentity"] = "pod-z"  # written by someone else
        api.put("leases", NS, lease)
        await asyncio.wait_for(lead.wait_lost(), RETRY + 2)
        assert not lead.held
        assert spec(api)["holderIdentity"] == "pod-z"
        assert not await lead.try_acquire()  # pod-z renews nothing, but it is not expired yet
        await lead.release()
        assert spec(api)["holderIdentity"] == "pod-z"  # a release of a lost term writes nothing
    finally:
        await lead.release()


async def test_a_forbidden_lease_fails_and_an_unreachable_one_waits(api: FakeApiServer) -> None:
    lead = candidate(api, "pod-a")
    try:
        api.fail_with(403)
        with pytest.raises(PermissionError, match=r"coordination\.k8s\.io leases"):
            await lead.try_acquire()
        api.fail_with(503)
        assert not await lead.try_acquire()
        api.fail_with(None)
        assert await lead.try_acquire()
    finally:
        api.fail_with(None)
        await lead.release()


# -- settings ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DemoSettings(LeaderServiceSettings):
    namesrv: str = "127.0.0.1:9876"
    listen: str = "127.0.0.1:0"
    metrics_listen: str = ""
    leadership: LeadershipKind = LeadershipKind.FILE
    lock_file: Path = Path("demo.lock")
    lock_poll_s: float = 0.05
    lease_namespace: str = ""
    lease_name: str = "apogee-demo"
    lease_identity: str = ""
    lease_duration_s: int = 15
    lease_renew_deadline_s: float = 10.0
    lease_retry_period_s: float = 2.0
    rpc_timeout_s: float = 1.0
    shutdown_grace_s: float = 1.0
    log_level: str = "INFO"


def test_the_settings_choose_the_lock_or_the_lease(tmp_path: Path) -> None:
    assert isinstance(new_leadership(DemoSettings(lock_file=tmp_path / "x")), FileLockLeadership)
    lock = load(DemoSettings, "demo", None, {"APOGEE_DEMO_LEADERSHIP": "lock"})
    assert lock.leadership is LeadershipKind.FILE
    env = {
        "APOGEE_DEMO_LEADERSHIP": "LEASE",
        "APOGEE_DEMO_LEASE_NAMESPACE": "apogee",
        "APOGEE_DEMO_LEASE_IDENTITY": "pod-7",
        "APOGEE_DEMO_LEASE_DURATION_S": "4",
        "APOGEE_DEMO_LEASE_RENEW_DEADLINE_S": "3",
        "APOGEE_DEMO_LEASE_RETRY_PERIOD_S": "0.5",
    }
    settings = load(DemoSettings, "demo", None, env)
    lead = new_leadership(settings)
    assert isinstance(lead, LeaseLeadership)
    assert (lead.store.namespace, lead.store.name, lead.identity) == (
        "apogee",
        "apogee-demo",
        "pod-7",
    )
    assert (lead.lease_duration_s, lead.renew_deadline_s, lead.poll_s) == (4, 3.0, 0.5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"leadership": "raft"}, "APOGEE_DEMO_LEADERSHIP: 'raft' is not one of: file, lease"),
        ({"lease_duration_s": "0"}, "lease_duration_s: must be between 1 and 3600, got 0"),
        (
            {"lease_renew_deadline_s": "20"},
            "lease_renew_deadline_s: must lie between lease_retry_period_s and "
            "lease_duration_s, got 2 < 20 < 15",
        ),
        (
            {"lease_retry_period_s": "10"},
            "lease_renew_deadline_s: must lie between lease_retry_period_s and "
            "lease_duration_s, got 10 < 10 < 15",
        ),
        ({"lease_name": "Apogee_Lease"}, "lease_name: 'Apogee_Lease' is not a Kubernetes name"),
        ({"lease_namespace": "a.b"}, "lease_namespace: 'a.b' is not a namespace"),
    ],
)
def test_bad_lease_settings_are_refused_naming_the_setting(
    overrides: dict[str, str], message: str
) -> None:
    env = {f"APOGEE_DEMO_{k.upper()}": v for k, v in overrides.items()}
    with pytest.raises(InvalidArgumentError) as err:
        load(DemoSettings, "demo", None, env)
    assert message in str(err.value)
