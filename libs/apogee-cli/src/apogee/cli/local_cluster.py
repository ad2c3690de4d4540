"""A local cluster: nameservers, brokers, the schedule service and the transaction checker as
background processes on this machine.

``apogee cluster up`` starts them (each in its own session, so they outlive the command), waits
until every one answers its gRPC health check and every broker is registered with every
nameserver, and records them in ``<data>/cluster.json``; running it again finds them healthy and
only prints the endpoints (a schedule service or transaction checker that is missing or has
died, the rest being healthy, is started again). ``apogee cluster down`` stops them gracefully
(SIGTERM, then SIGKILL after a bound; the schedule service and the transaction checker first,
then the brokers, then the nameservers), keeping their data. Logs go to ``<data>/logs/``.

The schedule service (``python -m apogee_schedule``) delivers delayed and timer messages; the
transaction checker (``python -m apogee_txn_checker``) asks producers about transactions left
undecided. Each finds the brokers through the nameservers, once they are registered, and keeps
its lock file under ``<data>/<role>/`` (``schedule/``, ``txn-checker/``).

Every member also serves Prometheus metrics on a port of its own (nameservers from 9880,
brokers from 10912 in steps of 10, the schedule service 9710, the transaction checker 9711; the
next free port when one is taken), recorded as ``metrics`` in ``cluster.json``. The brokers
keep their default delay table; the checker its default timings (a first check 6 s after a half is
stored, one a minute after that, 15 at most).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import string
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import grpc.aio

from apogee.rpc.server import check_health
from apogee.v1 import nameserver_pb2, nameserver_pb2_grpc

NAMESERVER_PORT = 9876
BROKER_PORT = 10911
SCHEDULE_PORT = 9700
TXN_CHECKER_PORT = 9701
NAMESERVER_METRICS_PORT = 9880
BROKER_METRICS_PORT = 10912
SCHEDULE_METRICS_PORT = 9710
TXN_CHECKER_METRICS_PORT = 9711
STATE_FILE = "cluster.json"


def default_data_dir() -> Path:
    return Path(os.environ.get("APOGEE_HOME", Path.home() / ".apogee")) / "local"


@dataclass
class Process:
    role: str
    name: str
    address: str
    pid: int
    log: str
    data_dir: str = ""
    #: how it was started, so that it can be started again
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: host:port of its /metrics endpoint ("" when it has none)
    metrics: str = ""


@dataclass
class ClusterState:
    data_dir: str
    nameservers: list[Process] = field(default_factory=list)
    brokers: list[Process] = field(default_factory=list)
    #: the schedule service (none, or one)
    schedule: list[Process] = field(default_factory=list)
    #: the transaction checker (none, or one)
    txn_checker: list[Process] = field(default_factory=list)

    @property
    def namesrv(self) -> str:
        return ";".join(p.address for p in self.nameservers)

    def all(self) -> list[Process]:
        return [*self.nameservers, *self.brokers, *self.schedule, *self.txn_checker]

    def save(self) -> None:
        path = Path(self.data_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, data_dir: Path) -> ClusterState | None:
        path = data_dir / STATE_FILE
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        return cls(
            data_dir=raw["data_dir"],
            nameservers=[Process(**p) for p in raw.get("nameservers", [])],
            brokers=[Process(**p) for p in raw.get("brokers", [])],
            schedule=[Process(**p) for p in raw.get("schedule", [])],
            txn_checker=[Process(**p) for p in raw.get("txn_checker", [])],
        )


@dataclass(frozen=True)
class Service:
    """A service that works on every broker, started once the brokers are registered: one
    process, recorded in ``ClusterState.<field>``, its lock file under ``<data>/<role>/``."""

    role: str
    field: str
    module: str
    port: int
    metrics_port: int
    #: the settings prefix of its environment variables
    env_prefix: str


SERVICES = (
    Service(
        "schedule", "schedule", "apogee_schedule", SCHEDULE_PORT, SCHEDULE_METRICS_PORT, "SCHEDULE"
    ),
    Service(
        "txn-checker",
        "txn_checker",
        "apogee_txn_checker",
        TXN_CHECKER_PORT,
        TXN_CHECKER_METRICS_PORT,
        "TXN_CHECKER",
    ),
)
_SERVICE_ROLES = frozenset(s.role for s in SERVICES)


class ClusterError(Exception):
    """Starting or stopping the local cluster failed; the message says what and where to look."""


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


def pick_port(preferred: int, taken: set[int]) -> int:
    port = preferred
    while port in taken or not port_free(port):
        port += 1
        if port > 65000:
            raise ClusterError(f"no free port at or above {preferred}")
    taken.add(port)
    return port


def _metrics_env(prefix: str, preferred: int, taken: set[int], env: dict[str, str]) -> str:
    """The member's metrics address: the one ``env`` sets, else a free port at or above
    ``preferred``, put into ``env`` as ``APOGEE_<prefix>_METRICS_LISTEN``."""
    var = f"APOGEE_{prefix}_METRICS_LISTEN"
    if var in env:
        return env[var]
    address = f"127.0.0.1:{pick_port(preferred, taken)}"
    env[var] = address
    return address


def _port_of(address: str) -> int | None:
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() else None


async def _healthy(address: str) -> bool:
    return await check_health(address, 1.0)


def status(state: ClusterState) -> list[tuple[Process, bool, bool]]:
    """(process, alive, healthy) for each member."""

    async def run() -> list[bool]:
        return list(await asyncio.gather(*(_healthy(p.address) for p in state.all())))

    health = asyncio.run(run())
    return [(p, pid_alive(p.pid), ok) for p, ok in zip(state.all(), health, strict=True)]


def broker_names(count: int) -> list[str]:
    letters = string.ascii_lowercase
    return [f"broker-{letters[i % 26]}{'' if i < 26 else i // 26}" for i in range(count)]


def up(
    data_dir: Path,
    brokers: int = 1,
    nameservers: int = 1,
    flush_mode: str = "async",
    timeout: float = 60.0,
    nameserver_env: dict[str, str] | None = None,
    broker_env: dict[str, str] | None = None,
    schedule: bool = True,
    schedule_env: dict[str, str] | None = None,
    txn_checker: bool = True,
    txn_checker_env: dict[str, str] | None = None,
) -> ClusterState:
    """Start the cluster (or find it running); returns its state. ``schedule``: run the
    schedule service too (delayed and timer messages are delivered only while it runs);
    ``txn_checker``: run the transaction checker too (transactions a producer leaves undecided
    are checked only while it runs)."""
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    wanted = {
        "schedule": (schedule, schedule_env),
        "txn-checker": (txn_checker, txn_checker_env),
    }
    existing = ClusterState.load(data_dir)
    if existing is not None and existing.all():
        report = status(existing)
        core = [(p, alive and ok) for p, alive, ok in report if p.role not in _SERVICE_ROLES]
        same_shape = len(existing.brokers) == brokers and len(existing.nameservers) == nameservers
        if same_shape and all(ok for _, ok in core):
            missing: list[tuple[Service, dict[str, str] | None]] = []
            for svc in SERVICES:
                want, env = wanted[svc.role]
                members = [(alive, ok) for p, alive, ok in report if p.role == svc.role]
                if len(members) == int(want) and all(alive and ok for alive, ok in members):
                    continue
                if want and not any(alive for alive, _ in members):
                    missing.append((svc, env))
                    continue
                break
            else:
                return _add_services(existing, missing, timeout) if missing else existing
        if any(alive for _, alive, _ in report):
            raise ClusterError(
                f"a cluster recorded in {data_dir / STATE_FILE} is partly running or has another "
                "shape; run `apogee cluster down` first (data is kept)"
            )
    logs = data_dir / "logs"
    logs.mkdir(exist_ok=True)
    state = ClusterState(data_dir=str(data_dir))
    taken: set[int] = set()
    started: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(nameservers):
            port = pick_port(NAMESERVER_PORT + i, taken)
            name = f"nameserver-{i}"
            log = logs / f"{name}.log"
            argv = ["-m", "apogee_nameserver", "--listen", f"127.0.0.1:{port}"]
            env = dict(nameserver_env or {})
            metrics = _metrics_env("NAMESERVER", NAMESERVER_METRICS_PORT + i, taken, env)
            proc = _spawn(argv, log, env)
            started.append(proc)
            state.nameservers.append(
                Process(
                    "nameserver",
                    name,
                    f"127.0.0.1:{port}",
                    proc.pid,
                    str(log),
                    "",
                    argv,
                    env,
                    metrics,
                )
            )
        for name in broker_names(brokers):
            port = pick_port(BROKER_PORT + 10 * len(state.brokers), taken)
            log = logs / f"{name}.log"
            bdir = data_dir / name
            argv = [
                "-m",
                "apogee_broker",
                "--listen",
                f"127.0.0.1:{port}",
                "--name",
                name,
                "--data-dir",
                str(bdir),
                "--namesrv",
                state.namesrv,
            ]
            env = {
                "APOGEE_BROKER_AUTO_CREATE_TOPICS": "true",
                "APOGEE_BROKER_FLUSH_MODE": flush_mode,
                **(broker_env or {}),
            }
            metrics = _metrics_env(
                "BROKER", BROKER_METRICS_PORT + 10 * len(state.brokers), taken, env
            )
            proc = _spawn(argv, log, env)
            started.append(proc)
            state.brokers.append(
                Process(
                    "broker",
                    name,
                    f"127.0.0.1:{port}",
                    proc.pid,
                    str(log),
                    str(bdir),
                    argv,
                    env,
                    metrics,
                )
            )
        state.save()
        deadline = time.monotonic() + timeout
        _wait_ready(state, started, deadline, timeout)
        # once the brokers are registered: the services find them at their start
        services = [(svc, wanted[svc.role][1]) for svc in SERVICES if wanted[svc.role][0]]
        procs = [_start_service(state, svc, taken, env) for svc, env in services]
        started += procs
        state.save()
        running = [getattr(state, svc.field)[0] for svc, _ in services]
        _wait_healthy(running, procs, deadline, timeout)
    except BaseException:
        _kill_all(started)
        with contextlib.suppress(OSError):
            (data_dir / STATE_FILE).unlink()
        raise
    return state


def _start_service(
    state: ClusterState, svc: Service, taken: set[int], env: dict[str, str] | None
) -> subprocess.Popen[bytes]:
    """Spawn service ``svc`` of ``state`` (recorded in ``state.<svc.field>``)."""
    data_dir = Path(state.data_dir)
    sdir = data_dir / svc.role
    sdir.mkdir(exist_ok=True)
    port = pick_port(svc.port, taken)
    log = data_dir / "logs" / f"{svc.role}.log"
    argv = [
        "-m",
        svc.module,
        "--namesrv",
        state.namesrv,
        "--listen",
        f"127.0.0.1:{port}",
        "--lock-file",
        str(sdir / f"{svc.role}.lock"),
    ]
    env = dict(env or {})
    metrics = _metrics_env(svc.env_prefix, svc.metrics_port, taken, env)
    proc = _spawn(argv, log, env)
    member = Process(
        svc.role, svc.role, f"127.0.0.1:{port}", proc.pid, str(log), str(sdir), argv, env, metrics
    )
    setattr(state, svc.field, [member])
    return proc


def _add_services(
    state: ClusterState,
    missing: list[tuple[Service, dict[str, str] | None]],
    timeout: float,
) -> ClusterState:
    """Start the services a running cluster lacks (or whose process died)."""
    (Path(state.data_dir) / "logs").mkdir(exist_ok=True)
    taken = {
        port
        for p in state.all()
        for port in (_port_of(p.address), _port_of(p.metrics))
        if port is not None
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for svc, env in missing:
            procs.append(_start_service(state, svc, taken, env))
        members = [getattr(state, svc.field)[0] for svc, _ in missing]
        _wait_healthy(members, procs, time.monotonic() + timeout, timeout)
    except BaseException:
        _kill_all(procs)
        for svc, _ in missing:
            setattr(state, svc.field, [])
        raise
    state.save()
    return state


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    out = open(log, "ab")  # noqa: SIM115 - handed to the child, closed below
    try:
        proc = subprocess.Popen(
            [sys.executable, *args],
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


def _wait_ready(
    state: ClusterState, procs: list[subprocess.Popen[bytes]], deadline: float, timeout: float
) -> None:
    """Until the nameservers and brokers (started as ``procs``) are healthy and every broker is
    registered with every nameserver."""
    members = [*state.nameservers, *state.brokers]
    _wait_healthy(members, procs, deadline, timeout)
    # every broker registered with every nameserver, so that routes work at once
    for ns in state.nameservers:
        while True:
            if registered_brokers(ns.address) >= {b.name for b in state.brokers}:
                break
            _check_running(members, procs)  # another process may have answered on its port
            if time.monotonic() > deadline:
                raise ClusterError(f"brokers did not register with {ns.name} within {timeout:.0f}s")
            time.sleep(0.1)


def _check_running(members: list[Process], procs: list[subprocess.Popen[bytes]]) -> None:
    for proc, member in zip(procs, members, strict=True):
        if proc.poll() is not None:
            raise ClusterError(
                f"{member.name} exited with code {proc.returncode} while starting; "
                f"see {member.log}:\n{_tail(Path(member.log))}"
            )


def _wait_healthy(
    members: list[Process],
    procs: list[subprocess.Popen[bytes]],
    deadline: float,
    timeout: float,
) -> None:
    """Until every one of ``members`` (started as ``procs``) answers its health check."""
    pending = list(members)
    while pending:
        _check_running(members, procs)
        healthy = status_subset(pending)
        pending = [p for p, ok in zip(pending, healthy, strict=True) if not ok]
        if pending and time.monotonic() > deadline:
            names = ", ".join(f"{p.name} (log {p.log})" for p in pending)
            raise ClusterError(f"not healthy within {timeout:.0f}s: {names}")
        if pending:
            time.sleep(0.1)  # polling a process we do not control, with a deadline


def registered_brokers(nameserver: str) -> set[str]:
    """Names of the brokers a nameserver knows (empty when it does not answer)."""

    async def run() -> set[str]:
        async with grpc.aio.insecure_channel(nameserver) as channel:
            stub = nameserver_pb2_grpc.NameServerStub(channel)
            try:
                info = await stub.GetClusterInfo(nameserver_pb2.GetClusterInfoRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                return set()
            return {b.broker_name for b in info.brokers}

    return asyncio.run(run())


def status_subset(members: list[Process]) -> list[bool]:
    async def run() -> list[bool]:
        return list(await asyncio.gather(*(_healthy(p.address) for p in members)))

    return asyncio.run(run())


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def restart(state: ClusterState, name: str, timeout: float = 60.0) -> Process:
    """Start member ``name`` again (after it died or was killed) and wait until it is healthy."""
    member = next((p for p in state.all() if p.name == name), None)
    if member is None:
        raise ClusterError(f"no member named {name!r} in {state.data_dir}")
    if pid_alive(member.pid):
        raise ClusterError(f"{name} is still running (pid {member.pid})")
    proc = _spawn(member.argv, Path(member.log), member.env)
    member.pid = proc.pid
    state.save()
    deadline = time.monotonic() + timeout
    while not status_subset([member])[0]:
        if proc.poll() is not None:
            raise ClusterError(
                f"{name} exited with code {proc.returncode}; see {member.log}:\n"
                f"{_tail(Path(member.log))}"
            )
        if time.monotonic() > deadline:
            raise ClusterError(f"{name} not healthy within {timeout:.0f}s; see {member.log}")
        time.sleep(0.1)  # polling a process we do not control, with a deadline
    return member


def down(data_dir: Path, timeout: float = 20.0) -> list[tuple[Process, str]]:
    """Stop every member gracefully (the schedule service and the transaction checker, then
    the brokers, then the nameservers); returns (member, how it stopped)."""
    state = ClusterState.load(data_dir.resolve())
    if state is None:
        return []
    out: list[tuple[Process, str]] = []
    services = [*state.schedule, *state.txn_checker]
    for group in (services, state.brokers, state.nameservers):
        for p in group:
            if pid_alive(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in group:
            while pid_alive(p.pid) and time.monotonic() < deadline:
                time.sleep(0.05)  # waiting for another process's exit, with a deadline
            if pid_alive(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                out.append((p, f"killed after {timeout:.0f}s"))
            else:
                out.append((p, "stopped"))
    (Path(state.data_dir) / STATE_FILE).unlink(missing_ok=True)
    return out
