"""The clients' Prometheus metrics against real nameservers and brokers in this process: sends
and their latency, bytes and in-flight count; what consumers receive and process (ok, retried,
dead-lettered); refused sends by error kind; transactions by end outcome; topic labels capped;
counts kept when a client is gone; and with metrics off, no metrics object anywhere (nor
prometheus_client imported)."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from apogee.client import (
    EndOutcome,
    Message,
    Producer,
    PullConsumer,
    PushConsumer,
    ReceivedMessage,
    SyncProducer,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
)
from apogee.client.consumer.config import ConsumerOptions
from apogee.client.metrics import client_metrics
from apogee.client.producer.txn_model import TransactionExecutor
from apogee.common.errors import InvalidArgumentError, MessageTooLargeError, UnknownTopicError
from apogee.common.metrics import OTHER
from apogee.testkit.cluster import InProcessCluster, eventually

pytestmark = pytest.mark.integration

TOPIC = "Orders"
BODY = b"x" * 1000
FAST: ConsumerOptions = {
    "rebalance_interval": 1.0,
    "offset_persist_interval": 0.2,
    "long_poll_timeout": 2.0,
    "consume_from": "earliest",
}


def fast(**extra: Any) -> ConsumerOptions:
    """The quick settings of these tests, plus ``extra``."""
    return cast(ConsumerOptions, {**FAST, **extra})


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    """One nameserver and two brokers (messages of 256 KiB at most); the topic on both."""
    async with InProcessCluster(tmp_path, nameservers=1) as c:
        await c.create_topic(TOPIC, queues=2)
        yield c


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sample ``name`` with ``labels``, 0 when it is absent."""
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


async def until(registry: CollectorRegistry, name: str, want: float, **labels: str) -> None:
    async def reached() -> bool:
        return value(registry, name, **labels) >= want

    await eventually(reached, 15.0, f"{name}{labels} reaching {want}")


async def test_sends_and_consumption_are_counted(cluster: InProcessCluster) -> None:
    registry = CollectorRegistry()
    n = 60
    async with Producer(cluster.namesrv, group="shop", metrics_registry=registry) as producer:
        await asyncio.gather(*(producer.send(Message(TOPIC, BODY)) for _ in range(n // 2)))
        futures = [producer.send_nowait(Message(TOPIC, BODY)) for _ in range(n // 2)]
        assert value(registry, "apogee_client_sends_in_flight", group="shop") == n // 2
        await asyncio.gather(*futures)
        assert value(registry, "apogee_client_sends_in_flight", group="shop") == 0

    p = {"group": "shop"}
    assert value(registry, "apogee_client_messages_sent_total", topic=TOPIC, **p) == n
    sent_bytes = value(registry, "apogee_client_bytes_sent_total", topic=TOPIC, **p)
    assert n * len(BODY) < sent_bytes < n * (len(BODY) + 200)  # the records, header included
    assert value(registry, "apogee_client_send_latency_seconds_count", **p) == n
    assert value(registry, "apogee_client_send_latency_seconds_bucket", le="+Inf", **p) == n
    assert 0 < value(registry, "apogee_client_send_latency_seconds_sum", **p) < n * 3.0
    assert value(registry, "apogee_client_send_errors_total", kind="UNAVAILABLE", **p) == 0

    async def listen(msgs: list[ReceivedMessage]) -> None:
        await asyncio.sleep(0)

    on = fast(metrics_registry=registry)
    push = PushConsumer(cluster.namesrv, "billing", listen, **on)
    pull = PullConsumer(cluster.namesrv, "audit", **on)
    push.subscribe(TOPIC)
    pull.subscribe(TOPIC)
    async with push, pull:
        await push.start()
        await pull.start()
        polled: list[ReceivedMessage] = []

        async def all_polled() -> bool:
            polled.extend(await pull.poll(timeout=0.2))
            return len(polled) >= n

        await eventually(all_polled, 15.0, "the pull consumer's messages")
        c = {"group": "billing", "topic": TOPIC}
        await until(registry, "apogee_client_messages_processed_total", n, result="ok", **c)

    assert value(registry, "apogee_client_messages_received_total", **c) == n
    assert value(registry, "apogee_client_bytes_received_total", **c) >= n * len(BODY)
    assert value(registry, "apogee_client_process_latency_seconds_count", group="billing") == n
    for result in ("retried", "failed"):
        assert value(registry, "apogee_client_messages_processed_total", result=result, **c) == 0
    audit = {"group": "audit", "topic": TOPIC}
    assert value(registry, "apogee_client_messages_received_total", **audit) == n
    # a pull consumer's application does the processing: nothing is counted for it
    assert value(registry, "apogee_client_messages_processed_total", result="ok", **audit) == 0
    assert "apogee_client_messages_sent_total" in generate_latest(registry).decode()


async def test_failed_sends_are_counted_by_kind(cluster: InProcessCluster) -> None:
    registry = CollectorRegistry()
    p = {"group": "shop"}
    async with Producer(
        cluster.namesrv, group="shop", metrics_registry=registry, send_timeout=2.0
    ) as producer:
        with pytest.raises(MessageTooLargeError):  # the brokers take 256 KiB at most
            await producer.send(Message(TOPIC, os.urandom(300 * 1024)))  # (not compressible)
        with pytest.raises(UnknownTopicError):
            await producer.send(Message("NoSuchTopic", b"x"))
        await producer.send(Message(TOPIC, b"fine"))

    assert value(registry, "apogee_client_send_errors_total", kind="MESSAGE_TOO_LARGE", **p) == 1
    assert value(registry, "apogee_client_send_errors_total", kind="UNKNOWN_TOPIC", **p) == 1
    assert value(registry, "apogee_client_messages_sent_total", topic=TOPIC, **p) == 1
    # a failed send's time counts among the latencies too
    assert value(registry, "apogee_client_send_latency_seconds_count", **p) == 3
    assert value(registry, "apogee_client_sends_in_flight", **p) == 0


async def test_batches_count_their_messages_once_and_sync_twins_count_too(
    cluster: InProcessCluster,
) -> None:
    registry = CollectorRegistry()
    async with Producer(cluster.namesrv, group="shop", metrics_registry=registry) as producer:
        await producer.send_batch([Message(TOPIC, BODY) for _ in range(10)])
    p = {"group": "shop"}
    assert value(registry, "apogee_client_messages_sent_total", topic=TOPIC, **p) == 10
    assert value(registry, "apogee_client_send_latency_seconds_count", **p) == 1  # one send
    group = client_metrics(registry).producer_group("shop")
    assert len(group._live) == 1
    del producer
    gc.collect()
    assert group._live == []  # its counts moved to the group's: no counter goes down
    assert value(registry, "apogee_client_messages_sent_total", topic=TOPIC, **p) == 10

    def sync_sends() -> None:
        with SyncProducer(cluster.namesrv, group="tills", metrics_registry=registry) as sync:
            for _ in range(3):
                sync.send(Message(TOPIC, BODY))

    await asyncio.to_thread(sync_sends)
    assert value(registry, "apogee_client_messages_sent_total", group="tills", topic=TOPIC) == 3


async def test_failed_calls_are_counted_as_retried_or_dead_lettered(
    cluster: InProcessCluster,
) -> None:
    registry = CollectorRegistry()
    async with Producer(cluster.namesrv) as producer:
        for body in (b"good", b"bad", b"good"):
            await producer.send(Message(TOPIC, body))

    async def listen(msgs: list[ReceivedMessage]) -> None:
        if msgs[0].body == b"bad":
            raise ValueError("no")

    retrying = PushConsumer(cluster.namesrv, "retrying", listen, **fast(metrics_registry=registry))
    # the first failure of a "dead" consumer goes to the dead-letter topic
    on = fast(metrics_registry=registry, max_reconsume_times=0)
    dead = PushConsumer(cluster.namesrv, "dead", listen, **on)
    for consumer in (retrying, dead):
        consumer.subscribe(TOPIC)
    name = "apogee_client_messages_processed_total"
    async with retrying, dead:
        await retrying.start()
        await dead.start()
        await until(registry, name, 1, group="retrying", topic=TOPIC, result="retried")
        await until(registry, name, 1, group="dead", topic=TOPIC, result="failed")
        await until(registry, name, 2, group="dead", topic=TOPIC, result="ok")
        await until(registry, name, 2, group="retrying", topic=TOPIC, result="ok")

    assert value(registry, name, group="retrying", topic=TOPIC, result="failed") == 0
    assert value(registry, name, group="dead", topic=TOPIC, result="retried") == 0
    assert value(registry, "apogee_client_process_latency_seconds_count", group="dead") == 3


async def test_transactions_are_counted_by_end_outcome(cluster: InProcessCluster) -> None:
    registry = CollectorRegistry()

    def decide(decision: TransactionDecision) -> TransactionExecutor:
        def executor(msg: TransactionMessage, arg: object) -> TransactionDecision:
            return decision

        return executor

    async with TransactionProducer(
        cluster.namesrv, "orders-txn", metrics_registry=registry
    ) as producer:
        for decision in (
            TransactionDecision.COMMIT,
            TransactionDecision.COMMIT,
            TransactionDecision.ROLLBACK,
            TransactionDecision.UNKNOWN,
        ):
            await producer.send_in_transaction(Message(TOPIC, BODY), decide(decision))
        assert value(registry, "apogee_client_sends_in_flight", group="orders-txn") == 0

    def outcome(o: EndOutcome) -> float:
        return value(
            registry, "apogee_client_transactions_total", group="orders-txn", outcome=o.value
        )

    assert outcome(EndOutcome.COMMITTED) == 2
    assert outcome(EndOutcome.ROLLED_BACK) == 1
    assert outcome(EndOutcome.NOT_ENDED) == 1


async def test_topic_labels_are_capped(cluster: InProcessCluster) -> None:
    registry = CollectorRegistry()
    client_metrics(registry, max_topics=2)
    with pytest.raises(InvalidArgumentError, match="max_topics"):
        client_metrics(registry, max_topics=5)  # the labels are handed out already
    with pytest.raises(InvalidArgumentError, match="metrics_registry"):
        Producer(cluster.namesrv, metrics_registry="yes")  # type: ignore[arg-type]
    topics = ["T1", "T2", "T3", "T4"]
    for topic in topics:
        await cluster.create_topic(topic, queues=1)
    async with Producer(cluster.namesrv, group="shop", metrics_registry=registry) as producer:
        for topic in topics:
            await producer.send(Message(topic, BODY))
        await producer.send(Message("T4", BODY))

    sent = "apogee_client_messages_sent_total"
    assert [value(registry, sent, group="shop", topic=t) for t in topics] == [1, 1, 0, 0]
    assert value(registry, sent, group="shop", topic=OTHER) == 3
    labels = {
        s.labels["topic"]
        for family in registry.collect()
        if family.name == "apogee_client_messages_sent"
        for s in family.samples
    }
    assert labels == {"T1", "T2", OTHER}


async def test_metrics_off_hold_nothing(cluster: InProcessCluster) -> None:
    async def listen(msgs: list[ReceivedMessage]) -> None:
        pass

    async with Producer(cluster.namesrv) as producer:
        assert producer._metrics is None
        assert producer._ctx.metrics is None
        await producer.send(Message(TOPIC, BODY))
    consumer = PushConsumer(cluster.namesrv, "quiet", listen, **FAST)
    consumer.subscribe(TOPIC)
    async with consumer:
        await consumer.start()
        assert consumer._metrics is None
        assert consumer._caller.metrics is None
        assert consumer._runtime is not None
        assert consumer._runtime._fetch.metrics is None


def test_the_sdk_imports_no_metrics_code_unless_asked() -> None:
    code = (
        "import sys\n"
        "from apogee.client import Producer, PushConsumer\n"
        "Producer('127.0.0.1:1')\n"
        "PushConsumer('127.0.0.1:1', 'g', lambda msgs: None)\n"
        "loaded = {'prometheus_client', 'apogee.client.metrics'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
