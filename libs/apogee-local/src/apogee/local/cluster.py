"""A local cluster: nameservers, brokers, the schedule service, the transaction checker and the
web console as background processes on this machine.

``apogee cluster up`` starts them (each in its own session, so they outlive the command), waits
until every one answers its gRPC health check and every broker is registered with every
nameserver, and records them in ``<data>/cluster.json`` (:class:`ClusterState`, whose format
:mod:`apogee.cli.local_state` draws: the admin commands read it to find the cluster, and only
this module writes it); running it again finds them healthy and only prints the endpoints (a
schedule service or transaction checker that is missing or has died, the rest being healthy, is
started again). ``apogee cluster down`` stops them gracefully (SIGTERM, then SIGKILL after a
bound; Prometheus and the console first, then the schedule service and the transaction checker,
then the brokers, then the nameservers), keeping their data. Logs go to ``<data>/logs/``. The
subcommands themselves are :mod:`apogee.local.commands`.

The schedule service (``python -m apogee_schedule``) delivers delayed and timer messages; the
transaction checker (``python -m apogee_txn_checker``) asks producers about transactions left
undecided. Each finds the brokers through the nameservers, once they are registered, and keeps
its lock file under ``<data>/<role>/`` (``schedule/``, ``txn-checker/``).

The web console (``python -m apogee_console``, :mod:`apogee.local.webconsole`) serves its pages on
8080 or the next free port, started with the schedule service once the brokers are registered
and healthy once ``GET /healthz`` answers; it is left out with ``console=False`` (``apogee
cluster up --no-console``) or when ``apogee-console`` is not installed. Like Prometheus it may
come and go: a later ``up`` starts it when it is wanted and not running, an ``up`` without it
leaves a running one alone and forgets one that has stopped.

Every member also serves Prometheus metrics on a port of its own (nameservers from 9880,
brokers from 10912 in steps of 10, the schedule service 9710, the transaction checker 9711, the
console 8081; the next free port when one is taken), recorded as ``metrics`` in
``cluster.json``. The brokers keep their default delay table; the checker its default timings (a
first check 6 s after a half is stored, one a minute after that, 15 at most).

With ``monitoring`` (``apogee cluster up --monitoring``) a Prometheus server (Debian's
``prometheus`` program, see :mod:`apogee.local.prometheus`) runs too, last: it scrapes every
member's metrics (one job per role), keeps its data under ``<data>/prometheus/`` and listens on
9090 or the next free port; it is a member of its own (role ``prometheus``), stopped first. When
the program is missing nothing is started. A later ``up --monitoring`` starts it if it is not
running, and otherwise rewrites its configuration and has it reload (SIGHUP); an ``up`` without
``--monitoring`` leaves a running one alone and forgets one that has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import string
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from apogee.cli.common import CommandError
from apogee.cli.local_state import (
    CONSOLE,
    PROMETHEUS,
    STATE_FILE,
    ClusterState,
    Process,
    default_data_dir,
)
from apogee.local import processes, prometheus, webconsole
from apogee.rpc.security import ClientSecurity
from apogee.rpc.server import check_health
from apogee.v1 import nameserver_pb2, nameserver_pb2_grpc

# the record of the members (ClusterState, Process, ...) is apogee.cli.local_state's, which the
# admin commands read; it is part of this module's surface too
__all__ = [
    "BROKER_METRICS_PORT",
    "BROKER_PORT",
    "CONSOLE",
    "NAMESERVER_METRICS_PORT",
    "NAMESERVER_PORT",
    "PROMETHEUS",
    "PROMETHEUS_PORT",
    "SCHEDULE_METRICS_PORT",
    "SCHEDULE_PORT",
    "SERVICES",
    "STATE_FILE",
    "TXN_CHECKER_METRICS_PORT",
    "TXN_CHECKER_PORT",
    "ClusterError",
    "ClusterState",
    "Process",
    "Service",
    "broker_names",
    "default_data_dir",
    "down",
    "pick_port",
    "pid_alive",
    "port_free",
    "registered_brokers",
    "restart",
    "status",
    "status_subset",
    "up",
]

NAMESERVER_PORT = 9876
BROKER_PORT = 10911
SCHEDULE_PORT = 9700
TXN_CHECKER_PORT = 9701
NAMESERVER_METRICS_PORT = 9880
BROKER_METRICS_PORT = 10912
SCHEDULE_METRICS_PORT = 9710
TXN_CHECKER_METRICS_PORT = 9711
PROMETHEUS_PORT = prometheus.DEFAULT_PORT


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
#: members that may come and go while the rest runs
_OPTIONAL_ROLES = _SERVICE_ROLES | {PROMETHEUS, CONSOLE}


class ClusterError(CommandError):
    """Starting or stopping the local cluster failed; the message says what and where to look
    (the ``apogee`` command prints it as one line and exits 1)."""


# the process helpers (apogee.local.processes), also known by these names
pid_alive = processes.pid_alive
port_free = processes.port_free
_spawn = processes.spawn
_kill_all = processes.kill_all
_tail = processes.tail


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


async def _healthy(p: Process) -> bool:
    if p.role == PROMETHEUS:
        return await asyncio.to_thread(prometheus.is_ready, p.address, 1.0)
    if p.role == CONSOLE:
        return await asyncio.to_thread(webconsole.healthy, p.address, p.env, 1.0)
    return await check_health(p.address, 1.0, tls=ClientSecurity.from_env().tls)


def status(state: ClusterState) -> list[tuple[Process, bool, bool]]:
    """(process, alive, healthy) for each member."""

    async def run() -> list[bool]:
        return list(await asyncio.gather(*(_healthy(p) for p in state.all())))

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
    console: bool = True,
    console_env: dict[str, str] | None = None,
    monitoring: bool = False,
    scrape_interval_s: float = prometheus.DEFAULT_SCRAPE_INTERVAL_S,
    prometheus_port: int = PROMETHEUS_PORT,
) -> ClusterState:
    """Start the cluster (or find it running); returns its state. ``schedule``: run the
    schedule service too (delayed and timer messages are delivered only while it runs);
    ``txn_checker``: run the transaction checker too (transactions a producer leaves undecided
    are checked only while it runs); ``console``: run the web console too (when installed,
    :func:`apogee.local.webconsole.available`), with ``console_env`` added to its environment;
    ``monitoring``: run Prometheus too, scraping every member each ``scrape_interval_s``, on
    ``prometheus_port`` or the next free port."""
    console = console and webconsole.available()
    binary = _prometheus_binary(scrape_interval_s) if monitoring else None
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    wanted = {
        "schedule": (schedule, schedule_env),
        "txn-checker": (txn_checker, txn_checker_env),
    }
    existing = ClusterState.load(data_dir)
    if existing is not None and existing.all():
        report = status(existing)
        core = [(p, alive and ok) for p, alive, ok in report if p.role not in _OPTIONAL_ROLES]
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
                if missing:
                    existing = _add_services(existing, missing, timeout)
                existing = _console(existing, console, console_env, timeout)
                return _monitor(existing, binary, scrape_interval_s, prometheus_port, timeout)
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
        running = [getattr(state, svc.field)[0] for svc, _ in services]
        if console:
            procs.append(_start_console(state, taken, console_env))
            running.append(state.console[0])
        started += procs
        state.save()
        _wait_healthy(running, procs, deadline, timeout)
        if binary is not None:  # last: it scrapes the others
            started.append(
                _start_prometheus(state, binary, scrape_interval_s, prometheus_port, taken)
            )
            state.save()
            _wait_prometheus(state.prometheus[0], started[-1], deadline)
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


def _start_console(
    state: ClusterState, taken: set[int], env: dict[str, str] | None
) -> subprocess.Popen[bytes]:
    """Spawn the web console for ``state``'s nameservers (recorded in ``state.console``)."""
    address = f"127.0.0.1:{pick_port(webconsole.PORT, taken)}"
    log = Path(state.data_dir) / "logs" / f"{CONSOLE}.log"
    argv = webconsole.argv(address, state.namesrv)
    env = dict(env or {})
    metrics = _metrics_env(webconsole.ENV_PREFIX, webconsole.METRICS_PORT, taken, env)
    proc = _spawn(argv, log, env)
    state.console = [Process(CONSOLE, CONSOLE, address, proc.pid, str(log), "", argv, env, metrics)]
    return proc


def _console(
    state: ClusterState, wanted: bool, env: dict[str, str] | None, timeout: float
) -> ClusterState:
    """The console of a running cluster: started when wanted and not running; one that stopped
    and is not wanted is forgotten; a running one is left alone."""
    running = [p for p in state.console if pid_alive(p.pid)]
    if running or not wanted:
        if state.console and not running:
            state.console = []
            state.save()
        return state
    (Path(state.data_dir) / "logs").mkdir(exist_ok=True)
    proc = _start_console(state, _ports_taken(state), env)
    try:
        _wait_healthy(state.console, [proc], time.monotonic() + timeout, timeout)
    except BaseException:
        _kill_all([proc])
        state.console = []
        raise
    state.save()
    return state


def _add_services(
    state: ClusterState,
    missing: list[tuple[Service, dict[str, str] | None]],
    timeout: float,
) -> ClusterState:
    """Start the services a running cluster lacks (or whose process died)."""
    (Path(state.data_dir) / "logs").mkdir(exist_ok=True)
    taken = _ports_taken(state)
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


def _ports_taken(state: ClusterState) -> set[int]:
    return {
        port
        for p in state.all()
        for port in (_port_of(p.address), _port_of(p.metrics))
        if port is not None
    }


def _prometheus_binary(scrape_interval_s: float) -> str:
    """The ``prometheus`` program, checked before anything is started."""
    try:
        prometheus.duration_text(scrape_interval_s)
        return prometheus.find_binary()
    except (prometheus.PrometheusError, ValueError) as exc:
        raise ClusterError(f"monitoring: {exc}; nothing was started") from None


def _prometheus_config(state: ClusterState, scrape_interval_s: float) -> Path:
    """Write the configuration of ``state``'s Prometheus: a job per role of the members."""
    path = Path(state.data_dir) / PROMETHEUS / "prometheus.yml"
    return prometheus.write_config(path, prometheus.scrape_jobs(state.all()), scrape_interval_s)


def _start_prometheus(
    state: ClusterState, binary: str, scrape_interval_s: float, port: int, taken: set[int]
) -> subprocess.Popen[bytes]:
    """Spawn Prometheus for ``state``'s members (recorded in ``state.prometheus``)."""
    config = _prometheus_config(state, scrape_interval_s)
    address = f"127.0.0.1:{pick_port(port, taken)}"
    argv = prometheus.command(config, config.parent / "data", address, binary)
    log = Path(state.data_dir) / "logs" / f"{PROMETHEUS}.log"
    proc = _spawn(argv, log, {}, python=False)
    member = Process(PROMETHEUS, PROMETHEUS, address, proc.pid, str(log), str(config.parent), argv)
    state.prometheus = [member]
    return proc


def _wait_prometheus(member: Process, proc: subprocess.Popen[bytes], deadline: float) -> None:
    try:
        prometheus.wait_ready(member.address, deadline, proc, Path(member.log))
    except prometheus.PrometheusError as exc:
        raise ClusterError(str(exc)) from None


def _monitor(
    state: ClusterState, binary: str | None, scrape_interval_s: float, port: int, timeout: float
) -> ClusterState:
    """Prometheus for a running cluster: started when wanted and not running, told to reload
    its configuration (rewritten) when running; one that stopped and is not wanted is dropped."""
    running = [p for p in state.prometheus if pid_alive(p.pid)]
    if binary is None or running:
        if binary is not None:
            _prometheus_config(state, scrape_interval_s)
            os.kill(running[0].pid, signal.SIGHUP)
        elif state.prometheus and not running:
            state.prometheus = []
            state.save()
        return state
    (Path(state.data_dir) / "logs").mkdir(exist_ok=True)
    proc = _start_prometheus(state, binary, scrape_interval_s, port, _ports_taken(state))
    try:
        _wait_prometheus(state.prometheus[0], proc, time.monotonic() + timeout)
    except BaseException:
        _kill_all([proc])
        state.prometheus = []
        raise
    state.save()
    return state


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
    """Names of the brokers a nameserver knows (empty when it does not answer). Asked over TLS
    and signed when the environment says so (:meth:`ClientSecurity.from_env`)."""

    async def run() -> set[str]:
        async with ClientSecurity.from_env().channel(nameserver) as channel:
            stub = nameserver_pb2_grpc.NameServerStub(channel)
            try:
                info = await stub.GetClusterInfo(nameserver_pb2.GetClusterInfoRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                return set()
            return {b.broker_name for b in info.brokers}

    return asyncio.run(run())


def status_subset(members: list[Process]) -> list[bool]:
    async def run() -> list[bool]:
        return list(await asyncio.gather(*(_healthy(p) for p in members)))

    return asyncio.run(run())


def restart(state: ClusterState, name: str, timeout: float = 60.0) -> Process:
    """Start member ``name`` again (after it died or was killed) and wait until it is healthy."""
    member = next((p for p in state.all() if p.name == name), None)
    if member is None:
        raise ClusterError(f"no member named {name!r} in {state.data_dir}")
    if pid_alive(member.pid):
        raise ClusterError(f"{name} is still running (pid {member.pid})")
    proc = _spawn(member.argv, Path(member.log), member.env, python=member.role != PROMETHEUS)
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
    """Stop every member gracefully (Prometheus and the console, the schedule service and the
    transaction checker, then the brokers, then the nameservers); returns (member, how it
    stopped)."""
    state = ClusterState.load(data_dir.resolve())
    if state is None:
        return []
    out: list[tuple[Process, str]] = []
    services = [*state.schedule, *state.txn_checker]
    clients = [*state.prometheus, *state.console]
    for group in (clients, services, state.brokers, state.nameservers):
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
