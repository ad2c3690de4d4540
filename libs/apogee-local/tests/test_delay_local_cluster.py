"""The local cluster's schedule service: started by ``apogee cluster up`` once the brokers are
registered (and again when it died), recorded with the other members (a ``cluster.json``
written before it existed still reads), delivering a delayed ``apogee send``, stopped first by
``apogee cluster down`` (with the txn-checker: test_txn_checker_local_cluster.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from apogee.cli.main import main
from apogee.local import cluster as local_cluster
from apogee.local.cluster import ClusterState, Process
from apogee.testkit.waiting import wait_until

pytestmark = pytest.mark.integration


def member(role: str, name: str, port: int) -> Process:
    return Process(role, name, f"127.0.0.1:{port}", 0, "", "")


def test_the_schedule_service_is_a_member_of_the_recorded_cluster(tmp_path: Path) -> None:
    state = ClusterState(
        str(tmp_path),
        nameservers=[member("nameserver", "nameserver-0", 9876)],
        brokers=[member("broker", "broker-a", 10911)],
        schedule=[member("schedule", "schedule", 9700)],
    )
    state.save()
    loaded = ClusterState.load(tmp_path)
    assert loaded is not None
    assert loaded == state
    assert [p.name for p in loaded.all()] == ["nameserver-0", "broker-a", "schedule"]
    # a cluster.json from before the schedule service: read as a cluster without one
    raw = json.loads((tmp_path / local_cluster.STATE_FILE).read_text())
    del raw["schedule"]
    (tmp_path / local_cluster.STATE_FILE).write_text(json.dumps(raw))
    old = ClusterState.load(tmp_path)
    assert old is not None
    assert old.schedule == []
    assert [p.name for p in old.all()] == ["nameserver-0", "broker-a"]


#: The schedule service of the test: quick to notice new entries and new brokers.
SCHEDULE_ENV = {
    "APOGEE_SCHEDULE_SCAN_HOLD_MS": "200",
    "APOGEE_SCHEDULE_BROKER_REFRESH_S": "1",
    "APOGEE_SCHEDULE_SHUTDOWN_GRACE_S": "2",
}


def up(data: Path) -> ClusterState:
    return local_cluster.up(data, schedule_env=SCHEDULE_ENV, timeout=60, console=False)


@pytest.mark.slow
def test_cluster_up_runs_the_schedule_service(
    data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = up(data)
    assert [p.role for p in state.all()] == ["nameserver", "broker", "schedule", "txn-checker"]
    [sched] = state.schedule
    assert sched.argv == [
        "-m",
        "apogee_schedule",
        "--namesrv",
        state.namesrv,
        "--listen",
        sched.address,
        "--lock-file",
        str(data / "schedule" / "schedule.lock"),
    ]
    assert sched.log == str(data / "logs" / "schedule.log")
    assert [(alive, ok) for _, alive, ok in local_cluster.status(state)] == [(True, True)] * 4
    pids = [p.pid for p in state.all()]
    assert [p.pid for p in up(data).all()] == pids  # a second `up` starts nothing

    # a delayed send through the command line arrives, delivered by the schedule process
    assert main(["--data", str(data), "send", "Demo", "--deliver-in", "1", "later"]) == 0
    [sent] = capsys.readouterr().out.split()
    consume = ["--data", str(data), "consume", "Demo", "--group", "g", "--from", "earliest"]
    assert main([*consume, "--count", "1", "--timeout", "20"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith(sent + "\t")
    assert line.endswith("\tlater")

    # the schedule service died: `up` starts it again, and only it
    os.kill(sched.pid, signal.SIGKILL)
    wait_until(lambda: not local_cluster.pid_alive(sched.pid), 10, "the schedule service gone")
    again = up(data)
    assert [p.pid for p in again.all()][:2] == pids[:2]
    assert again.schedule[0].pid != sched.pid
    assert ClusterState.load(data) == again
    assert [(alive, ok) for _, alive, ok in local_cluster.status(again)] == [(True, True)] * 4

    stopped = local_cluster.down(data)
    assert [(p.name, how) for p, how in stopped] == [
        ("schedule", "stopped"),
        ("txn-checker", "stopped"),
        ("broker-a", "stopped"),
        ("nameserver-0", "stopped"),
    ]
