"""What the scale benchmarks share: a fresh one-broker cluster per step (:class:`Step`), what
/proc says of a process, and running a coroutine to its end from plain code."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from figures import run_async

from apogee.local import cluster as local_cluster
from apogee.local.processes import pid_alive

#: the broker writes offsets this often here (the default is 5 s), so a step waits less
PERSIST_INTERVAL_S = 1.0

# -- what /proc says of a process ---------------------------------------------------------------


def proc_facts(pid: int) -> dict[str, float]:
    """Resident memory (MiB), open files and memory maps of process ``pid``."""
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/maps", "rb") as f:
        maps = sum(1 for _ in f)
    return {"rss_mb": round(rss_kib / 1024, 1), "fds": fds, "maps": maps}


def fd_limit(pid: int) -> int:
    """Process ``pid``'s limit on open files (the soft one, which it meets first)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    return 0


def dir_bytes(root: Path) -> dict[str, tuple[int, int, float]]:
    """Every file under ``root``: its size, inode and modification time."""
    out: dict[str, tuple[int, int, float]] = {}
    for p in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            if p.is_file():
                out[str(p.relative_to(root))] = (st.st_size, st.st_ino, st.st_mtime)
    return out


# -- a cluster per step -------------------------------------------------------------------------


class Step:
    """A fresh one-broker cluster in its own directory, every member on a free port; ``with
    Step(...) as s:``. The schedule service and the transaction checker run only when asked;
    ``broker_env`` and ``service_env`` are added to the broker's and to those services'
    environments."""

    def __init__(
        self,
        base: Path,
        name: str,
        broker_env: dict[str, str] | None = None,
        schedule: bool = False,
        txn_checker: bool = False,
        service_env: dict[str, str] | None = None,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"scale-{name}-", dir=base))
        self.env = {"APOGEE_BROKER_OFFSET_PERSIST_INTERVAL_S": str(PERSIST_INTERVAL_S)}
        self.env.update(broker_env or {})
        self.schedule = schedule
        self.txn_checker = txn_checker
        self.service_env = service_env or {}
        self._up(60)

    def _up(self, timeout: float) -> None:
        if not (self.dir / "ports.json").exists():  # every member on a free port
            members = ["nameserver-0", "broker-a"]
            members += ["schedule"] * self.schedule + ["txn-checker"] * self.txn_checker
            ports = free_ports(2 * len(members))
            (self.dir / "ports.json").write_text(
                json.dumps(
                    {
                        name: {
                            "address": f"127.0.0.1:{ports[2 * i]}",
                            "metrics": f"127.0.0.1:{ports[2 * i + 1]}",
                        }
                        for i, name in enumerate(members)
                    }
                )
            )
        self.state = local_cluster.up(
            self.dir,
            brokers=1,
            nameservers=1,
            flush_mode="async",
            broker_env=self.env,
            schedule=self.schedule,
            schedule_env=self.service_env,
            txn_checker=self.txn_checker,
            txn_checker_env=self.service_env,
            console=False,
            timeout=timeout,
        )
        self.broker = self.state.brokers[0]

    @property
    def namesrv(self) -> str:
        return self.state.namesrv

    @property
    def pid(self) -> int:
        return self.broker.pid

    def restart_broker_after_kill(self) -> float:
        """``kill -9`` the broker, start it again; seconds until it is up and registered."""
        os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        t0 = time.perf_counter()
        self._up(600)
        return time.perf_counter() - t0

    def broker_alive(self) -> bool:
        return pid_alive(self.pid)

    def __enter__(self) -> Step:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            local_cluster.down(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now (held together while the system picks them)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


async def bounded(concurrency: int, calls: Iterable[Callable[[], Awaitable[Any]]]) -> None:
    """Run ``calls``, at most ``concurrency`` at a time; the first failure is raised."""
    room = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        async with room:
            await call()

    await asyncio.gather(*(one(c) for c in calls))


def run(coro: Awaitable[Any]) -> Any:
    out: list[Any] = []

    async def main() -> None:
        out.append(await coro)

    run_async(main(), "asyncio")
    return out[0]
