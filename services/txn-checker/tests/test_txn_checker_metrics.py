"""The transaction checker's /metrics, scraped over HTTP while it checks a half message no
producer answers for: check outcomes, rounds, the last round's duration, the leadership gauge;
and the broker's pending and given-up transactions. How the gauge follows the leadership is
LeaderApp's (libs/apogee-service tests)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from apogee.common.metrics import Samples, scrape
from apogee.testkit.waiting import eventually

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
