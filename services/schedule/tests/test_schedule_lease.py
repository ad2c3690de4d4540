"""``python -m apogee_schedule`` replicas as real processes choosing their active one by a
Kubernetes Lease (``APOGEE_SCHEDULE_LEADERSHIP=lease``), through the real ``kubernetes`` client
and a kubeconfig that points at the in-test stand-in for the API server
(apogee.testkit.apiserver; not a real Kubernetes API server): SIGTERM of the active one
releases the Lease and a standby takes over at once; ``kill -9`` of the active one releases
nothing and a standby takes over once the Lease has run out."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apogee.testkit.apiserver import FakeApiServer
from apogee.testkit.processes import LeaderProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NS = "apogee"
LEASE = "apogee-schedule"
DURATION = 3


@pytest.fixture
def api(tmp_path: Path) -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


def holder(api: FakeApiServer) -> str | None:
    lease = api.get("leases", NS, LEASE)
    return None if lease is None else lease["spec"].get("holderIdentity")


async def test_replicas_hand_the_lease_over_on_sigterm_at_once_and_after_kill_9_in_time(
    cluster: Any, api: FakeApiServer, tmp_path: Path
) -> None:
    env = {
        "KUBECONFIG": str(api.kubeconfig(tmp_path / "kubeconfig")),
        "KUBERNETES_SERVICE_HOST": "",  # not in a pod: the kubeconfig is used
        "APOGEE_SCHEDULE_LEADERSHIP": "lease",
        "APOGEE_SCHEDULE_LEASE_NAMESPACE": NS,
        "APOGEE_SCHEDULE_LEASE_DURATION_S": str(DURATION),
        "APOGEE_SCHEDULE_LEASE_RENEW_DEADLINE_S": "2",
        "APOGEE_SCHEDULE_LEASE_RETRY_PERIOD_S": "0.3",
        "APOGEE_SCHEDULE_SHUTDOWN_GRACE_S": "1",
    }
    started: list[LeaderProcess] = []

    def start(name: str) -> LeaderProcess:
        replica = LeaderProcess(
            "apogee_schedule",
            cluster.namesrv,
            tmp_path / "unused.lock",
            tmp_path / f"{name}.log",
            {**env, "POD_NAME": name},
        )
        started.append(replica)
        return replica

    try:
        first = start("first")
        await first.wait_serving("the first replica")
        assert holder(api) == "first"
        second = start("second")
        await second.wait_standby("the second replica")
        assert f"Lease {NS}/{LEASE} (first)" in second.output()

        stopping = time.monotonic()
        assert await first.terminate() == 0  # releases the Lease
        await second.wait_serving("the second replica, after the first stopped,")
        took = time.monotonic() - stopping
        assert took < DURATION, took  # released: not waited out
        assert holder(api) == "second"
        assert "released Lease apogee/apogee-schedule" in first.output()

        third = start("third")
        await third.wait_standby("the third replica")
        second.proc.kill()  # kill -9: the Lease stays, naming the dead replica
        second.proc.wait(5)
        killed = time.monotonic()
        assert holder(api) == "second"
        await third.wait_serving("the third replica, after the second was killed,")
        took = time.monotonic() - killed
        assert took <= DURATION + 3, took
        assert holder(api) == "third"

        assert await third.terminate() == 0
        assert holder(api) is None  # cleared on the way out
        assert not (tmp_path / "unused.lock").exists()
    finally:
        for replica in started:
            replica.kill()
