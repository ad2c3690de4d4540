"""``apogee cluster up`` run again: the members that are not running come back on the ports they
had and the running ones are left alone; after ``apogee cluster down`` the cluster comes back on
its ports; a recorded port another process holds fails the start, naming the port and the
holder."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from apogee.cli.main import main
from apogee.local import cluster as local_cluster
from apogee.local.cluster import ClusterState
from apogee.testkit.waiting import wait_until

pytestmark = pytest.mark.integration

#: a restarted nameserver hears from the running brokers within a second, not at their next
#: heartbeat (30 s by default)
BROKER_ENV = {"APOGEE_BROKER_HEARTBEAT_INTERVAL_S": "1"}
TIME_WAIT = "06"


def _ports(state: ClusterState) -> dict[str, tuple[str, str]]:
    return {p.name: (p.address, p.metrics) for p in state.all()}


def _states(port: int) -> list[str]:
    """The TCP states of the sockets on local ``port`` (IPv4)."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return [f[3] for f in map(str.split, lines) if int(f[1].rpartition(":")[2], 16) == port]


@pytest.mark.unit
def test_a_port_in_time_wait_is_free_to_the_servers() -> None:
    # a server that closes a connection first keeps its side in TIME_WAIT for a minute (a
    # /metrics scrape, the console's /healthz); the members bind with SO_REUSEADDR, so such a
    # port is theirs again at once and must count as free
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = listener.accept()
            conn.close()
            assert client.recv(1) == b""
    wait_until(lambda: TIME_WAIT in _states(port), 5, f"port {port} in TIME_WAIT")
    assert local_cluster.port_free(port)
    with socket.socket() as other:  # a server taking it again: now it is not free
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        assert not local_cluster.port_free(port)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not local_cluster.pid_alive(pid), 10, f"pid {pid} gone after SIGKILL")


@pytest.mark.slow
def test_up_again_restarts_what_is_not_running_on_the_ports_it_had(
    data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # (the console's own restart is test_console_local_cluster's)
    up = ["--data", str(data), "cluster", "up", "--brokers", "2", "--no-console"]
    state = local_cluster.up(data, brokers=2, broker_env=BROKER_ENV, console=False, timeout=60)
    ports = _ports(state)
    pids = {p.name: p.pid for p in state.all()}
    killed = ["nameserver-0", "broker-a"]
    for name in killed:
        _kill(pids[name])

    # the members killed come back on their ports; the others keep running
    assert main(up) == 0
    out = capsys.readouterr().out
    for name in killed:
        assert f"restarted {name} on {ports[name][0]} (it was not running)" in out, out
    again = ClusterState.load(data)
    assert again is not None
    assert _ports(again) == ports
    assert {p.name: p.pid for p in again.all() if p.name not in killed} == {
        n: pid for n, pid in pids.items() if n not in killed
    }
    assert all(alive and ok for _, alive, ok in local_cluster.status(again))

    # another shape is refused, saying what differs
    assert main([*up, "--nameservers", "2", "--flush", "sync"]) == 1
    [err] = capsys.readouterr().err.splitlines()
    assert "has another shape: it has 1 nameserver, not 2 (--nameservers); its brokers run " in err
    assert "with --flush async, not sync; run `apogee cluster up` with the options it was " in err

    # down, then up: the same ports, though each metrics port is in TIME_WAIT after a scrape
    # (the server closes the connection); first with the nameserver's port taken by another
    # process: nothing starts, and the error names the port and that process
    for p in again.all():
        with urllib.request.urlopen(f"http://{p.metrics}/metrics", timeout=5) as page:
            assert page.status == 200
    local_cluster.down(data)
    port = int(ports["nameserver-0"][0].rpartition(":")[2])
    script = (
        "import socket, sys, time; s = socket.socket();"
        " s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
        " s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); print('listening', flush=True);"
        " time.sleep(60)"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(port)], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == "listening\n"
            assert main(up) == 1
            [err] = capsys.readouterr().err.splitlines()
            assert err.startswith(f"apogee: port {port} of nameserver-0 ("), err
            assert f"is taken by pid {holder.pid} ({sys.executable} -c import socket" in err, err
            assert ClusterState.load(data) is None
        finally:
            holder.kill()
    state = local_cluster.up(data, brokers=2, console=False, timeout=60)
    assert _ports(state) == ports
