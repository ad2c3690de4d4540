"""The schedule service's /metrics, scraped over HTTP while it delivers: deliveries, the
lateness histogram, the process metrics; and the broker's view of what waits per level."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from apogee.common.metrics import scrape
from apogee_schedule.app import ScheduleApp

pytestmark = pytest.mark.integration


async def test_deliveries_and_lateness_are_exported(
    cluster: Any, make_delayed: Any, make_timer: Any
) -> None:
    app = await cluster.start_schedule()
    await asyncio.wait_for(app.wait_active(), 5)
    assert app.metrics_server is not None
    m = await asyncio.to_thread(scrape, app.metrics_server.address)
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
    b = await asyncio.to_thread(scrape, broker.address)
    assert b.get_sample("apogee_broker_schedule_waiting_messages", level="1") == 0


async def test_a_metrics_port_in_use_fails_the_start_naming_it(cluster: Any) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        app = ScheduleApp(cluster.schedule_settings(metrics_listen=taken))
        with pytest.raises(OSError, match=f"schedule cannot serve metrics on {taken}"):
            await app.start()
        await app.stop()
