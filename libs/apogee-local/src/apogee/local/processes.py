"""Processes of the local cluster: started in sessions of their own (they outlive the command
that starts them), recognised as alive or gone (a zombie counts as gone), stopped hard; free
ports and who holds a taken one; the tail of a log; the error of the local cluster
(:class:`ClusterError`).

A port is free when a member could listen on it now: the members bind with ``SO_REUSEADDR``
(gRPC, uvicorn, the metrics servers and Prometheus all do), so :func:`port_free` probes with it
too. A port whose last connections are in TIME_WAIT (for a minute after the server side closed
them first: a ``/metrics`` scrape, the console's ``/healthz``) is free to them; a probe without
the option would call it taken, and a cluster stopped and started again would move to the next
ports.

Every member runs with ``APOGEE_LOCAL_CLUSTER`` (:data:`CLUSTER_ENV`) set to its cluster's
folder, so that :func:`port_holder` can say which cluster a process holding a port belongs to.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path

from apogee.cli.common import CommandError
from apogee.cli.local_state import ClusterState


class ClusterError(CommandError):
    """Starting or stopping the local cluster failed; the message says what and where to look
    (the ``apogee`` command prints it as one line and exits 1)."""


#: The members this process started, kept so that they are reaped when they exit (and not
#: reported by ``Popen.__del__`` as still running) however long they outlive the call.
_started: dict[int, subprocess.Popen[bytes]] = {}
#: the variable that marks a member of a local cluster: its cluster's folder
CLUSTER_ENV = "APOGEE_LOCAL_CLUSTER"


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
    """Whether a member could listen on 127.0.0.1:``port`` now (bound as they bind, with
    ``SO_REUSEADDR``: connections in TIME_WAIT do not count, a listener anywhere does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def port_holder(port: int) -> str:
    """Who holds TCP ``port``, as words for an error: ``pid N (command line)`` and, for a
    member of a local cluster, which one; or why that cannot be seen. Found through
    ``/proc/net/tcp{,6}`` (the socket's inode and owner) and ``/proc/<pid>/fd``."""
    sockets = _sockets(port)
    if not sockets:
        return "a process not visible here (no socket on that port in /proc/net/tcp)"
    inodes = {inode for _, inode in sockets}
    for pid in _pids():
        with contextlib.suppress(OSError), os.scandir(f"/proc/{pid}/fd") as fds:
            for fd in fds:
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path) in inodes:
                        return f"pid {pid} ({_command_line(pid)}){_member_of(pid)}"
    uid = sockets[0][0]
    return f"a process of {_user(uid)} (uid {uid}) that this user cannot see"


#: TCP states in /proc/net/tcp: what holds a port (TIME_WAIT holds nothing a server minds)
_LISTEN, _TIME_WAIT = "0A", "06"


def _sockets(port: int) -> list[tuple[int, str]]:
    """(uid, ``socket:[inode]``) of the sockets on local ``port``, listeners first."""
    found: list[tuple[str, int, str]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for fields in map(str.split, lines):
            # sl local_address rem_address st ... uid timeout inode
            state, uid, inode = fields[3], int(fields[7]), fields[9]
            if int(fields[1].rpartition(":")[2], 16) == port and state != _TIME_WAIT:
                found.append((state, uid, f"socket:[{inode}]"))
    found.sort(key=lambda f: f[0] != _LISTEN)
    return [(uid, inode) for _, uid, inode in found]


def _pids() -> list[int]:
    try:
        with os.scandir("/proc") as entries:
            return [int(e.name) for e in entries if e.name.isdigit()]
    except OSError:
        return []


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "command line not readable"
    text = " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)
    return text if len(text) <= 200 else text[:197] + "..."


def _member_of(pid: int) -> str:
    """``, <name> of the local cluster in <folder>`` for a member of one, else ""."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    prefix = f"{CLUSTER_ENV}=".encode()
    folder = next((v[len(prefix) :].decode() for v in environ if v.startswith(prefix)), "")
    if not folder:
        return ""
    try:
        state = ClusterState.load(Path(folder))
    except (OSError, ValueError, KeyError, TypeError):
        state = None
    name = next((p.name for p in state.all() if p.pid == pid), None) if state else None
    return f", {name or 'a member'} of the local cluster in {folder}"


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return "another user"


def spawn(
    args: list[str], log: Path, env: dict[str, str], python: bool = True, cluster: str = ""
) -> subprocess.Popen[bytes]:
    """Start ``python args`` (or the program ``args[0]`` when not ``python``) in a session of
    its own, its output appended to ``log``; a member of the cluster in folder ``cluster``
    (:data:`CLUSTER_ENV`) when given."""
    out = open(log, "ab")  # noqa: SIM115 - handed to the child, closed below
    marker = {CLUSTER_ENV: cluster} if cluster else {}
    try:
        proc = subprocess.Popen(
            [sys.executable, *args] if python else args,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env, **marker},
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
