"""The charts' series from a Prometheus server's HTTP API (``/api/v1/query_range``), when
``prometheus_url`` is set. The queries read the brokers' own metrics (docs/metrics.md):

- a topic's rate: ``sum(rate(apogee_broker_messages_in_total{topic="T"}[1m]))``
- a group's lag: ``sum(apogee_broker_group_lag_messages{group="G"})``
- the schedule backlog: ``sum by (level) (apogee_broker_schedule_waiting_messages)``
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Final

import httpx

from apogee.common.errors import UnavailableError
from apogee_console.core.views import Json

#: Points per chart at most (the step grows with the window).
MAX_POINTS: Final = 240


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def topic_rate_query(topic: str) -> str:
    return f'sum(rate(apogee_broker_messages_in_total{{topic="{_quote(topic)}"}}[1m]))'


def group_lag_query(group: str) -> str:
    return f'sum(apogee_broker_group_lag_messages{{group="{_quote(group)}"}})'


SCHEDULE_QUERY: Final = "sum by (level) (apogee_broker_schedule_waiting_messages)"


class PrometheusSource:
    """Range queries against ``url`` (see the module docstring)."""

    def __init__(
        self,
        url: str,
        timeout: float,
        clock: Callable[[], float] = time.time,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.clock = clock
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport)

    async def close(self) -> None:
        await self._client.aclose()

    async def query_range(self, query: str, minutes: float, label: str | None) -> Json:
        end = self.clock()
        start = end - minutes * 60
        step = max(1.0, math.ceil(minutes * 60 / MAX_POINTS))
        try:
            resp = await self._client.get(
                f"{self.url}/api/v1/query_range",
                params={"query": query, "start": start, "end": end, "step": step},
            )
            body: Any = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise UnavailableError(what=f"Prometheus at {self.url}", detail=str(exc)) from None
        if resp.status_code != 200 or body.get("status") != "success":
            detail = body.get("error") if isinstance(body, dict) else None
            raise UnavailableError(
                what=f"Prometheus at {self.url}",
                detail=f"HTTP {resp.status_code}: {detail or 'no result'}",
            )
        series = []
        for r in body["data"]["result"]:
            name = label or r["metric"].get("level") or "value"
            points = [[float(t), float(v)] for t, v in r["values"] if v not in ("NaN", "+Inf")]
            series.append({"label": name, "points": points})
        return {"source": "prometheus", "series": series}
