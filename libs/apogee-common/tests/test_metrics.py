"""The shared metrics plumbing: a registry per app, the HTTP endpoint (bound, scraped,
stopped within its bound, a port in use named), the label cap, and reads on the loop."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from prometheus_client import Counter

from apogee.common.metrics import (
    OTHER,
    STOP_TIMEOUT_S,
    LabelCap,
    MetricsServer,
    new_registry,
    on_loop,
    scrape,
    start_metrics,
)

pytestmark = pytest.mark.unit


def test_each_registry_is_its_own_with_the_process_metrics() -> None:
    a, b = new_registry(), new_registry()
    Counter("apogee_test_things", "Things.", registry=a).inc(3)
    Counter("apogee_test_things", "Things.", registry=b)  # no clash: another registry
    server = MetricsServer("127.0.0.1:0", a, "test")
    server.start()
    try:
        m = scrape(server.address)
    finally:
        began = time.monotonic()
        server.stop_now()
        assert time.monotonic() - began < STOP_TIMEOUT_S + 1
    assert m.get_sample("apogee_test_things_total") == 3
    for name in ("process_cpu_seconds_total", "python_gc_collections_total", "python_info"):
        assert name in m.names(), name
    server.stop_now()  # twice is fine


def test_a_port_in_use_is_named_and_empty_means_no_endpoint() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        with pytest.raises(OSError, match=f"svc cannot serve metrics on {taken}"):
            start_metrics(taken, new_registry(), "svc")
    assert start_metrics("", new_registry(), "svc") is None


def test_the_label_cap_keeps_the_first_values_and_counts_the_rest_as_other() -> None:
    cap = LabelCap(2)
    assert [cap(v) for v in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER, "a", OTHER, "b"]
    assert len(cap) == 2
    assert LabelCap(0)("a") == OTHER


def _record_thread(where: list[threading.Thread]) -> int:
    where.append(threading.current_thread())
    return 7


def _block_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # stands for a loop too busy to answer a scrape


async def test_on_loop_runs_there_and_gives_up_after_its_bound() -> None:
    loop = asyncio.get_running_loop()
    where: list[threading.Thread] = []
    got = await asyncio.to_thread(on_loop, loop, lambda: _record_thread(where), 2.0)
    assert got == 7
    assert where == [threading.main_thread()]
    assert on_loop(loop, lambda: 8, 0.1) == 8  # on the loop itself: called at once

    blocked = loop.run_in_executor(None, on_loop, loop, lambda: 9, 0.05)
    _block_the_loop(0.3)
    assert await blocked is None  # the read timed out rather than waiting
