"""A local cluster: nameservers, brokers, the schedule service, the transaction checker and the
web console as background processes on this machine.

``apogee cluster up`` starts them (each in its own session, so they outlive the command), waits
until every one answers its gRPC health check and every broker is registered with every
nameserver, and records them in ``<data>/cluster.json`` (:class:`ClusterState`, whose format
:mod:`apogee.cli.local_state` draws: the admin commands read it to find the cluster, and only
this module writes it). ``apogee cluster down`` stops them gracefully (SIGTERM, then SIGKILL
after a bound; Prometheus and the console first, then the schedule service and the transaction
checker, then the brokers, then the nameservers), keeping their data and their ports
(``<data>/ports.json``, :mod:`apogee.local.ports`). Logs go to ``<data>/logs/``. The
subcommands themselves are :mod:`apogee.local.commands`.

Running ``up`` again is harmless. The members whose process runs are left alone; every other
one (killed, crashed, or all of them after a reboot or a ``down``) starts again on the ports it
had, the nameservers and brokers first, the others once the brokers are registered. A recorded
port another process holds now fails the start before anything starts, naming the port and the
holder (:func:`apogee.local.processes.port_holder`: its pid and command line, and which local
cluster when it is a member of one). A cluster that runs is not changed into another shape:
another count of nameservers or brokers, another ``--flush`` or other environment than recorded
is refused, saying what differs (``apogee cluster down`` first, then ``up`` with the new one).

The schedule service (``python -m apogee_schedule``) delivers delayed and timer messages; the
transaction checker (``python -m apogee_txn_checker``) asks producers about transactions left
undecided. Each finds the brokers through the nameservers, once they are registered, and keeps
its lock file under ``<data>/<role>/`` (``schedule/``, ``txn-checker/``).

The web console (``python -m apogee_console``, :mod:`apogee.local.webconsole`) serves its pages on
8080 or the next free port, started with the schedule service once the brokers are registered
and healthy once ``GET /healthz`` answers; it is left out with ``console=False`` (``apogee
cluster up --no-console``) or when ``apogee-console`` is not installed. Like the schedule
service, the transaction checker and Prometheus it may come and go: a later ``up`` starts it
when it is wanted and not running, an ``up`` without it leaves a running one alone and forgets
one that has stopped.

Every member also serves Prometheus metrics on a port of its own (nameservers from 9880,
brokers from 10912 in steps of 10, the schedule service 9710, the transaction checker 9711, the
console 8081; the next free port when one is taken; the one it had when it has run before),
recorded as ``metrics`` in
``cluster.json``. The brokers keep their default delay table; the checker its default timings (a
first check 6 s after a half is stored, one a minute after that, 15 at most).

With ``monitoring`` (``apogee cluster up --monitoring``) a Prometheus server (Debian's
``prometheus`` program, see :mod:`apogee.local.prometheus`) runs too, last: it scrapes every
member's metrics (one job per role), keeps its data under ``<data>/prometheus/`` and listens on
``--prometheus-port``, else the port it had, else 9090 or the next free port; it is a member of
its own (role ``prometheus``), stopped first. When the program is missing nothing is started. A
later ``up --monitoring`` starts it if it is not running, and otherwise rewrites its
configuration and has it reload (SIGHUP); an ``up`` without ``--monitoring`` leaves a running
one alone and forgets one that has stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import string
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from apogee.cli.local_state import (
    CONSOLE,
    PROMETHEUS,
    STATE_FILE,
    ClusterState,
    Process,
    default_data_dir,
)
from apogee.local import health, ports, processes, prometheus, webconsole
from apogee.local.processes import ClusterError

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


# the process helpers (apogee.local.processes) and the health checks (apogee.local.health),
# also known by these names
pid_alive = processes.pid_alive
port_free = processes.port_free
status = health.status
status_subset = health.status_subset
registered_brokers = health.registered_brokers
_spawn = processes.spawn
_kill_all = processes.kill_all
_tail = processes.tail


def pick_port(preferred: int, taken: set[int]) -> int:
    """A free port at or above ``preferred`` and not in ``taken`` (which it is added to), for
    a member that has none recorded."""
    port = preferred
    while port in taken or not port_free(port):
        port += 1
        if port > 65000:
            raise ClusterError(f"no free port at or above {preferred}")
    taken.add(port)
    return port


def broker_names(count: int) -> list[str]:
    letters = string.ascii_lowercase
    return [f"broker-{letters[i % 26]}{'' if i < 26 else i // 26}" for i in range(count)]


def replica_names(broker: str, replicas: int) -> list[str]:
    """The members serving ``broker``: itself alone, or ``<broker>-0`` ... for a group."""
    return [broker] if replicas <= 1 else [f"{broker}-{i}" for i in range(replicas)]


def _replica_env(group_dir: Path, replicas: int) -> dict[str, str]:
    """What makes a broker process one replica of a group on this machine."""
    return {
        "APOGEE_BROKER_REPLICATION": "file",
        "APOGEE_BROKER_REPLICA_GROUP_DIR": str(group_dir),
        "APOGEE_BROKER_REPLICAS": str(replicas),
        "APOGEE_BROKER_MIN_INSYNC_REPLICAS": str(min(2, replicas)),
    }


def _broker_env(flush_mode: str, broker_env: dict[str, str] | None) -> dict[str, str]:
    """The brokers' environment (their metrics address apart)."""
    return {
        "APOGEE_BROKER_AUTO_CREATE_TOPICS": "true",
        "APOGEE_BROKER_FLUSH_MODE": flush_mode,
        **(broker_env or {}),
    }


def _differences(
    state: ClusterState,
    brokers: int,
    nameservers: int,
    flush_mode: str,
    nameserver_env: dict[str, str] | None,
    broker_env: dict[str, str] | None,
) -> list[str]:
    """How the cluster recorded in ``state`` differs from the one asked for, in words."""
    out = []
    for role, members, count in (
        ("nameservers", state.nameservers, nameservers),
        ("brokers", state.brokers, brokers),
    ):
        if len(members) != count:
            what = role[:-1] if len(members) == 1 else role
            out.append(f"it has {len(members)} {what}, not {count} (--{role})")
    for role, members, env in (
        ("nameservers", state.nameservers, dict(nameserver_env or {})),
        ("brokers", state.brokers, _broker_env(flush_mode, broker_env)),
    ):
        for key, value in env.items():
            other = [p.env.get(key) for p in members if p.env.get(key) != value]
            if other and key == "APOGEE_BROKER_FLUSH_MODE":
                out.append(f"its brokers run with --flush {other[0]}, not {value}")
            elif other:
                was = f"{key}={other[0]!r}" if other[0] is not None else f"no {key}"
                out.append(f"its {role} run with {was}, not {key}={value!r}")
    return out


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
    prometheus_port: int | None = None,
    replicas: int = 1,
) -> ClusterState:
    """Start the cluster, or what of it is not running; returns its state. ``schedule``: run
    the schedule service too (delayed and timer messages are delivered only while it runs);
    ``txn_checker``: run the transaction checker too (transactions a producer leaves undecided
    are checked only while it runs); ``console``: run the web console too (when installed,
    :func:`apogee.local.webconsole.available`), with ``console_env`` added to its environment;
    ``monitoring``: run Prometheus too, scraping every member each ``scrape_interval_s``, on
    ``prometheus_port`` or the next free port (None: its recorded port, else 9090 or the
    next); ``replicas``: each broker a replica group of that many processes (members
    ``<broker>-0``, ``<broker>-1``, ...; leadership by the file coordination in
    ``<data>/<broker>/group``, docs/replication.md)."""
    console = console and webconsole.available()
    binary = _prometheus_binary(scrape_interval_s) if monitoring else None
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    wanted = {
        "schedule": (schedule, schedule_env),
        "txn-checker": (txn_checker, txn_checker_env),
    }
    existing = ClusterState.load(data_dir)
    running = {p.name for p in existing.all() if pid_alive(p.pid)} if existing else set()
    if existing is not None and running:
        differences = _differences(
            existing, brokers * replicas, nameservers, flush_mode, nameserver_env, broker_env
        )
        if differences:
            raise ClusterError(
                f"the cluster recorded in {data_dir / STATE_FILE} has another shape: "
                f"{'; '.join(differences)}; run `apogee cluster up` with the options it was "
                "started with, or `apogee cluster down` first (data is kept) to start it anew "
                "with these"
            )
        return _again(
            existing,
            running,
            wanted,
            console,
            console_env,
            binary,
            scrape_interval_s,
            prometheus_port,
            timeout,
        )
    # nothing runs: a new start, each member on the ports it had, else on free ones
    logs = data_dir / "logs"
    logs.mkdir(exist_ok=True)
    state = ClusterState(data_dir=str(data_dir))
    if existing is not None:  # left behind by a cluster that stopped without `down`
        ports.remember(existing)
    allot = ports.Allotment(set(), ports.recorded(data_dir), pick_port)
    services = [(svc, wanted[svc.role][1]) for svc in SERVICES if wanted[svc.role][0]]
    allot.check(
        [
            *(f"nameserver-{i}" for i in range(nameservers)),
            *(m for b in broker_names(brokers) for m in replica_names(b, replicas)),
            *(svc.role for svc, _ in services),
            *([CONSOLE] if console else []),
            *([PROMETHEUS] if binary is not None and prometheus_port is None else []),
        ]
    )
    started: list[tuple[Process, subprocess.Popen[bytes]]] = []
    try:
        for i in range(nameservers):
            name = f"nameserver-{i}"
            port = allot.port(name, NAMESERVER_PORT + i)
            argv = ["-m", "apogee_nameserver", "--listen", f"127.0.0.1:{port}"]
            env = dict(nameserver_env or {})
            metrics = allot.metrics(name, "NAMESERVER", NAMESERVER_METRICS_PORT + i, env)
            log = str(logs / f"{name}.log")
            address = f"127.0.0.1:{port}"
            member = Process("nameserver", name, address, 0, log, "", argv, env, metrics)
            started.append((member, _launch(state, member)))
            state.nameservers.append(member)
        for broker in broker_names(brokers):
            for name in replica_names(broker, replicas):
                step = 10 * len(state.brokers)
                port = allot.port(name, BROKER_PORT + step)
                bdir = str(data_dir / broker / name if replicas > 1 else data_dir / broker)
                argv = ["-m", "apogee_broker", "--listen", f"127.0.0.1:{port}", "--name", broker]
                argv += ["--data-dir", bdir, "--namesrv", state.namesrv]
                env = _broker_env(flush_mode, broker_env)
                if replicas > 1:
                    env.update(_replica_env(data_dir / broker / "group", replicas))
                metrics = allot.metrics(name, "BROKER", BROKER_METRICS_PORT + step, env)
                log = str(logs / f"{name}.log")
                address = f"127.0.0.1:{port}"
                member = Process("broker", name, address, 0, log, bdir, argv, env, metrics)
                started.append((member, _launch(state, member)))
                state.brokers.append(member)
        state.save()
        deadline = time.monotonic() + timeout
        health.wait_ready(state, started, deadline, timeout)
        # once the brokers are registered: the services find them at their start
        later = [_start_service(state, svc, allot, env) for svc, env in services]
        if console:
            later.append(_start_console(state, allot, console_env))
        started += later
        state.save()
        health.wait_healthy([p for p, _ in later], started, deadline, timeout)
        if binary is not None:  # last: it scrapes the others
            started.append(
                _start_prometheus(state, binary, scrape_interval_s, prometheus_port, allot)
            )
            state.save()
            _wait_prometheus(*started[-1], deadline)
    except BaseException:
        _kill_all([proc for _, proc in started])
        with contextlib.suppress(OSError):
            (data_dir / STATE_FILE).unlink()
        raise
    return state


def _optional(
    members: list[Process], running: set[str], wanted: bool
) -> tuple[list[Process], list[Process], bool]:
    """A member that may come and go, of a cluster that runs: (those kept, those of them to
    start again, whether to start one anew). A running one is left alone; one that has stopped
    is started again when wanted, else forgotten."""
    kept = [p for p in members if wanted or p.name in running]
    return kept, [p for p in kept if p.name not in running], wanted and not members


def _again(
    state: ClusterState,
    running: set[str],
    wanted: dict[str, tuple[bool, dict[str, str] | None]],
    console: bool,
    console_env: dict[str, str] | None,
    binary: str | None,
    scrape_interval_s: float,
    prometheus_port: int | None,
    timeout: float,
) -> ClusterState:
    """``up`` of a cluster that runs, in part or whole (``running``: the names of the members
    whose process lives): the others start again as recorded (on their ports), the nameservers
    and brokers first; the optional members wanted and not recorded start anew; the running
    ones are left alone (a running Prometheus reloads its rewritten configuration)."""
    data_dir = Path(state.data_dir)
    (data_dir / "logs").mkdir(exist_ok=True)
    core = [p for p in [*state.nameservers, *state.brokers] if p.name not in running]
    later: list[Process] = []
    new_services: list[tuple[Service, dict[str, str] | None]] = []
    for svc in SERVICES:
        want, env = wanted[svc.role]
        kept, dead, new = _optional(getattr(state, svc.field), running, want)
        setattr(state, svc.field, kept)
        later += dead
        new_services += [(svc, env)] if new else []
    state.console, dead, new_console = _optional(state.console, running, console)
    later += dead
    state.prometheus, dead_prometheus, new_prometheus = _optional(
        state.prometheus, running, binary is not None
    )
    for member in [*core, *later, *dead_prometheus]:
        ports.check_restartable(state, member)
    allot = ports.Allotment(_ports_taken(state), ports.recorded(data_dir), pick_port)
    allot.check(
        [
            *(svc.role for svc, _ in new_services),
            *([CONSOLE] if new_console else []),
            *([PROMETHEUS] if new_prometheus and prometheus_port is None else []),
        ]
    )
    started: list[tuple[Process, subprocess.Popen[bytes]]] = []
    try:
        started += [(p, _launch(state, p)) for p in core]
        state.save()
        deadline = time.monotonic() + timeout
        health.wait_ready(state, started, deadline, timeout)
        started += [(p, _launch(state, p)) for p in later]
        started += [_start_service(state, svc, allot, env) for svc, env in new_services]
        if new_console:
            started.append(_start_console(state, allot, console_env))
        state.save()
        optional = [*state.schedule, *state.txn_checker, *state.console]
        health.wait_healthy(optional, started, deadline, timeout)
        if binary is not None:  # last: it scrapes the others
            _prometheus_config(state, scrape_interval_s)
            if dead_prometheus:
                started.append((dead_prometheus[0], _launch(state, dead_prometheus[0])))
            elif new_prometheus:
                started.append(
                    _start_prometheus(state, binary, scrape_interval_s, prometheus_port, allot)
                )
            else:
                os.kill(state.prometheus[0].pid, signal.SIGHUP)
            state.save()
            if dead_prometheus or new_prometheus:
                _wait_prometheus(*started[-1], deadline)
    except BaseException:
        _kill_all([proc for _, proc in started])
        state.save()  # those it started are recorded stopped: the next `up` starts them again
        raise
    state.save()
    return state


def _start_service(
    state: ClusterState, svc: Service, allot: ports.Allotment, env: dict[str, str] | None
) -> tuple[Process, subprocess.Popen[bytes]]:
    """Spawn service ``svc`` of ``state`` (recorded in ``state.<svc.field>``)."""
    data_dir = Path(state.data_dir)
    sdir = data_dir / svc.role
    sdir.mkdir(exist_ok=True)
    port = allot.port(svc.role, svc.port)
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
    metrics = allot.metrics(svc.role, svc.env_prefix, svc.metrics_port, env)
    member = Process(
        svc.role, svc.role, f"127.0.0.1:{port}", 0, str(log), str(sdir), argv, env, metrics
    )
    setattr(state, svc.field, [member])
    return member, _launch(state, member)


def _start_console(
    state: ClusterState, allot: ports.Allotment, env: dict[str, str] | None
) -> tuple[Process, subprocess.Popen[bytes]]:
    """Spawn the web console for ``state``'s nameservers (recorded in ``state.console``)."""
    address = f"127.0.0.1:{allot.port(CONSOLE, webconsole.PORT)}"
    log = Path(state.data_dir) / "logs" / f"{CONSOLE}.log"
    argv = webconsole.argv(address, state.namesrv)
    env = dict(env or {})
    metrics = allot.metrics(CONSOLE, webconsole.ENV_PREFIX, webconsole.METRICS_PORT, env)
    member = Process(CONSOLE, CONSOLE, address, 0, str(log), "", argv, env, metrics)
    state.console = [member]
    return member, _launch(state, member)


def _launch(state: ClusterState, member: Process) -> subprocess.Popen[bytes]:
    """Start ``member`` of ``state`` as recorded (its command and environment); sets its pid."""
    proc = _spawn(
        member.argv,
        Path(member.log),
        member.env,
        python=member.role != PROMETHEUS,
        cluster=state.data_dir,
    )
    member.pid = proc.pid
    return proc


def _ports_taken(state: ClusterState) -> set[int]:
    return {
        port
        for p in state.all()
        for port in (ports.port_of(p.address), ports.port_of(p.metrics))
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
    state: ClusterState,
    binary: str,
    scrape_interval_s: float,
    port: int | None,
    allot: ports.Allotment,
) -> tuple[Process, subprocess.Popen[bytes]]:
    """Spawn Prometheus for ``state``'s members (recorded in ``state.prometheus``) on ``port``
    or the next free one (None: its recorded port, else 9090 or the next)."""
    config = _prometheus_config(state, scrape_interval_s)
    if port is None:
        address = f"127.0.0.1:{allot.port(PROMETHEUS, PROMETHEUS_PORT)}"
    else:
        address = f"127.0.0.1:{pick_port(port, allot.taken)}"
    argv = prometheus.command(config, config.parent / "data", address, binary)
    log = Path(state.data_dir) / "logs" / f"{PROMETHEUS}.log"
    member = Process(PROMETHEUS, PROMETHEUS, address, 0, str(log), str(config.parent), argv)
    state.prometheus = [member]
    return member, _launch(state, member)


def _wait_prometheus(member: Process, proc: subprocess.Popen[bytes], deadline: float) -> None:
    try:
        prometheus.wait_ready(member.address, deadline, proc, Path(member.log))
    except prometheus.PrometheusError as exc:
        raise ClusterError(str(exc)) from None


def restart(state: ClusterState, name: str, timeout: float = 60.0) -> Process:
    """Start member ``name`` again (after it died or was killed), as recorded and on its ports,
    and wait until it is healthy."""
    member = next((p for p in state.all() if p.name == name), None)
    if member is None:
        raise ClusterError(f"no member named {name!r} in {state.data_dir}")
    if pid_alive(member.pid):
        raise ClusterError(f"{name} is still running (pid {member.pid})")
    ports.check_restartable(state, member)
    proc = _launch(state, member)
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
    stopped). Their ports are kept in ``ports.json`` for the next ``up``."""
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
                # gone before `down` returns: an `up` right after finds its ports free
                gone = time.monotonic() + 5.0
                while pid_alive(p.pid) and time.monotonic() < gone:
                    time.sleep(0.05)  # waiting for another process's exit, with a deadline
                out.append((p, f"killed after {timeout:.0f}s"))
            else:
                out.append((p, "stopped"))
    ports.remember(state)
    (Path(state.data_dir) / STATE_FILE).unlink(missing_ok=True)
    return out
