"""The official RocketMQ 5 Python client's own examples (``e2e/rocketmq_examples/``, verbatim
copies of apache/rocketmq-clients ``python/example/``) against real Apogee processes.

The examples are smoke programs: they print what they did and catch every exception (printing
``... raise exception: ...``). Each test runs a copy of one or two of them
(:class:`~e2e.rocketmq_support.ExampleProcess`) with three constants set - ``endpoints`` to the
brokers' addresses, ``topic`` to a topic the test created with the example's message type,
``consumer_group`` to a group of its own - and checks what a user would: the producer reports
every send and no exception, and the consumer example gets exactly what was sent.

1. ``normal_producer_example``: 10 messages, acked by ``simple_consumer_example``; stored with
   their tag, key and property;
2. ``async_producer_example``: 10 asynchronous sends, consumed by ``push_consumer_example``;
3. ``fifo_producer_example``: 9 messages of two message groups, each group acked in order;
4. ``delay_producer_example``: the message arrives 10 s after it was sent, not before;
5. ``transaction_producer_example``: the half message is left to the server's check, which the
   example's TransactionChecker answers COMMIT; the message is then delivered.

Consumers start first (a group's first contact is where it starts reading). Until the brokers
serve the public protocol every test fails at once saying so.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from apogee.client import SyncAdminClient
from e2e.harness import Cluster
from e2e.rocketmq_support import (
    ExampleProcess,
    Line,
    endpoints,
    make_topic,
    one_broker,
    require_v2,
    unique,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parent / "rocketmq_examples"
#: What the examples print (threads printing at once may share a line: ids are matched, not
#: lines).
SENT = re.compile(r"send message success[.,] message_id:([0-9A-F]+)")
ACKED = re.compile(r"ack message:\[([0-9A-F]+)\]")
#: How long a producer example may run, and a consumer example take to get what was sent.
RUN_TIMEOUT = 60.0
CONSUME_TIMEOUT = 90.0


@pytest.fixture
def rmq(rocketmq_cluster: Cluster) -> Cluster:
    require_v2(rocketmq_cluster)
    return rocketmq_cluster


class Examples:
    """Runs examples under one folder; :meth:`close` kills whatever still runs."""

    def __init__(self, root: Path, access_point: str) -> None:
        self.root = root
        self.access_point = access_point
        self.running: list[ExampleProcess] = []

    def run(self, name: str, topic: str, group: str | None = None) -> ExampleProcess:
        values = {"endpoints": self.access_point, "topic": topic}
        if group is not None:
            values["consumer_group"] = group
        return self._start(name, values)

    def _start(self, name: str, values: Mapping[str, str]) -> ExampleProcess:
        workdir = self.root / f"{len(self.running) + 1:02d}-{name}"
        proc = ExampleProcess(EXAMPLES / f"{name}.py", values, workdir)
        self.running.append(proc)
        return proc

    def consumer(self, name: str, topic: str, group: str) -> ExampleProcess:
        """A consumer example, once its client started."""
        proc = self.run(name, topic, group)
        proc.wait_started()
        return proc

    def close(self) -> None:
        for p in self.running:
            p.close()


@pytest.fixture
def examples(rmq: Cluster, tmp_path: Path) -> Iterator[Examples]:
    runner = Examples(tmp_path / "examples", endpoints(rmq))
    try:
        yield runner
    finally:
        runner.close()


def ids(text: str | list[Line], rx: re.Pattern[str]) -> list[str]:
    """The message ids ``rx`` finds in ``text`` (or in these lines), in order."""
    if not isinstance(text, str):
        text = "\n".join(ln.text for ln in text)
    return rx.findall(text)


def run_to_the_end(proc: ExampleProcess, sends: int) -> list[str]:
    """The message ids a producer example that ends by itself reports, once it ended well."""
    code = proc.wait_exit(RUN_TIMEOUT)
    assert (code, proc.failures()) == (0, []), proc.detail()
    sent = ids(proc.lines(), SENT)
    assert len(set(sent)) == len(sent) == sends, proc.detail()
    return sent


def acked_ids(consumer: ExampleProcess, count: int) -> list[str]:
    """The ids ``simple_consumer_example`` acked, once it acked ``count``, in order."""
    found = consumer.wait_matches(ACKED.pattern, CONSUME_TIMEOUT, f"{count} messages acked", count)
    return ids("\n".join(found), ACKED)


# -- 1. normal producer, simple consumer -----------------------------------------------------------


def test_normal_producer_example_reaches_the_simple_consumer_example(
    rmq: Cluster, examples: Examples
) -> None:
    topic, group = unique("ExNormal"), unique("ex-simple")
    make_topic(rmq, topic, "NORMAL", brokers=one_broker(rmq))
    consumer = examples.consumer("simple_consumer_example", topic, group)
    sent = run_to_the_end(examples.run("normal_producer_example", topic), 10)

    acked = acked_ids(consumer, 10)
    assert sorted(acked) == sorted(sent), consumer.detail()
    with SyncAdminClient(rmq.namesrv) as admin:
        stored = [admin.get_message(i) for i in sent]
    for m in stored:
        assert (m.topic, m.body, m.tags, list(m.keys)) == (
            topic,
            b"hello, rocketmq.",
            "tag",
            ["keys"],
        ), m
        assert dict(m.properties).get("key") == "value", m


# -- 2. async producer, push consumer --------------------------------------------------------------


def test_async_producer_example_reaches_the_push_consumer_example(
    rmq: Cluster, examples: Examples
) -> None:
    topic, group = unique("ExAsync"), unique("ex-push")
    make_topic(rmq, topic, "NORMAL")
    consumer = examples.consumer("push_consumer_example", topic, group)
    producer = examples.run("async_producer_example", topic)

    producer.wait_matches(SENT.pattern, RUN_TIMEOUT, "10 sends reported", 10)
    producer.press_enter()
    assert (producer.wait_exit(RUN_TIMEOUT), producer.failures()) == (0, []), producer.detail()
    assert len(set(ids(producer.lines(), SENT))) == 10, producer.detail()
    # the listener runs on several threads: their prints may share a line
    consumed = consumer.wait_matches(
        rf"consume message, topic:{topic}, [^\n]*?\}}\.",
        CONSUME_TIMEOUT,
        "10 messages consumed",
        10,
    )
    assert len(consumed) == 10, consumer.detail()
    for text in consumed:
        assert "tag:tag," in text, text
        assert "'send': 'async'" in text, text
    assert consumer.failures() == [], consumer.detail()


# -- 3. FIFO ---------------------------------------------------------------------------------------


def test_fifo_producer_example_groups_arrive_in_order(rmq: Cluster, examples: Examples) -> None:
    topic, group = unique("ExFifo"), unique("ex-fifo")
    make_topic(rmq, topic, "FIFO", brokers=one_broker(rmq))
    consumer = examples.consumer("simple_consumer_example", topic, group)
    sent = run_to_the_end(examples.run("fifo_producer_example", topic), 9)

    acked = acked_ids(consumer, 9)
    assert sorted(acked) == sorted(sent), consumer.detail()
    # i = 1..9: odd ones in message group "1", even ones in "2"
    for name, members in (("1", sent[0::2]), ("2", sent[1::2])):
        assert [i for i in acked if i in members] == members, (name, acked, sent)


# -- 4. delay --------------------------------------------------------------------------------------


def test_delay_producer_example_arrives_ten_seconds_later(rmq: Cluster, examples: Examples) -> None:
    topic, group = unique("ExDelay"), unique("ex-delay")
    make_topic(rmq, topic, "DELAY", brokers=one_broker(rmq))
    consumer = examples.consumer("simple_consumer_example", topic, group)
    producer = examples.run("delay_producer_example", topic)
    [sent] = run_to_the_end(producer, 1)
    [sent_line] = [ln for ln in producer.lines() if SENT.search(ln.text)]

    [acked] = consumer.wait_line(ACKED.pattern, CONSUME_TIMEOUT, "the delay message acked")
    assert ids([acked], ACKED) == [sent], consumer.detail()
    waited = acked.at - sent_line.at
    # due at int(time.time()) + 10, taken before the send: 9 to 10 s after the send
    assert 9 - 0.5 <= waited <= 10 + 2, f"acked {waited:.2f}s after it was sent"


# -- 5. transaction --------------------------------------------------------------------------------


def test_transaction_producer_example_is_committed_by_its_checker(
    rmq: Cluster, examples: Examples
) -> None:
    topic, group = unique("ExTxn"), unique("ex-txn")
    make_topic(rmq, topic, "TRANSACTION", brokers=one_broker(rmq))
    consumer = examples.consumer("simple_consumer_example", topic, group)
    producer = examples.run("transaction_producer_example", topic)

    found = producer.wait_matches(SENT.pattern, RUN_TIMEOUT, "the half message sent", 1)
    [sent] = ids("\n".join(found), SENT)
    producer.wait_line(
        r"do TestChecker check, topic:" + re.escape(topic), 30, "the server's check answered"
    )
    [acked] = acked_ids(consumer, 1)
    assert acked == sent, consumer.detail()
    producer.press_enter()
    assert (producer.wait_exit(RUN_TIMEOUT), producer.failures()) == (0, []), producer.detail()
