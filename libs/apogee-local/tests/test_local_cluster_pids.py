"""local_cluster.pid_alive: a member that has exited is gone, even before anyone reaps it."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from apogee.local import cluster as local_cluster
from apogee.testkit.waiting import wait_until

pytestmark = pytest.mark.integration


_FORK_AND_FORGET = """
import os, time
child = os.fork()
if child == 0:
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def test_an_exited_process_that_nobody_reaps_is_not_alive() -> None:
    # a Python process forks a child that exits at once, prints its pid and sleeps without ever
    # reaping it: the child stays a zombie that is not ours (as members of a cluster started by
    # an earlier `apogee cluster up` are once they exit, until init reaps them). (A shell may
    # reap its background child itself before it execs, so the zombie is made in Python.)
    with subprocess.Popen(
        [sys.executable, "-c", _FORK_AND_FORGET], stdout=subprocess.PIPE, text=True
    ) as parent:
        try:
            assert parent.stdout is not None
            child = int(parent.stdout.readline())
            wait_until(
                lambda: _state(child) == "Z",
                5,
                f"pid {child} a zombie",
                detail=lambda: f"it is {_state(child)}",
            )
            assert not local_cluster.pid_alive(child)
            assert local_cluster.pid_alive(parent.pid)
        finally:
            parent.kill()
    assert not local_cluster.pid_alive(parent.pid)


def test_a_member_outlives_the_call_that_started_it_quietly(tmp_path: Path) -> None:
    # the Popen object is dropped at once; had it been collected while the member runs, its
    # ResourceWarning ("subprocess ... is still running") would fail this test
    pid = local_cluster._spawn(["-c", "import time; time.sleep(30)"], tmp_path / "log", {}).pid
    gc.collect()
    assert local_cluster.pid_alive(pid)
    os.kill(pid, signal.SIGKILL)
    # reaped by pid_alive once it has exited
    wait_until(lambda: not local_cluster.pid_alive(pid), 5, f"pid {pid} gone after SIGKILL")
