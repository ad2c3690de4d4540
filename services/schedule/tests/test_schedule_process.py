"""``python -m apogee_schedule`` as real processes: an active one and a standby on one lock
file; ``kill -9`` of the active one hands over to the standby and loses nothing; SIGTERM stops
cleanly."""

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
from apogee.v1 import common_pb2
from apogee_schedule.__main__ import main
from apogee_schedule.app import PROCESS_HEALTH

pytestmark = [pytest.mark.integration, pytest.mark.slow]

Make = Callable[..., common_pb2.Message]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Replica:
    def __init__(self, tmp_path: Path, name: str, namesrv: str) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.log = tmp_path / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
        env.update(
            APOGEE_SCHEDULE_LOCK_POLL_S="0.1",
            APOGEE_SCHEDULE_SCAN_HOLD_MS="200",
            APOGEE_SCHEDULE_PROGRESS_INTERVAL_S="0.2",
        )
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "apogee_schedule",
                    "--namesrv",
                    namesrv,
                    "--listen",
                    self.address,
                    "--lock-file",
                    str(tmp_path / "schedule.lock"),
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


async def test_kill_9_of_the_active_replica_hands_over_and_loses_nothing(
    cluster: Any, make_timer: Make, replicas: list[Replica], tmp_path: Path
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

    t0 = cluster.now_ms()
    msgs = [make_timer(f"t{i}", t0 + 300 + 100 * i, queue_id=i % 2) for i in range(30)]
    await cluster.send(*msgs)
    await cluster.wait_delivered(5, timeout=10)
    first.proc.kill()  # kill -9: its lock goes with it

    async def second_serving() -> bool:
        return await check_health(second.address, 0.5)

    await second.wait(second_serving, "the second replica SERVING after the first died")
    got = await cluster.wait_delivered(len(msgs), timeout=15)
    due = {m.body.decode(): m.deliver_at_ms for m in msgs}
    assert {m.body.decode() for m in got} == set(due)  # duplicates allowed after a crash
    assert [m.body for m in got if m.store_timestamp < due[m.body.decode()]] == []

    second.proc.send_signal(signal.SIGTERM)
    await second.wait(second.exited, "the second replica's exit", timeout=10)
    assert second.proc.returncode == 0
    lines = second.output().splitlines()
    assert all(line[:4].isdigit() and line[10] == "T" for line in lines), lines
    assert any(" INFO apogee.common.leadership active: holding the lock " in x for x in lines)
    assert " INFO apogee_schedule.app schedule service stopped: delivered " in lines[-1]


def test_bad_settings_exit_with_2_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--namesrv", "nowhere"]) == 2
    assert capsys.readouterr().err == (
        "apogee-schedule: namesrv: 'nowhere' is not host:port (port 1 to 65535)\n"
    )


def test_a_taken_port_exits_with_1_and_says_why(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "apogee_schedule",
                "--listen",
                address,
                "--lock-file",
                str(tmp_path / "l.lock"),
            ],
            capture_output=True,
            env=env,
            timeout=30,
            check=False,
        )
    assert done.returncode == 1
    assert f"schedule service could not start: schedule cannot listen on {address}" in (
        done.stdout.decode()
    )
