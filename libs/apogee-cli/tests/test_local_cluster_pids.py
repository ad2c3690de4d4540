"""local_cluster.pid_alive: a member that has exited is gone, even before anyone reaps it."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from apogee.cli import local_cluster

pytestmark = pytest.mark.integration


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def test_an_exited_process_that_nobody_reaps_is_not_alive() -> None:
    # sh starts `sleep 0` in the background, prints its pid and becomes `sleep 5`, which never
    # reaps it: the child stays a zombie that is not ours (as members of a cluster started by
    # an earlier `apogee cluster up` are once they exit, until init reaps them)
    with subprocess.Popen(
        ["sh", "-c", "sleep 0 & echo $!; exec sleep 5"], stdout=subprocess.PIPE, text=True
    ) as parent:
        try:
            assert parent.stdout is not None
            child = int(parent.stdout.readline())
            deadline = time.monotonic() + 5
            while _state(child) != "Z":
                assert time.monotonic() < deadline, f"pid {child} is {_state(child)}, no zombie"
                time.sleep(0.01)  # waiting for another process to exit, with a deadline
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
    deadline = time.monotonic() + 5
    while local_cluster.pid_alive(pid):  # reaped by pid_alive once it has exited
        assert time.monotonic() < deadline, f"pid {pid} still alive after SIGKILL"
        time.sleep(0.01)  # waiting for another process to exit, with a deadline
