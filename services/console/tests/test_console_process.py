"""``python -m apogee_console`` as a real process: serves /healthz and its own /metrics, stops
gracefully on SIGTERM within seconds, and refuses bad settings and a taken port."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from apogee.common.metrics import scrape
from apogee.testkit.processes import taken_address
from apogee.testkit.waiting import eventually

pytestmark = pytest.mark.integration

START_TIMEOUT = 20.0
STOP_TIMEOUT = 5.0


def spawn(log: Path, *args: str, **env: str) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "apogee_console", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**clean, **env},
        )


async def logged(log: Path, pattern: str, proc: subprocess.Popen[bytes]) -> re.Match[str]:
    """The first match of ``pattern`` in the process's log (it fails when the process exits
    or the log does not show it in time)."""
    found: list[re.Match[str]] = []

    def seen() -> bool:
        m = re.search(pattern, log.read_text())
        if m is None and proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}:\n{log.read_text()}")
        found[:] = [m] if m is not None else []
        return bool(found)

    await eventually(seen, START_TIMEOUT, repr(pattern), every=0.05, detail=log.read_text)
    return found[0]


async def test_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    proc = spawn(
        log,
        "--listen",
        "127.0.0.1:0",
        "--namesrv",
        "127.0.0.1:1",
        APOGEE_CONSOLE_METRICS_LISTEN="127.0.0.1:0",
        APOGEE_CONSOLE_REQUEST_TIMEOUT_S="0.5",
    )
    try:
        serving = await logged(log, r"console serving http://127\.0\.0\.1:(\d+)", proc)
        metrics = await logged(log, r"console serving /metrics on (127\.0\.0\.1:\d+)", proc)
        base = f"http://127.0.0.1:{serving.group(1)}"
        async with httpx.AsyncClient(base_url=base) as client:
            health = await client.get("/healthz")
            assert (health.status_code, health.text) == (200, "ok")
            assert (await client.get("/readyz")).status_code == 503  # no nameserver there
        assert "open: authentication is off" in log.read_text()
        samples = await asyncio.to_thread(scrape, metrics.group(1))
        assert (
            samples.get_sample(
                "apogee_console_requests_total", route="/healthz", method="GET", status="200"
            )
            == 1
        )
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert await asyncio.to_thread(proc.wait, STOP_TIMEOUT) == 0
        assert time.monotonic() - started < STOP_TIMEOUT
        assert "console stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_bad_settings_and_a_taken_port(tmp_path: Path) -> None:
    bad = spawn(tmp_path / "bad.log", "--listen", "nowhere")
    assert await asyncio.to_thread(bad.wait, START_TIMEOUT) == 2
    assert "listen: 'nowhere' is not host:port" in (tmp_path / "bad.log").read_text()

    with taken_address() as address:
        proc = spawn(tmp_path / "taken.log", "--listen", address, APOGEE_CONSOLE_METRICS_LISTEN="")
        assert await asyncio.to_thread(proc.wait, START_TIMEOUT) == 1
    assert f"cannot listen on {address}" in (tmp_path / "taken.log").read_text()


async def test_serves_https_with_its_certificate(tmp_path: Path) -> None:
    from apogee.testkit.tls import TestCa  # noqa: PLC0415 - needs cryptography (dev)

    ca = TestCa.create(tmp_path / "ca")
    cert = ca.issue("console", tmp_path / "console")
    log = tmp_path / "console.log"
    proc = spawn(
        log,
        "--listen",
        "127.0.0.1:0",
        "--namesrv",
        "127.0.0.1:1",
        APOGEE_CONSOLE_METRICS_LISTEN="",
        APOGEE_CONSOLE_TLS_CERT_FILE=str(cert.cert_file),
        APOGEE_CONSOLE_TLS_KEY_FILE=str(cert.key_file),
        APOGEE_CONSOLE_TLS_CA_FILE=str(ca.cert_file),
    )
    try:
        serving = await logged(log, r"console serving https://127\.0\.0\.1:(\d+)", proc)
        base = f"https://127.0.0.1:{serving.group(1)}"
        ctx = ssl.create_default_context(cafile=str(ca.cert_file))
        async with httpx.AsyncClient(base_url=base, verify=ctx) as client:
            assert (await client.get("/healthz")).text == "ok"
        async with httpx.AsyncClient(base_url=base.replace("https", "http")) as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.get("/healthz")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, STOP_TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
