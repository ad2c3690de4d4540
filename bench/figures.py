"""The figures every Apogee benchmark prints: one JSON object per line with at least
``case, messages, msg_bytes, seconds, msgs_per_s, mb_per_s, p50_us, p99_us, rss_mb``; and
what the benchmarks share besides: the CPU and memory of the services' processes
(:class:`ProcessMeter`) and the event loop they run on (:func:`loop_name`, :func:`run_async`)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

MiB = 1 << 20


def rss_mb() -> float:
    """Peak resident memory of this process, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def emit(
    case: str, messages: int, msg_bytes: int, seconds: float, lat_s: list[float], **extra: Any
) -> None:
    """Print one result line; ``lat_s`` are latencies in seconds (sorted here)."""
    lat_s.sort()
    row: dict[str, Any] = {
        "case": case,
        "messages": messages,
        "msg_bytes": msg_bytes,
        "seconds": round(seconds, 4),
        "msgs_per_s": round(messages / seconds) if seconds else 0,
        "mb_per_s": round(messages * msg_bytes / seconds / MiB, 1) if seconds else 0,
        "p50_us": round(percentile(lat_s, 0.50) * 1e6, 1),
        "p99_us": round(percentile(lat_s, 0.99) * 1e6, 1),
        "rss_mb": round(rss_mb(), 1),
    }
    row.update(extra)
    print(json.dumps(row), flush=True)


async def paced(rate: float, count: int) -> AsyncIterator[bool]:
    """Yield ``count`` turns on a schedule of ``rate`` per second from now, sleeping until each
    is due; each turn says whether it came over 1 ms late (the caller fell behind)."""
    t0 = time.perf_counter()
    for i in range(count):
        wait = t0 + i / rate - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)  # pacing an open loop, not synchronisation
        yield wait < -0.001


class ProcessMeter:
    """CPU seconds and resident memory of another process, from /proc."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._tick = os.sysconf("SC_CLK_TCK")

    def cpu_s(self) -> float:
        try:
            raw = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return 0.0
        fields = raw.rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime, stime

    def rss_mb(self) -> float:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0


def loop_name(choice: str | None = None) -> str:
    """The event loop to run on: ``choice`` (``--loop``), else uvloop when it is installed."""
    if choice is not None:
        return choice
    try:
        import uvloop  # noqa: F401, PLC0415 - optional
    except ImportError:
        return "asyncio"
    return "uvloop"


def run_async(coro: Coroutine[Any, Any, None], loop: str) -> None:
    """Run ``coro`` to the end on a new event loop of kind ``loop`` (see :func:`loop_name`)."""
    if loop == "uvloop":
        import uvloop  # noqa: PLC0415 - optional

        uvloop.run(coro)
    else:
        asyncio.run(coro)
