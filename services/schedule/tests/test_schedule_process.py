"""``python -m apogee_schedule`` as real processes: an active one and a standby on one lock
file; ``kill -9`` of the active one hands over to the standby and loses nothing; SIGTERM stops
cleanly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from apogee.testkit.processes import LeaderReplicas, run_module, taken_address
from apogee.v1 import common_pb2
from apogee_schedule.__main__ import main
from apogee_schedule.app import PROCESS_HEALTH

pytestmark = [pytest.mark.integration, pytest.mark.slow]

Make = Callable[..., common_pb2.Message]


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[LeaderReplicas]:
    env = {
        "APOGEE_SCHEDULE_LOCK_POLL_S": "0.1",
        "APOGEE_SCHEDULE_SCAN_HOLD_MS": "200",
        "APOGEE_SCHEDULE_PROGRESS_INTERVAL_S": "0.2",
    }
    started = LeaderReplicas("apogee_schedule", tmp_path, "schedule.lock", env)
    yield started
    started.kill()


async def test_kill_9_of_the_active_replica_hands_over_and_loses_nothing(
    cluster: Any, make_timer: Make, replicas: LeaderReplicas
) -> None:
    first, second = await replicas.active_and_standby(cluster.namesrv, PROCESS_HEALTH)

    t0 = cluster.now_ms()
    msgs = [make_timer(f"t{i}", t0 + 300 + 100 * i, queue_id=i % 2) for i in range(30)]
    await cluster.send(*msgs)
    await cluster.wait_delivered(5, timeout=10)
    first.proc.kill()  # kill -9: its lock goes with it

    await second.wait_serving("the second replica, after the first died,")
    got = await cluster.wait_delivered(len(msgs), timeout=15)
    due = {m.body.decode(): m.deliver_at_ms for m in msgs}
    assert {m.body.decode() for m in got} == set(due)  # duplicates allowed after a crash
    assert [m.body for m in got if m.store_timestamp < due[m.body.decode()]] == []

    assert await second.terminate() == 0
    lines = second.output().splitlines()
    assert all(line[:4].isdigit() and line[10] == "T" for line in lines), lines
    assert any(" INFO apogee.service.leadership active: holding the lock " in x for x in lines)
    assert " INFO apogee_schedule.app schedule service stopped: delivered " in lines[-1]


def test_bad_settings_exit_with_2_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--namesrv", "nowhere"]) == 2
    assert capsys.readouterr().err == (
        "apogee-schedule: namesrv: 'nowhere' is not host:port (port 1 to 65535)\n"
    )


def test_a_taken_port_exits_with_1_and_says_why(tmp_path: Path) -> None:
    with taken_address() as address:
        lock = str(tmp_path / "l.lock")
        done = run_module("apogee_schedule", "--listen", address, "--lock-file", lock)
    assert done.returncode == 1
    assert f"schedule service could not start: schedule cannot listen on {address}" in (
        done.stdout.decode()
    )
