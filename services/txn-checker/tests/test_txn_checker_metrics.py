"""The transaction checker's /metrics, scraped over HTTP while it checks a half message no
producer answers for: check outcomes, rounds, the last round's duration; and the broker's
pending and given-up transactions. The leadership gauge: of two replicas exactly one reads 1,
the standby goes to 1 when the leader stops, and a replica that loses its leadership goes back
to 0."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from apogee.common.metrics import Samples, scrape
from apogee.rpc.testing import RevocableLeadership, eventually
from apogee_txn_checker.app import TxnCheckerApp

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_check_outcomes_and_rounds_are_exported(cluster: Any) -> None:
    checker = await cluster.start_checker(immunity_s=1.0, max_check_times=2)
    assert checker.metrics_server is not None
    address = checker.metrics_server.address
    broker_address = cluster.broker.metrics_server.address
    await cluster.send_half("order-9")
    b = await asyncio.to_thread(scrape, broker_address)
    assert b.get_sample("apogee_broker_txn_half_pending") == 1

    async def given_up() -> bool:
        m: Samples = await asyncio.to_thread(scrape, address)
        return m.get_sample("apogee_txn_checker_checks_total", result="gave_up") == 1

    await eventually(given_up, 15, "the checker giving up on the half")
    m = await asyncio.to_thread(scrape, address)
    assert m.get_sample("apogee_txn_checker_checks_total", result="no_producer") == 2
    assert m.get_sample("apogee_txn_checker_checks_total", result="error") == 0
    assert (m.get_sample("apogee_txn_checker_rounds_total") or 0) >= 1
    assert "apogee_txn_checker_last_round_duration_seconds" in m.names()
    assert m.get_sample("apogee_txn_checker_leader") == 1
    assert "python_gc_objects_collected_total" in m.names()

    b = await asyncio.to_thread(scrape, broker_address)
    assert b.get_sample("apogee_broker_txn_half_pending") == 0
    assert b.get_sample("apogee_broker_txn_half_given_up") == 1
    assert b.get_sample("apogee_broker_txn_half_oldest_age_seconds") is None
    assert b.get_sample("apogee_broker_txn_checks_total", outcome="GAVE_UP") == 1


async def test_a_metrics_port_in_use_fails_the_start_naming_it(cluster: Any) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        app = TxnCheckerApp(cluster.checker_settings(metrics_listen=taken))
        with pytest.raises(OSError, match=f"txn-checker cannot serve metrics on {taken}"):
            await app.start()
        await app.stop()


async def leader(app: TxnCheckerApp) -> float | None:
    """``apogee_txn_checker_leader`` as the replica's /metrics serves it."""
    assert app.metrics_server is not None
    m = await asyncio.to_thread(scrape, app.metrics_server.address)
    return m.get_sample("apogee_txn_checker_leader")


async def test_of_two_replicas_one_leads_and_the_standby_takes_over_when_it_stops(
    cluster: Any,
) -> None:
    first = await cluster.start_checker(lock_poll_s=0.5)
    await asyncio.wait_for(first.wait_active(), 5)
    second = await cluster.start_checker(lock_poll_s=0.5)  # tried the lock once: a standby
    assert (await leader(first), await leader(second)) == (1, 0)

    await first.stop()  # releases the lock
    assert first.registry.get_sample_value("apogee_txn_checker_leader") == 0

    # the standby's next try of the lock, then the work's first read of the brokers
    take_over_s = second.settings.lock_poll_s + second.settings.rpc_timeout_s

    async def second_leads() -> bool:
        return await leader(second) == 1

    await eventually(second_leads, take_over_s, "the standby's gauge at 1")
    assert second.active


async def test_a_replica_that_loses_its_leadership_reads_0(cluster: Any) -> None:
    leadership = RevocableLeadership()
    app = TxnCheckerApp(cluster.checker_settings(), leadership=leadership)
    cluster.checkers.append(app)
    await app.start()
    await asyncio.wait_for(app.wait_active(), 5)
    assert await leader(app) == 1

    leadership.revoke()

    async def standby() -> bool:
        return await leader(app) == 0

    await eventually(standby, 5, "the gauge at 0 after the leadership was lost")
    assert not app.active
