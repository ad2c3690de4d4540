"""``python -m apogee_nameserver`` as a real process: healthy, serving, stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc.aio
import pytest

from apogee.rpc.server import check_health
from apogee.testkit.ports import free_port
from apogee.testkit.processes import taken_address
from apogee.testkit.waiting import eventually
from apogee.v1 import common_pb2, nameserver_pb2_grpc
from apogee.v1 import nameserver_pb2 as pb
from apogee_nameserver.__main__ import main

pytestmark = pytest.mark.integration

START_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0


def spawn(log: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
    env["APOGEE_NAMESERVER_METRICS_LISTEN"] = "127.0.0.1:0"
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "apogee_nameserver", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def output(log: Path) -> str:
    return log.read_text()


async def wait_healthy(proc: subprocess.Popen[bytes], address: str, log: Path) -> None:
    async def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}:\n{output(log)}")
        return await check_health(address, 0.5)

    await eventually(healthy, START_TIMEOUT, "healthy", every=0.05, detail=lambda: output(log))


async def test_the_process_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "nameserver.log"
    proc = spawn(log, "--listen", address, "--log-level", "info")
    try:
        await wait_healthy(proc, address, log)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = nameserver_pb2_grpc.NameServerStub(channel)
            topic = common_pb2.TopicConfig(name="Orders", read_queues=4, write_queues=4, perm=6)
            await stub.RegisterBroker(
                pb.RegisterBrokerRequest(
                    cluster="c", broker_name="b", address="b:10911", topics=[topic]
                ),
                timeout=5,
            )
            route = await stub.GetRoute(pb.GetRouteRequest(topic="Orders"), timeout=5)
            assert [b.address for b in route.brokers] == ["b:10911"]
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert proc.wait(timeout=STOP_TIMEOUT) == 0, log.read_text()
        assert time.monotonic() - started < STOP_TIMEOUT
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT)
    lines = log.read_text().splitlines()
    # structured, one line per record: <time> <LEVEL> <logger> <message>
    assert any(" INFO apogee.rpc.server nameserver listening on port " in line for line in lines)
    assert any(
        " INFO apogee_nameserver.core.registry broker b registered" in line for line in lines
    )
    assert lines[-1].endswith(" INFO apogee_nameserver.app nameserver stopped"), lines
    assert all(line[:4].isdigit() and line[10] == "T" for line in lines), lines


async def test_a_taken_port_exits_with_1_and_says_why(tmp_path: Path) -> None:
    with taken_address() as address:
        log = tmp_path / "nameserver.log"
        proc = spawn(log, "--listen", address)
        try:
            assert proc.wait(timeout=START_TIMEOUT) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT)
    assert f"nameserver could not start: nameserver cannot listen on {address}" in log.read_text()


def test_bad_settings_exit_with_2_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--listen", "nowhere"]) == 2
    assert capsys.readouterr().err == (
        "apogee-nameserver: listen: 'nowhere' must be host:port, with a port from 0 to 65535\n"
    )
