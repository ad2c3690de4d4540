"""Test helpers for services run as real processes (``python -m <service>``).

:class:`ServiceProcess` starts one with the test's own ``APOGEE_*`` environment (the caller's is
left out) and its output in a file, shown when a wait fails. :class:`LeaderReplicas` starts
replicas of a leader-elected service (:mod:`apogee.service.leader_app`) on one lock file, each a
:class:`LeaderProcess` with its health service on a free port::

    replicas = LeaderReplicas("apogee_schedule", tmp_path, "schedule.lock")
    try:
        first, second = await replicas.active_and_standby(namesrv, "apogee.schedule.Process")
        first.proc.kill()
        await second.wait_serving("the second replica")
        assert await second.terminate() == 0
    finally:
        replicas.kill()

Also: :func:`quick_leader_settings` (a leader-elected service's app in the test's own process),
:func:`taken_address` and :func:`run_module` (a start that must fail). Free ports and polls with
a deadline are :mod:`apogee.testkit.ports` and :mod:`apogee.testkit.waiting`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from apogee.rpc.server import check_health
from apogee.testkit.ports import free_port
from apogee.testkit.waiting import eventually


def quick_leader_settings(namesrv: str, lock_file: Path) -> dict[str, Any]:
    """Settings of a leader-elected service for tests in this process: the health service and
    the metrics on free ports of 127.0.0.1, a standby trying ``lock_file`` every 50 ms, the
    broker list read every 200 ms, calls and stops bounded by 2 s."""
    return {
        "namesrv": namesrv,
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "lock_file": lock_file,
        "lock_poll_s": 0.05,
        "broker_refresh_s": 0.2,
        "rpc_timeout_s": 2.0,
        "shutdown_grace_s": 2.0,
    }


def service_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its ``APOGEE_*`` variables, every service's metrics
    on a free port of 127.0.0.1 (not the default ports, which tests running side by side would
    share), then ``env``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
    for service in ("NAMESERVER", "BROKER", "SCHEDULE", "TXN_CHECKER", "OPERATOR", "CONSOLE"):
        out[f"APOGEE_{service}_METRICS_LISTEN"] = "127.0.0.1:0"
    out.update(env or {})
    return out


@contextlib.contextmanager
def taken_address() -> Iterator[str]:
    """``127.0.0.1:<port>`` of a socket that listens there until the block ends."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield f"127.0.0.1:{taken.getsockname()[1]}"


def run_module(
    module: str, *args: str, timeout: float = 30.0
) -> subprocess.CompletedProcess[bytes]:
    """``python -m <module> <args>`` to its end, in :func:`service_env`; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        env=service_env(),
        timeout=timeout,
        check=False,
    )


class ServiceProcess:
    """``python -m <module> <args>`` in :func:`service_env` ``(env)``, its standard output and
    error in the file ``log``."""

    def __init__(
        self, module: str, args: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=service_env(env),
            )

    def output(self) -> str:
        return self.log.read_text()

    async def wait(
        self, check: Callable[[], Awaitable[bool]], what: str, timeout: float = 15.0
    ) -> None:
        """Poll ``check`` until it is true; fail naming ``what``, with the output, after
        ``timeout`` seconds."""
        await eventually(check, timeout, what, every=0.05, detail=self.output)

    async def exited(self) -> bool:
        return self.proc.poll() is not None

    async def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM, then wait for the exit (at most ``timeout`` seconds); the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        await self.wait(self.exited, "the exit after SIGTERM", timeout)
        return self.proc.returncode

    def kill(self) -> None:
        """``kill -9`` unless it has exited; waits for it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


class LeaderProcess(ServiceProcess):
    """A replica of a leader-elected service: ``python -m <module> --namesrv <namesrv>
    --listen <address> --lock-file <lock_file>``, ``address`` on a free port of 127.0.0.1."""

    def __init__(
        self,
        module: str,
        namesrv: str,
        lock_file: Path,
        log: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        args = ["--namesrv", namesrv, "--listen", self.address, "--lock-file", str(lock_file)]
        super().__init__(module, args, log, env)

    async def wait_serving(self, what: str) -> None:
        """Until the replica is active (its overall health SERVING)."""

        async def serving() -> bool:
            return await check_health(self.address, 0.5)

        await self.wait(serving, f"{what} SERVING")

    async def wait_standby(self, what: str) -> None:
        """Until the replica says it is a standby."""

        async def standby() -> bool:
            return "standby: the holder of" in self.output()

        await self.wait(standby, f"{what} in standby")


class LeaderReplicas:
    """Replicas of the service ``module`` on the lock file ``lock_name`` under ``folder``, each
    with ``env`` and its log ``<name>.log`` beside the lock."""

    def __init__(
        self, module: str, folder: Path, lock_name: str, env: Mapping[str, str] | None = None
    ) -> None:
        self.module = module
        self.folder = folder
        self.lock_file = folder / lock_name
        self.env = dict(env or {})
        self.started: list[LeaderProcess] = []

    def start(self, name: str, namesrv: str) -> LeaderProcess:
        log = self.folder / f"{name}.log"
        replica = LeaderProcess(self.module, namesrv, self.lock_file, log, self.env)
        self.started.append(replica)
        return replica

    async def active_and_standby(
        self, namesrv: str, process_health: str
    ) -> tuple[LeaderProcess, LeaderProcess]:
        """A first replica, once SERVING, and a second one, once a standby: SERVING as
        ``process_health`` (alive), NOT_SERVING overall."""
        first = self.start("first", namesrv)
        await first.wait_serving("the first replica")
        second = self.start("second", namesrv)
        await second.wait_standby("the second replica")
        assert await check_health(second.address, 1, process_health)
        assert not await check_health(second.address, 1)
        return first, second

    def kill(self) -> None:
        """``kill -9`` every replica still running."""
        for replica in self.started:
            replica.kill()


def kill_child_when_stopped(code: str, args: Mapping[str, object], what: str) -> None:
    """Run ``python -c code json(args)``, a child that prints ``OPEN`` lines and then
    ``STOPPED ...`` where it holds still, and kill it with SIGKILL there (a crash at that
    step). Fails when it does not stop within 60 s (``what``: where it should have), prints
    anything else, or leaves a traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def read_lines() -> None:
        for line in stdout:
            lines.put(line)

    reader = threading.Thread(target=read_lines, daemon=True)
    reader.start()
    try:
        while True:
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                raise AssertionError(f"the child did not reach {what} in 60s") from None
            if line.startswith("STOPPED"):
                break
            assert line.strip() == "OPEN", line
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        err = proc.stderr.read() if proc.stderr is not None else ""
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        reader.join(timeout=10)
    assert "Traceback" not in err, err
