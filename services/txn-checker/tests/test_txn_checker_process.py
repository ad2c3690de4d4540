"""``python -m apogee_txn_checker`` as real processes: an active one and a standby on one lock
file; ``kill -9`` of the active one hands over to the standby, which goes on checking; SIGTERM
stops cleanly; bad settings and a taken port exit with their codes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from apogee.rpc.server import check_health
from apogee_txn_checker.__main__ import main
from apogee_txn_checker.app import PROCESS_HEALTH


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}


class Replica:
    def __init__(self, tmp_path: Path, name: str, namesrv: str) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.log = tmp_path / f"{name}.log"
        env = clean_env()
        env.update(
            APOGEE_TXN_CHECKER_LOCK_POLL_S="0.1",
            APOGEE_TXN_CHECKER_CHECK_INTERVAL_S="1",
            APOGEE_TXN_CHECKER_IMMUNITY_S="0.5",
            APOGEE_TXN_CHECKER_MAX_CHECK_TIMES="1000",
            APOGEE_TXN_CHECKER_JITTER_MS="20",
            APOGEE_TXN_CHECKER_BROKER_REFRESH_S="0.2",
        )
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "apogee_txn_checker",
                    "--namesrv",
                    namesrv,
                    "--listen",
                    self.address,
                    "--lock-file",
                    str(tmp_path / "txn-checker.lock"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def output(self) -> str:
        return self.log.read_text()

    async def wait(self, check: Callable[[], Any], what: str, timeout: float = 15.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not await check():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{what} not within {timeout}s:\n{self.output()}")
            await asyncio.sleep(0.05)

    async def exited(self) -> bool:
        return self.proc.poll() is not None


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    started: list[Replica] = []
    try:
        yield started
    finally:
        for r in started:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait(5)


@pytest.mark.integration
@pytest.mark.slow
async def test_kill_9_of_the_active_replica_hands_over_to_the_standby(
    cluster: Any, replicas: list[Replica], tmp_path: Path
) -> None:
    first = Replica(tmp_path, "first", cluster.namesrv)
    replicas.append(first)

    async def first_serving() -> bool:
        return await check_health(first.address, 0.5)

    await first.wait(first_serving, "the first replica SERVING")
    second = Replica(tmp_path, "second", cluster.namesrv)
    replicas.append(second)

    async def second_standby() -> bool:
        return "standby: the holder of" in second.output()

    await second.wait(second_standby, "the second replica in standby")
    assert await check_health(second.address, 1, PROCESS_HEALTH)
    assert not await check_health(second.address, 1)

    sent = await cluster.send_half("order-9")  # no producer: checked every second

    async def checks(at_least: int) -> bool:
        return any(
            p.unique_id == sent.unique_id and p.check_times >= at_least
            for p in await cluster.pending()
        )

    await first.wait(lambda: checks(2), "two checks by the first replica")
    first.proc.kill()  # kill -9: its lock goes with it
    [p] = await cluster.pending()
    before = p.check_times

    async def second_serving() -> bool:
        return await check_health(second.address, 0.5)

    await second.wait(second_serving, "the second replica SERVING after the first died")
    await second.wait(lambda: checks(before + 2), "two more checks by the second replica")

    second.proc.send_signal(signal.SIGTERM)
    await second.wait(second.exited, "the second replica's exit", timeout=10)
    assert second.proc.returncode == 0
    lines = second.output().splitlines()
    assert all(line[:4].isdigit() and line[10] == "T" for line in lines), lines
    assert any(" INFO apogee.common.leadership active: holding the lock " in x for x in lines)
    assert " INFO apogee_txn_checker.app txn-checker stopped: " in lines[-1]
    # the copies the killed replica had checked have op records: the standby passes them by
    # the remove map and never meets one already closed
    assert lines[-1].endswith(" 0 closed, 0 errors"), lines[-1]


@pytest.mark.unit
def test_bad_settings_exit_with_2_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--namesrv", "nowhere"]) == 2
    assert capsys.readouterr().err == (
        "apogee-txn-checker: namesrv: 'nowhere' is not host:port (port 1 to 65535)\n"
    )


@pytest.mark.integration
def test_a_taken_port_exits_with_1_and_says_why(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "apogee_txn_checker",
                "--listen",
                address,
                "--lock-file",
                str(tmp_path / "l.lock"),
            ],
            capture_output=True,
            env=clean_env(),
            timeout=30,
            check=False,
        )
    assert done.returncode == 1
    assert f"txn-checker could not start: txn-checker cannot listen on {address}" in (
        done.stdout.decode()
    )
