"""The broker's /metrics, scraped over HTTP from a running broker: traffic per topic, lag of a
group (absent until it can be computed), retries and dead letters, pending transactions, the
cap on topic labels, and a metrics port in use failing the start."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.common.metrics import Samples, scrape
from apogee.testkit.broker import pull, running_broker, small_settings
from apogee.testkit.processes import taken_address
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    consumer_pb2,
    consumer_pb2_grpc,
    transaction_pb2,
    transaction_pb2_grpc,
)
from apogee_broker.app import BrokerApp

pytestmark = pytest.mark.integration

TOPIC = "Orders"
GROUP = "billing"


def settings(tmp_path: Path, **extra: Any) -> Any:
    return small_settings(tmp_path / "broker", broker_name="b1", auto_create_topics=True, **extra)


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[BrokerApp]:
    async with running_broker(settings(tmp_path)) as app:
        yield app


@pytest.fixture
async def channel(app: BrokerApp) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(app.address) as ch:
        yield ch


async def metrics(app: BrokerApp) -> Samples:
    assert app.metrics_server is not None
    return await asyncio.to_thread(scrape, app.metrics_server.address)


async def send(ch: grpc.aio.Channel, topic: str, *bodies: bytes) -> list[broker_pb2.SendResult]:
    resp = await broker_pb2_grpc.BrokerStub(ch).SendMessages(
        broker_pb2.SendMessagesRequest(
            messages=[common_pb2.Message(topic=topic, body=b, queue_id=0) for b in bodies]
        ),
        timeout=5,
    )
    return list(resp.results)


async def commit(ch: grpc.aio.Channel, offset: int) -> None:
    await consumer_pb2_grpc.ConsumerStub(ch).CommitOffsets(
        consumer_pb2.CommitOffsetsRequest(
            group=GROUP,
            offsets=[consumer_pb2.QueueOffset(topic=TOPIC, queue_id=0, offset=offset)],
            client_id="c1",
        ),
        timeout=5,
    )


async def test_traffic_lag_and_dead_letters_as_a_user_reads_them(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    sent = await send(channel, TOPIC, b"one", b"two", b"three")
    assert all(r.queue_offset >= 0 for r in sent)
    m = await metrics(app)
    assert m.get_sample("apogee_broker_messages_in_total", topic=TOPIC) == 3
    assert (m.get_sample("apogee_broker_bytes_in_total", topic=TOPIC) or 0) > 3 * 5
    assert (m.get_sample("apogee_broker_send_latency_seconds_count") or 0) >= 1
    assert (m.get_sample("apogee_broker_store_append_latency_seconds_count") or 0) >= 1
    for name in (
        "process_cpu_seconds_total",
        "python_gc_collections_total",
        "apogee_broker_disk_free_bytes",
        "apogee_broker_disk_used_ratio",
        "apogee_broker_commitlog_bytes",
        "apogee_broker_dispatch_backlog_bytes",
        "apogee_broker_last_recovery_duration_seconds",
        "apogee_broker_txn_half_pending",
    ):
        assert name in m.names(), name
    assert m.get_sample("apogee_broker_last_recovery", after="clean_stop", result="ok") == 1
    # nothing committed yet: the group's lag cannot be computed, so it is absent (not 0, not -1)
    assert "apogee_broker_group_lag_messages" not in m.names()

    got = await pull(
        channel,
        consumer_pb2.PullRequest(group=GROUP, topic=TOPIC, queue_id=0, offset=0, client_id="c1"),
    )
    assert got.count == 3
    await commit(channel, 1)
    m = await metrics(app)
    assert m.get_sample("apogee_broker_messages_out_total", topic=TOPIC) == 3
    assert m.get_sample("apogee_broker_pulls_total", result="found") == 1
    assert m.get_sample("apogee_broker_group_lag_messages", group=GROUP, topic=TOPIC) == 2
    lag_s = m.get_sample("apogee_broker_group_lag_seconds", group=GROUP, topic=TOPIC)
    assert lag_s is not None
    assert lag_s >= 0

    await commit(channel, 3)
    m = await metrics(app)
    assert m.get_sample("apogee_broker_group_lag_messages", group=GROUP, topic=TOPIC) == 0
    assert m.get_sample("apogee_broker_group_lag_seconds", group=GROUP, topic=TOPIC) == 0

    # one message to the dead-letter topic, one back for a retry
    items = [
        consumer_pb2.SendBackItem(
            topic=TOPIC,
            queue_id=0,
            queue_offset=r.queue_offset,
            phys_offset=r.phys_offset,
            unique_id=r.unique_id,
            reason="broken",
            to_dlq=dlq,
        )
        for r, dlq in ((sent[0], True), (sent[1], False))
    ]
    back = await consumer_pb2_grpc.ConsumerStub(channel).SendBack(
        consumer_pb2.SendBackRequest(group=GROUP, items=items, client_id="c1"), timeout=5
    )
    assert [o.dead_lettered for o in back.results] == [True, False]
    assert all(not o.HasField("status") or o.status.code == 0 for o in back.results)
    m = await metrics(app)
    assert m.get_sample("apogee_broker_dlq_messages_total", group=GROUP) == 1
    assert m.get_sample("apogee_broker_retry_messages_total", group=GROUP) == 1
    assert m.get_sample("apogee_broker_messages_in_total", topic=f"%DLQ%{GROUP}") == 1


async def test_a_long_poll_is_counted_with_its_hold(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    await send(channel, TOPIC, b"first")
    got = await pull(
        channel,
        consumer_pb2.PullRequest(
            group=GROUP, topic=TOPIC, queue_id=0, offset=1, client_id="c1", hold_ms=100
        ),
    )
    assert not got.records
    m = await metrics(app)
    assert m.get_sample("apogee_broker_long_polls_total") == 1
    assert m.get_sample("apogee_broker_pulls_total", result="empty") == 1
    held = m.get_sample("apogee_broker_long_poll_hold_seconds_sum") or 0
    assert 0.05 <= held < 5


async def test_pending_transactions_and_their_age(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    await send(channel, TOPIC, b"creates the topic")
    await transaction_pb2_grpc.TransactionStub(channel).SendHalf(
        transaction_pb2.SendHalfRequest(
            producer_group="payers",
            message=common_pb2.Message(topic=TOPIC, body=b"pay 10", queue_id=0),
        ),
        timeout=5,
    )
    m = await metrics(app)
    assert m.get_sample("apogee_broker_txn_half_pending") == 1
    assert m.get_sample("apogee_broker_txn_half_given_up") == 0
    age = m.get_sample("apogee_broker_txn_half_oldest_age_seconds")
    assert age is not None
    assert 0 <= age < 60


async def test_topics_beyond_the_cap_are_counted_as_other(tmp_path: Path) -> None:
    async with (
        running_broker(settings(tmp_path, metrics_max_topics=2)) as app,
        grpc.aio.insecure_channel(app.address) as ch,
    ):
        for name in ("T1", "T2", "T3", "T4"):
            await send(ch, name, b"x", b"y")
        m = await metrics(app)
    assert m.get_sample("apogee_broker_messages_in_total", topic="T1") == 2
    assert m.get_sample("apogee_broker_messages_in_total", topic="T2") == 2
    assert m.get_sample("apogee_broker_messages_in_total", topic="T3") is None
    assert m.get_sample("apogee_broker_messages_in_total", topic="other") == 4


async def test_a_metrics_port_in_use_fails_the_start_naming_it(tmp_path: Path) -> None:
    with taken_address() as taken:
        app = BrokerApp(settings(tmp_path, metrics_listen=taken))
        with pytest.raises(OSError, match=f"broker b1 cannot serve metrics on {taken}"):
            await app.start()
    # what the failed start opened was closed again: the same data directory opens at once
    async with running_broker(settings(tmp_path)) as again:
        assert again.metrics_server is not None


async def test_an_empty_metrics_listen_serves_no_endpoint(tmp_path: Path) -> None:
    async with running_broker(settings(tmp_path, metrics_listen="")) as app:
        assert app.metrics_server is None
        async with grpc.aio.insecure_channel(app.address) as ch:
            await send(ch, TOPIC, b"counted all the same")
        assert app.metrics.messages_in.labels(TOPIC)._value.get() == 1
