"""Processes of the local cluster: started in sessions of their own (they outlive the command
that starts them), recognised as alive or gone (a zombie counts as gone), stopped hard; free
ports; the tail of a log.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

#: The members this process started, kept so that they are reaped when they exit (and not
#: reported by ``Popen.__del__`` as still running) however long they outlive the call.
_started: dict[int, subprocess.Popen[bytes]] = {}


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    proc = _started.get(pid)
    if proc is not None:
        if proc.poll() is None:
            return True
        del _started[pid]
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    # so does a zombie that is not ours (started by an earlier `apogee cluster up`): it has
    # exited and waits for init to reap it, which some inits do late or never
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited but is not reaped yet (from /proc; False where there is none)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "<pid> (<command>) <state> ...": the command may hold spaces and parentheses
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def spawn(
    args: list[str], log: Path, env: dict[str, str], python: bool = True
) -> subprocess.Popen[bytes]:
    """Start ``python args`` (or the program ``args[0]`` when not ``python``) in a session of
    its own, its output appended to ``log``."""
    out = open(log, "ab")  # noqa: SIM115 - handed to the child, closed below
    try:
        proc = subprocess.Popen(
            [sys.executable, *args] if python else args,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        _started[proc.pid] = proc
        return proc
    finally:
        out.close()


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
