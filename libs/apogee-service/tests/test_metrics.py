"""The shared metrics plumbing: a registry per app, the HTTP endpoint (bound, scraped,
stopped within its bound, a port in use named, started as settings say), the label cap, reads
on the loop, and the session failures of a service with a session per broker."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import pytest
from prometheus_client import Counter
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from apogee.common.metrics import OTHER, LabelCap, scrape
from apogee.service.metrics import (
    STOP_TIMEOUT_S,
    MetricsServer,
    new_registry,
    on_loop,
    session_failures,
    start_metrics,
    start_metrics_from,
)
from apogee.testkit.processes import taken_address

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
    with (
        taken_address() as taken,
        pytest.raises(OSError, match=f"svc cannot serve metrics on {taken}"),
    ):
        start_metrics(taken, new_registry(), "svc")
    assert start_metrics("", new_registry(), "svc") is None


@dataclass(frozen=True)
class PlainSettings:
    """Settings without TLS fields: plain HTTP."""

    metrics_listen: str


class Sessions(Collector):
    def collect(self) -> Iterable[Metric]:
        yield session_failures("apogee_test", 3)


def test_the_endpoint_starts_as_the_settings_say() -> None:
    assert start_metrics_from(PlainSettings(""), new_registry(), "svc") is None
    registry = new_registry()
    registry.register(Sessions())
    server = start_metrics_from(PlainSettings("127.0.0.1:0"), registry, "svc")
    assert server is not None
    try:
        m = scrape(server.address)
    finally:
        server.stop_now()
    assert m.get_sample("apogee_test_session_failures_total") == 3


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


def test_threads_are_counted_by_name_and_a_busy_one_shows() -> None:
    """The per-thread series name the main thread, Python's threads as the OS shows them, and
    count a thread's CPU and wake-ups: one that spins and sleeps in turn shows both."""
    registry = new_registry()
    go = threading.Event()
    done = threading.Event()
    release = threading.Event()

    def work() -> None:
        for _ in range(20):
            go.wait(5)
            end = time.thread_time() + 0.005
            while time.thread_time() < end:
                pass
            time.sleep(0.001)  # sleeping and waking is what the counter counts
        done.set()
        release.wait(10)  # alive while it is counted

    thread = threading.Thread(target=work, name="apogee-test-spinner", daemon=True)
    thread.start()
    go.set()
    assert done.wait(10)
    values = {
        (s.name, s.labels.get("thread")): s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name.startswith("apogee_thread_")
    }
    release.set()
    thread.join(5)
    assert values[("apogee_thread_cpu_seconds_total", "test-spinner")] >= 0.05
    assert values[("apogee_thread_wakeups_total", "test-spinner")] >= 20
    assert ("apogee_thread_preemptions_total", "test-spinner") in values
    assert ("apogee_thread_cpu_seconds_total", "main") in values
