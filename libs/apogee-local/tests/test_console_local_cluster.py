"""The local cluster's web console: started by ``apogee cluster up`` once the brokers are
registered (``python -m apogee_console`` on 8080 or the next free port, its metrics on a port of
its own), healthy once ``GET /healthz`` answers, its URL printed by ``up`` and ``status``;
``--no-console`` (``console=False``) leaves it out, and leaves a running one alone; one that died
is started again by the next ``up`` that wants it, forgotten by one that does not; ``down`` stops
it first."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from apogee.cli.main import main
from apogee.local import cluster as local_cluster
from apogee.local import webconsole
from apogee.local.cluster import ClusterState, Process
from apogee.testkit.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            status: int = resp.status
            return status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def _kill(p: Process) -> None:
    os.kill(p.pid, signal.SIGKILL)
    wait_until(lambda: not local_cluster.pid_alive(p.pid), 10, f"{p.name} gone after SIGKILL")


def test_cluster_up_runs_the_console(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--data", str(data), "cluster", "up"]) == 0
    out = capsys.readouterr().out
    state = ClusterState.load(data)
    assert state is not None
    assert [p.role for p in state.all()] == [
        "nameserver",
        "broker",
        "schedule",
        "txn-checker",
        "console",
    ]
    [console] = state.console
    url = f"http://{console.address}/"
    assert f"console: {url}\n" in out
    assert console.argv == [
        "-m",
        "apogee_console",
        "--listen",
        console.address,
        "--namesrv",
        state.namesrv,
    ]
    assert console.log == str(data / "logs" / "console.log")
    # its pages, its readiness (the nameserver answers it) and its own metrics
    status, page = _get(url)
    assert status == 200
    assert b"<html" in page.lower()
    assert _get(f"{url}healthz")[0] == 200
    wait_until(lambda: _get(f"{url}readyz")[0] == 200, 30, "the console ready", every=0.2)
    status, cluster = _get(f"{url}api/v1/cluster")
    assert status == 200
    assert [b["name"] for b in json.loads(cluster)["brokers"]] == ["broker-a"]
    metrics = console.env["APOGEE_CONSOLE_METRICS_LISTEN"]
    assert console.metrics == metrics
    assert _get(f"http://{metrics}/metrics")[0] == 200
    ports = {int(p.address.rpartition(":")[2]) for p in state.all()}
    ports |= {int(p.metrics.rpartition(":")[2]) for p in state.all()}
    assert len(ports) == 2 * len(state.all())

    assert main(["--data", str(data), "cluster", "status"]) == 0
    status_out = capsys.readouterr().out
    assert f"console {url}" in status_out
    assert status_out.count("SERVING") == 5

    # --no-console leaves the running one alone; a second `up` starts nothing
    pids = [p.pid for p in state.all()]
    assert main(["--data", str(data), "cluster", "up", "--no-console"]) == 0
    assert f"console: {url}" in capsys.readouterr().out
    assert [p.pid for p in local_cluster.up(data, timeout=60).all()] == pids

    # dead and not wanted: forgotten; dead and wanted: started again, and only it
    _kill(console)
    state = local_cluster.up(data, console=False, timeout=60)
    assert state.console == []
    assert ClusterState.load(data) == state
    state = local_cluster.up(data, timeout=60)
    assert [p.pid for p in state.all()][:4] == pids[:4]
    assert state.console[0].pid != console.pid
    assert webconsole.healthy(state.console[0].address, state.console[0].env)

    stopped = local_cluster.down(data)
    assert (stopped[0][0].name, stopped[0][1]) == ("console", "stopped")
    assert all(how == "stopped" for _, how in stopped)


def test_no_console_leaves_it_out(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--data", str(data), "cluster", "up", "--no-console"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "console:" not in out
    assert not [line for line in out.splitlines() if line.split()[:1] == ["console"]]
    state = ClusterState.load(data)
    assert state is not None
    assert state.console == []
    # a later `up` that wants it starts it beside the running members
    pids = [p.pid for p in state.all()]
    state = local_cluster.up(data, timeout=60)
    assert [p.pid for p in state.all()][:-1] == pids
    assert [p.role for p in state.all()][-1] == "console"


def test_the_recorded_console_and_an_older_cluster_json(tmp_path: Path) -> None:
    member = Process("console", "console", "127.0.0.1:8080", 0, "log", "", [], {}, "")
    state = ClusterState(str(tmp_path), console=[member])
    state.save()
    assert ClusterState.load(tmp_path) == state
    raw = json.loads((tmp_path / local_cluster.STATE_FILE).read_text())
    del raw["console"]  # written before the console was a member
    (tmp_path / local_cluster.STATE_FILE).write_text(json.dumps(raw))
    old = ClusterState.load(tmp_path)
    assert old is not None
    assert old.console == []
    # its URL says https once it has a certificate
    assert webconsole.url("127.0.0.1:8080", {}) == "http://127.0.0.1:8080/"
    https = {"APOGEE_CONSOLE_TLS_CERT_FILE": "/x.crt"}
    assert webconsole.url("127.0.0.1:8443", https) == "https://127.0.0.1:8443/"
    assert not webconsole.healthy("127.0.0.1:1", {}, timeout=0.5)
