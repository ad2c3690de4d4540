"""LeaseLeadership with the real ``kubernetes`` client against the in-test stand-in for the API
server (apogee.common.fake_apiserver; not a real Kubernetes API server): one holder at a time,
renewals, release on shutdown handing over at once, a holder killed with ``kill -9`` taken
over within the lease duration, leadership lost when renewals fail past the renew deadline or
someone else holds the Lease, and the settings that choose it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from apogee.common.errors import InvalidArgumentError
from apogee.common.fake_apiserver import FakeApiServer
from apogee.common.leader_settings import (
    LeaderServiceSettings,
    LeadershipKind,
    new_leadership,
)
from apogee.common.leadership import FileLockLeadership
from apogee.common.lease import LeaseLeadership, lease_leadership
from apogee.common.settings import load

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


async def poll(check: object, timeout: float, what: str) -> float:
    """Seconds until ``check()`` is true (polled every 20 ms); fails after ``timeout``."""
    assert callable(check)
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def test_one_candidate_leads_and_renews_while_the_other_waits(api: FakeApiServer) -> None:
    first, second = candidate(api, "pod-a"), candidate(api, "pod-b")
    try:
        assert await first.try_acquire()
        assert await first.try_acquire()  # already held
        assert not await second.try_acquire()
        assert second.holder() == f"the holder of Lease {NS}/{NAME} (pod-a)"
        created = spec(api)
        assert created["holderIdentity"] == "pod-a"
        assert created["leaseDurationSeconds"] == DURATION
        assert created["leaseTransitions"] == 0

        renewed = await poll(lambda: spec(api)["renewTime"] != created["renewTime"], 2, "a renewal")
        assert renewed < RETRY * 5
        assert spec(api)["acquireTime"] == created["acquireTime"]
        # the standby keeps trying but never takes a Lease that is being renewed
        standby = asyncio.create_task(second.acquire())
        await poll(lambda: spec(api)["renewTime"] != created["renewTime"], 2, "renewals")
        await asyncio.sleep(DURATION + RETRY)  # a whole lease duration of renewals
        assert not standby.done()
        assert first.held
        assert spec(api)["holderIdentity"] == "pod-a"
        standby.cancel()
    finally:
        await first.release()
        await second.release()


async def test_release_on_shutdown_hands_over_at_once(api: FakeApiServer) -> None:
    first, second = candidate(api, "pod-a"), candidate(api, "pod-b")
    try:
        assert await first.try_acquire()
        assert not await second.try_acquire()
        waiting = asyncio.create_task(second.acquire())
        start = time.monotonic()
        await first.release()
        released = spec(api)
        assert released.get("holderIdentity") in (None, "")  # cleared
        assert released["leaseDurationSeconds"] == 1
        await asyncio.wait_for(waiting, 5)
        took = time.monotonic() - start
        assert took < DURATION / 2, took  # at its next try, not after the lease duration
        assert second.held
        assert not first.held
        assert spec(api)["holderIdentity"] == "pod-b"
        assert spec(api)["leaseTransitions"] == 1
        await first.wait_lost()  # a released term counts as ended
    finally:
        await first.release()
        await second.release()


HOLDER = """
import asyncio, sys
from apogee.common.lease import lease_leadership

async def main() -> None:
    lead = lease_leadership({ns!r}, {name!r}, "pod-killed", {duration}, {deadline}, {retry})
    await lead.acquire()
    print("leading", flush=True)
    await asyncio.to_thread(sys.stdin.read)

asyncio.run(main())
"""


async def test_a_holder_killed_with_kill_9_is_taken_over_within_the_lease_duration(
    api: FakeApiServer, tmp_path: Path
) -> None:
    env = {**os.environ, "KUBECONFIG": str(api.kubeconfig(tmp_path / "kubeconfig"))}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    code = HOLDER.format(ns=NS, name=NAME, duration=DURATION, deadline=DEADLINE, retry=RETRY)
    holder = subprocess.Popen(  # noqa: ASYNC220 - a helper process that holds the Lease
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    standby = candidate(api, "pod-b")
    with holder:
        try:
            assert holder.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 20)
            assert line == b"leading\n"  # b"" if it died
            assert not await standby.try_acquire()
            assert "pod-killed" in standby.holder()
            waiting = asyncio.create_task(standby.acquire())
            holder.kill()  # kill -9: nothing is released
            holder.wait(5)
            killed = time.monotonic()
            assert spec(api)["holderIdentity"] == "pod-killed"
            await asyncio.wait_for(waiting, DURATION + 3)
            took = time.monotonic() - killed
            # not before the Lease ran out (its last renewal was at most a retry period before
            # the kill), and soon after
            assert DURATION - RETRY - 0.1 <= took <= DURATION + 2 * RETRY + 1.0, took
            assert spec(api)["holderIdentity"] == "pod-b"
            assert spec(api)["leaseTransitions"] == 1
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait(5)
            await standby.release()


async def test_renewals_failing_past_the_renew_deadline_end_leadership(
    api: FakeApiServer,
) -> None:
    lead = candidate(api, "pod-a")
    try:
        assert await lead.try_acquire()
        renewed = spec(api)["renewTime"]
        await poll(lambda: spec(api)["renewTime"] != renewed, 2, "a renewal")
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


async def test_of_two_candidates_at_once_one_wins(api: FakeApiServer) -> None:
    candidates = [candidate(api, f"pod-{i}") for i in range(4)]
    try:
        won = await asyncio.gather(*(c.try_acquire() for c in candidates))
        assert sum(won) == 1
        assert spec(api)["holderIdentity"] == f"pod-{won.index(True)}"
    finally:
        for c in candidates:
            await c.release()


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
