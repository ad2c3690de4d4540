"""The local cluster's transaction checker: a member of the recorded cluster (a ``cluster.json``
written before it existed still reads), started by ``apogee cluster up`` once the brokers are
registered (and added to a running cluster that lacks it, or again when it died, alone), its
lock file under ``<data>/txn-checker/`` and its log under ``<data>/logs/``, stopped with the
schedule service before the brokers."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from apogee.local import cluster as local_cluster
from apogee.local.cluster import ClusterState, Process
from apogee.testkit.waiting import wait_until

pytestmark = pytest.mark.integration

#: A stand-in member: says it is ready, then on SIGTERM appends its name to a file and exits.
MEMBER = """
import pathlib, signal, sys, time
name, out, ready = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
def stop(*_):
    with out.open("a") as f:
        f.write(name + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
ready.write_text("ready")
time.sleep(60)
"""


def member(role: str, port: int) -> Process:
    return Process(role, role, f"127.0.0.1:{port}", 0, "", "")


def test_the_txn_checker_is_a_member_of_the_recorded_cluster(tmp_path: Path) -> None:
    state = ClusterState(
        str(tmp_path),
        nameservers=[member("nameserver-0", 9876)],
        brokers=[member("broker-a", 10911)],
        schedule=[member("schedule", 9700)],
        txn_checker=[member("txn-checker", 9701)],
    )
    state.save()
    loaded = ClusterState.load(tmp_path)
    assert loaded == state
    assert loaded is not None
    assert [p.name for p in loaded.all()] == [
        "nameserver-0",
        "broker-a",
        "schedule",
        "txn-checker",
    ]
    # a cluster.json from before the transaction checker: read as a cluster without one
    raw = json.loads((tmp_path / local_cluster.STATE_FILE).read_text())
    del raw["txn_checker"]
    (tmp_path / local_cluster.STATE_FILE).write_text(json.dumps(raw))
    old = ClusterState.load(tmp_path)
    assert old is not None
    assert old.txn_checker == []
    assert [p.name for p in old.all()] == ["nameserver-0", "broker-a", "schedule"]


def test_down_stops_the_services_then_brokers_then_nameservers(tmp_path: Path) -> None:
    order = tmp_path / "stopped"
    state = ClusterState(str(tmp_path))
    groups = (
        (state.nameservers, "nameserver", ["nameserver-0"]),
        (state.brokers, "broker", ["broker-a", "broker-b"]),
        (state.schedule, "schedule", ["schedule"]),
        (state.txn_checker, "txn-checker", ["txn-checker"]),
    )
    readies = []
    for group, role, names in groups:
        for name in names:
            ready = tmp_path / f"{name}.ready"
            readies.append(ready)
            argv = ["-c", MEMBER, name, str(order), str(ready)]
            proc = local_cluster._spawn(argv, tmp_path / f"{name}.log", {})
            group.append(Process(role, name, "127.0.0.1:1", proc.pid, "", "", argv))
    state.save()
    wait_until(lambda: all(r.exists() for r in readies), 10, "the stand-in members started")
    report = local_cluster.down(tmp_path, timeout=10)
    assert [(p.name, how) for p, how in report] == [
        ("schedule", "stopped"),
        ("txn-checker", "stopped"),
        ("broker-a", "stopped"),
        ("broker-b", "stopped"),
        ("nameserver-0", "stopped"),
    ]
    lines = order.read_text().split()
    assert sorted(lines[:2]) == ["schedule", "txn-checker"]
    assert sorted(lines[2:4]) == ["broker-a", "broker-b"]
    assert lines[4:] == ["nameserver-0"]
    assert not (tmp_path / local_cluster.STATE_FILE).exists()
    assert not any(local_cluster.pid_alive(p.pid) for p in state.all())


@pytest.mark.slow
def test_cluster_up_runs_the_txn_checker(data: Path) -> None:
    # a cluster without the checker (as one started before it existed) ...
    first = local_cluster.up(data, txn_checker=False, timeout=60, console=False)
    assert [p.role for p in first.all()] == ["nameserver", "broker", "schedule"]
    pids = [p.pid for p in first.all()]

    # ... gets one from the next `up`, and nothing else is started again
    state = local_cluster.up(data, timeout=60, console=False)
    assert [p.pid for p in state.all()][:3] == pids
    [checker] = state.txn_checker
    assert (checker.role, checker.name) == ("txn-checker", "txn-checker")
    assert checker.argv == [
        "-m",
        "apogee_txn_checker",
        "--namesrv",
        state.namesrv,
        "--listen",
        checker.address,
        "--lock-file",
        str(data / "txn-checker" / "txn-checker.lock"),
    ]
    assert checker.log == str(data / "logs" / "txn-checker.log")
    assert [(alive, ok) for _, alive, ok in local_cluster.status(state)] == [(True, True)] * 4
    assert ClusterState.load(data) == state

    # the checker died: `up` starts it again, and only it
    os.kill(checker.pid, signal.SIGKILL)
    wait_until(lambda: not local_cluster.pid_alive(checker.pid), 10, "the txn checker gone")
    again = local_cluster.up(data, timeout=60, console=False)
    assert [p.pid for p in again.all()][:3] == pids
    assert again.txn_checker[0].pid != checker.pid
    assert [(alive, ok) for _, alive, ok in local_cluster.status(again)] == [(True, True)] * 4
    log = Path(again.txn_checker[0].log).read_text()
    assert "active: checking the transactions of 1 brokers" in log

    stopped = local_cluster.down(data)
    assert [(p.name, how) for p, how in stopped] == [
        ("schedule", "stopped"),
        ("txn-checker", "stopped"),
        ("broker-a", "stopped"),
        ("nameserver-0", "stopped"),
    ]
    assert "txn-checker stopped: " in Path(again.txn_checker[0].log).read_text()
