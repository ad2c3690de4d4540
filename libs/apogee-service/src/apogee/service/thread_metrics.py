"""Per-thread CPU, wake-ups and preemptions of a service's process, as Prometheus counters.

A service's latency at moderate rates is mostly how often its threads hand work to each other
and how long each waits for a CPU, and both are counted by the kernel per thread
(``/proc/self/task/<tid>/status`` and ``stat``). :class:`ThreadCollector` reads them at each
scrape and exposes, per thread name:

- ``apogee_thread_cpu_seconds_total``: user plus system CPU time;
- ``apogee_thread_wakeups_total``: voluntary context switches (the thread slept, waiting for
  something, and was woken: a hand-off);
- ``apogee_thread_preemptions_total``: involuntary ones (the thread could have run on but was
  descheduled: the machine's CPUs were busy).

Names: ``main`` for the event loop's thread (the process's main thread), the Python name of
the others as the operating system shows it (:func:`apogee.common.threads.os_name`:
``store-dispatch``, ``store-flush``, ``grpc-poller``, ``uvloop_0``, ...), and the kernel's
name for threads Python does not know (gRPC's ``event_engine`` threads). Threads of one name
add up into one series; a thread that ends takes its counts with it, so a series may go down,
which ``rate()`` reads as a counter reset. Divided by a message rate, these give the wake-ups
and CPU each message costs each thread (``bench/latency_bench.py`` prints them so). Linux only:
elsewhere the collector yields nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from apogee.common.threads import os_name

TASKS: Final = Path("/proc/self/task")
_TICK: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _counts(tid: str) -> tuple[float, int, int] | None:
    """CPU seconds, voluntary and involuntary switches of thread ``tid``; None once gone."""
    try:
        stat = (TASKS / tid / "stat").read_text()
        status = (TASKS / tid / "status").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    woken = preempted = 0
    for line in status.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            woken = int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            preempted = int(line.split()[1])
    return cpu, woken, preempted


def thread_names() -> dict[str, str]:
    """Thread id (as in ``/proc``) -> its name, for the live threads of this process."""
    names: dict[str, str] = {}
    main = threading.main_thread().native_id
    python = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    try:
        tids = [p.name for p in TASKS.iterdir()]
    except OSError:
        return names
    for tid in tids:
        n = int(tid)
        if n == main:
            names[tid] = "main"
        elif n in python:
            names[tid] = os_name(python[n])
        else:
            try:
                names[tid] = (TASKS / tid / "comm").read_text().strip() or "thread"
            except OSError:
                continue
    return names


class ThreadCollector(Collector):
    """See the module docstring."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        cpu = CounterMetricFamily(
            "apogee_thread_cpu_seconds",
            "CPU time (user and system) of this process's threads, by thread name.",
            labels=["thread"],
        )
        woken = CounterMetricFamily(
            "apogee_thread_wakeups",
            "Times this process's threads slept and were woken (voluntary context switches), "
            "by thread name.",
            labels=["thread"],
        )
        preempted = CounterMetricFamily(
            "apogee_thread_preemptions",
            "Times this process's threads were descheduled while they could have run on "
            "(involuntary context switches), by thread name.",
            labels=["thread"],
        )
        sums: dict[str, list[float]] = {}
        for tid, name in thread_names().items():
            got = _counts(tid)
            if got is None:
                continue
            acc = sums.setdefault(name, [0.0, 0, 0])
            acc[0] += got[0]
            acc[1] += got[1]
            acc[2] += got[2]
        for name, (c, w, p) in sorted(sums.items()):
            cpu.add_metric([name], c)
            woken.add_metric([name], w)
            preempted.add_metric([name], p)
        yield cpu
        yield woken
        yield preempted
