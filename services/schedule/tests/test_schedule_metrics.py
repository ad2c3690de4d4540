"""The schedule service's /metrics, scraped over HTTP while it delivers: the leadership gauge,
deliveries, the lateness histogram, the process metrics; and the broker's view of what waits
per level. How the gauge follows the leadership is LeaderApp's (libs/apogee-service tests)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from apogee.common.metrics import scrape
from apogee.testkit.waiting import eventually

pytestmark = pytest.mark.integration


async def test_deliveries_and_lateness_are_exported(
    cluster: Any, make_delayed: Any, make_timer: Any
) -> None:
    app = await cluster.start_schedule()
    await asyncio.wait_for(app.wait_active(), 5)
    assert app.metrics_server is not None
    m = await asyncio.to_thread(scrape, app.metrics_server.address)
    assert m.get_sample("apogee_schedule_leader") == 1
    assert m.get_sample("apogee_schedule_delivered_messages_total") == 0
    assert m.get_sample("apogee_schedule_delivery_lateness_seconds_count") == 0
    assert "process_cpu_seconds_total" in m.names()

    await cluster.send(make_delayed("d1", level=1), make_timer("t1", cluster.now_ms() + 200))
    await cluster.wait_delivered(2, 10)
    m = await asyncio.to_thread(scrape, app.metrics_server.address)
    assert m.get_sample("apogee_schedule_delivered_messages_total") == 2
    assert m.get_sample("apogee_schedule_delivery_lateness_seconds_count") == 2
    assert m.get_sample("apogee_schedule_delivery_lateness_seconds_bucket", le="+Inf") == 2
    late = m.get_sample("apogee_schedule_delivery_lateness_seconds_sum")
    assert late is not None
    assert 0 <= late < 5

    broker = cluster.broker.metrics_server
    assert broker is not None

    async def level_1_empty() -> bool:
        # the broker counts a level's waiting messages from the progress the schedule service
        # commits (every 0.2 s here), so the count reaches 0 a moment after the delivery
        b = await asyncio.to_thread(scrape, broker.address)
        return b.get_sample("apogee_broker_schedule_waiting_messages", level="1") == 0

    await eventually(level_1_empty, 5, "the broker's level-1 waiting count back to 0")
