"""A real etcd for tests: one member in a temporary folder, on free ports of 127.0.0.1 (or of
another address of this host: ``EtcdServer(folder, host="10.77.5.1")``).

:class:`EtcdServer` starts Debian's ``etcd`` (``scripts/system_packages.sh`` installs the
``etcd-server`` package), waits until it answers its ``/health`` (a poll with a deadline) and
stops it when the block ends, whatever happened in it: SIGTERM, then SIGKILL after a bounded
wait. :meth:`EtcdServer.paused` stops the process with SIGSTOP and continues it with SIGCONT,
for tests of an engine that no longer answers (its connections stay open, its calls hang)::

    with EtcdServer(tmp_path) as etcd:
        client = EtcdClient([etcd.endpoint], timeout_s=0.5)
        with etcd.paused():
            ...  # every call fails after its deadline

The fixture :func:`etcd_server` shares one such etcd across a test module. A module of any
package takes it in by naming it at its top level, then asks for it as an argument; tests that
share it keep apart by their keys (a prefix of their own)::

    from apogee.testkit import etcd as etcd_kit

    etcd_server = etcd_kit.etcd_server

    async def test_something(etcd_server: EtcdServer) -> None: ...

The member ticks fast (heartbeat 50 ms, election timeout 500 ms): it leads within a moment of
its start, and the shortest lease it grants is 1 s (etcd's floor is 1.5 election timeouts).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pytest

from apogee.testkit.ports import free_port
from apogee.testkit.waiting import wait_until

__all__ = ["EtcdServer", "etcd_binary", "etcd_server"]


def etcd_binary() -> str:
    """The path of ``etcd``; fails the test when it is not installed."""
    path = shutil.which("etcd")
    if path is None:
        pytest.fail(
            "etcd is not installed: run scripts/system_packages.sh (it installs Debian's "
            "etcd-server package)"
        )
    return path


class EtcdServer:
    """One etcd member with its data and its log (``etcd.log``) under ``folder``, serving
    clients on ``<host>:<free port>`` (:attr:`endpoint`; ``host`` is an IPv4 address of this
    host, 127.0.0.1 unless told). Started by :meth:`start` or ``with``; stopped by :meth:`stop`
    or the end of the ``with`` block."""

    def __init__(self, folder: Path, host: str = "127.0.0.1") -> None:
        self.folder = Path(folder)
        self.host = host
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        while self.peer_port == self.client_port:
            self.peer_port = free_port(host)
        #: what :class:`apogee.service.etcd.EtcdClient` takes: ``<host>:<port>``
        self.endpoint = f"{host}:{self.client_port}"
        self.client_url = f"http://{self.endpoint}"
        self.peer_url = f"http://{host}:{self.peer_port}"
        self.log = self.folder / "etcd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    def command(self) -> list[str]:
        return [
            etcd_binary(),
            "--name=default",
            f"--data-dir={self.folder / 'data'}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster=default={self.peer_url}",
            "--initial-cluster-state=new",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--logger=zap",
            "--log-outputs=stderr",
        ]

    def start(self, timeout: float = 30.0) -> None:
        """Start the member and wait (at most ``timeout`` seconds) until it answers; stopped
        again, and the test failed with its log, when it does not."""
        self.folder.mkdir(parents=True, exist_ok=True)
        # etcd reads ETCD_* variables as flags: the caller's must not change this member
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, env=env
            )
        try:
            wait_until(
                self.healthy,
                timeout,
                f"etcd on {self.endpoint} healthy",
                every=0.05,
                detail=self.output,
            )
        except BaseException:
            self.stop()
            raise

    def healthy(self) -> bool:
        """Whether the member answers ``/health`` with ``"health":"true"``; raises when the
        process has exited."""
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise AssertionError(
                f"etcd on {self.endpoint} is not running (exit {code})\n" + self.output()
            )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"{self.client_url}/health", timeout=0.5) as answer:
                body: bytes = answer.read()
        except OSError:  # refused, reset, timed out (urllib.error.URLError is one too)
            return False
        return b'"health":"true"' in body

    def output(self) -> str:
        """The member's log so far."""
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def pause(self) -> None:
        """SIGSTOP: the member keeps its connections and ports but answers nothing."""
        if self.proc is None:
            raise AssertionError("etcd is not started")
        self.proc.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.proc is not None and self._paused:
            self.proc.send_signal(signal.SIGCONT)
        self._paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Paused for the block, continued after it whatever happened in it."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (after SIGCONT when paused), then SIGKILL if it has not exited within
        ``timeout`` seconds; waits for the exit."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        if self._paused:
            proc.send_signal(signal.SIGCONT)
            self._paused = False
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the test module, in a temporary folder, stopped after its last test."""
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server
