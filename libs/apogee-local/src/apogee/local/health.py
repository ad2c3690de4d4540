"""The health of the local cluster's members, and the waits of ``apogee cluster up`` until they
are healthy: each answers its health check (gRPC ``grpc.health.v1``; the console ``GET
/healthz``; Prometheus ``GET /-/ready``), every broker is registered with every nameserver. A
member started for the wait whose process exits fails it at once, quoting its log; every wait
has a deadline (:class:`~apogee.local.processes.ClusterError` when it passes).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import grpc
import grpc.aio

from apogee.cli.local_state import CONSOLE, PROMETHEUS, ClusterState, Process
from apogee.local import processes, prometheus, webconsole
from apogee.local.processes import ClusterError
from apogee.rpc.security import ClientSecurity
from apogee.rpc.server import check_health
from apogee.v1 import nameserver_pb2, nameserver_pb2_grpc

#: a member just started, with its process
Started = tuple[Process, subprocess.Popen[bytes]]


async def healthy(p: Process) -> bool:
    """Whether member ``p`` answers its health check (within a second)."""
    if p.role == PROMETHEUS:
        return await asyncio.to_thread(prometheus.is_ready, p.address, 1.0)
    if p.role == CONSOLE:
        return await asyncio.to_thread(webconsole.healthy, p.address, p.env, 1.0)
    return await check_health(p.address, 1.0, tls=ClientSecurity.from_env().tls)


def status(state: ClusterState) -> list[tuple[Process, bool, bool]]:
    """(process, alive, healthy) for each member."""

    async def run() -> list[bool]:
        return list(await asyncio.gather(*(healthy(p) for p in state.all())))

    health = asyncio.run(run())
    return [(p, processes.pid_alive(p.pid), ok) for p, ok in zip(state.all(), health, strict=True)]


def wait_ready(
    state: ClusterState,
    started: list[Started],
    deadline: float,
    timeout: float,
) -> None:
    """Until the nameservers and brokers (those of them just ``started`` with their processes)
    are healthy and every broker is registered with every nameserver."""
    wait_healthy([*state.nameservers, *state.brokers], started, deadline, timeout)
    # every broker registered with every nameserver, so that routes work at once
    for ns in state.nameservers:
        while True:
            if registered_brokers(ns.address) >= {b.broker_name for b in state.brokers}:
                break
            check_running(started)  # another process may have answered on its port
            if time.monotonic() > deadline:
                raise ClusterError(f"brokers did not register with {ns.name} within {timeout:.0f}s")
            time.sleep(0.1)


def check_running(started: list[Started]) -> None:
    for member, proc in started:
        if proc.poll() is not None:
            raise ClusterError(
                f"{member.name} exited with code {proc.returncode} while starting; "
                f"see {member.log}:\n{processes.tail(Path(member.log))}"
            )


def wait_healthy(
    members: list[Process],
    started: list[Started],
    deadline: float,
    timeout: float,
) -> None:
    """Until every one of ``members`` answers its health check (those just ``started`` failing
    the wait when their process exits)."""
    pending = list(members)
    while pending:
        check_running(started)
        answers = status_subset(pending)
        pending = [p for p, ok in zip(pending, answers, strict=True) if not ok]
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
        return list(await asyncio.gather(*(healthy(p) for p in members)))

    return asyncio.run(run())
