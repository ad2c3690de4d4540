"""The expiry loop drops silent brokers on its own, logs them, and stops promptly."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from apogee.common.clock import ManualClock
from apogee.common.errors import InvalidArgumentError
from apogee.common.topics import TopicConfig
from apogee.testkit.waiting import eventually
from apogee_nameserver.core.expiry import ExpiryLoop
from apogee_nameserver.core.registry import RouteRegistry

pytestmark = pytest.mark.unit


async def test_silent_brokers_are_dropped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    registry = RouteRegistry(expiry_s=120.0, clock=clock)
    registry.register_broker("east", "broker-a", "a:10911", [TopicConfig("Orders", 4, 4, 6)])
    registry.register_broker("east", "broker-b", "b:10911", [])
    loop = ExpiryLoop(registry, scan_interval_s=0.01, clock=clock)
    caplog.set_level(logging.WARNING, logger="apogee_nameserver.core.expiry")
    loop.start()
    try:
        await eventually(lambda: loop.scans >= 2, 5, "two scans")
        assert len(registry.cluster_info()) == 2  # not silent yet: nothing dropped
        clock.advance(100)
        registry.register_broker("east", "broker-b", "b:10911", [])  # b heartbeats, a does not
        clock.advance(20.5)
        await eventually(lambda: "broker-a" in caplog.text, 5, "broker-a dropped")
    finally:
        await loop.stop()
    assert [i.broker_name for i in registry.cluster_info()] == ["broker-b"]
    [record] = [r for r in caplog.records if r.name == "apogee_nameserver.core.expiry"]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "broker broker-a (a:10911, cluster east) dropped: no heartbeat for 120.5s "
        "(expiry 120.0s); its routes are gone until it registers again"
    )


async def test_stop_is_prompt_even_with_a_long_interval() -> None:
    loop = ExpiryLoop(RouteRegistry(clock=ManualClock()), scan_interval_s=3600)
    loop.start()
    await asyncio.sleep(0)  # let it start waiting
    started = time.monotonic()
    await loop.stop(timeout=2.0)
    assert time.monotonic() - started < 1.0
    assert loop.scans == 0
    await loop.stop()  # a second stop does nothing


async def test_a_failing_scan_is_logged_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = RouteRegistry(clock=ManualClock())
    calls = 0
    real_expire = registry.expire

    def flaky() -> list[object]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("disk on fire")
        return list(real_expire())

    monkeypatch.setattr(registry, "expire", flaky)
    loop = ExpiryLoop(registry, scan_interval_s=0.01)
    with caplog.at_level(logging.ERROR):
        loop.start()
        try:
            await eventually(lambda: loop.scans >= 2, 5, "two scans")
        finally:
            await loop.stop()
    assert "the expiry scan failed" in caplog.text
    assert "disk on fire" in caplog.text


@pytest.mark.parametrize("interval", [0.0, -5.0])
def test_the_scan_interval_must_be_positive(interval: float) -> None:
    with pytest.raises(InvalidArgumentError, match="scan_interval_s: must be greater than 0"):
        ExpiryLoop(RouteRegistry(), scan_interval_s=interval)
