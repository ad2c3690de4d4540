"""The figures every Apogee benchmark prints: one JSON object per line with at least
``case, messages, msg_bytes, seconds, msgs_per_s, mb_per_s, p50_us, p99_us, rss_mb``."""

from __future__ import annotations

import json
import resource
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
