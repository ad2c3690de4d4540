"""The schedule service's /metrics, scraped over HTTP while it delivers: deliveries, the
lateness histogram, the process metrics; and the broker's view of what waits per level. The
leadership gauge: of two replicas exactly one reads 1, the standby goes to 1 when the leader
stops, and a replica that loses its leadership goes back to 0."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from apogee.common.metrics import scrape
from apogee.rpc.testing import RevocableLeadership, eventually
from apogee_schedule.app import ScheduleApp

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


async def test_a_metrics_port_in_use_fails_the_start_naming_it(cluster: Any) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        app = ScheduleApp(cluster.schedule_settings(metrics_listen=taken))
        with pytest.raises(OSError, match=f"schedule cannot serve metrics on {taken}"):
            await app.start()
        await app.stop()


async def leader(app: ScheduleApp) -> float | None:
    """``apogee_schedule_leader`` as the replica's /metrics serves it."""
    assert app.metrics_server is not None
    m = await asyncio.to_thread(scrape, app.metrics_server.address)
    return m.get_sample("apogee_schedule_leader")


async def test_of_two_replicas_one_leads_and_the_standby_takes_over_when_it_stops(
    cluster: Any,
) -> None:
    first = await cluster.start_schedule(lock_poll_s=0.5)
    await asyncio.wait_for(first.wait_active(), 5)
    second = await cluster.start_schedule(lock_poll_s=0.5)  # tried the lock once: a standby
    assert (await leader(first), await leader(second)) == (1, 0)

    await first.stop()  # releases the lock
    assert first.registry.get_sample_value("apogee_schedule_leader") == 0

    # the standby's next try of the lock, then the work's first read of the brokers
    take_over_s = second.settings.lock_poll_s + second.settings.rpc_timeout_s

    async def second_leads() -> bool:
        return await leader(second) == 1

    await eventually(second_leads, take_over_s, "the standby's gauge at 1")
    assert second.active


async def test_a_replica_that_loses_its_leadership_reads_0(cluster: Any) -> None:
    leadership = RevocableLeadership()
    app = ScheduleApp(cluster.schedule_settings(), leadership=leadership)
    cluster.schedules.append(app)
    await app.start()
    await asyncio.wait_for(app.wait_active(), 5)
    assert await leader(app) == 1

    leadership.revoke()

    async def standby() -> bool:
        return await leader(app) == 0

    await eventually(standby, 5, "the gauge at 0 after the leadership was lost")
    assert not app.active
