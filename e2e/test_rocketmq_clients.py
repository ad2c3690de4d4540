"""The official RocketMQ 5 Python client (``rocketmq-python-client`` 5.1.2) against real Apogee
processes: the client speaks ``apache.rocketmq.v2.MessagingService`` to the brokers' gRPC ports
(the brokers' addresses are its access point). Each client runs in a process of its own
(:mod:`e2e.rocketmq_support`), through the client's public API only.

1. NORMAL messages with a tag, keys and user properties reach a SimpleConsumer whole, as first
   attempts; once acked they never come back;
2. a message whose invisible time a SimpleConsumer shortens comes back after the new time, as
   attempt 2 of the same message (id, topic, body);
3. a message a PushConsumer's listener fails comes back as attempt 2; after the group's last
   attempt (the brokers' ``max_reconsume_times`` is set to 2 here: 3 attempts) it is in
   ``%DLQ%<group>``, where Apogee's admin API finds it;
4. FIFO: 3 message groups of 20 messages; a SimpleConsumer is killed (SIGKILL) holding
   messages it has not acked, and a new one of the group goes on: each group arrives in order,
   nothing is lost, nothing acked comes again, and the held messages come back;
5. transactions: a commit is delivered, a rollback never, and a transaction left open is
   committed by the producer's TransactionChecker when the transaction checker service asks;
6. a delay message (``delivery_timestamp`` in whole seconds) arrives at its time, not before;
7. a delay message recalled with its recall handle is never delivered;
8. a tag filter ``a || b`` and an SQL92 filter take just the messages they select;
9. a message sent by Apogee's SDK reaches the official SimpleConsumer whole, and one sent by
   the official Producer reaches Apogee's SDK consumer whole;
10. the broker is killed (SIGKILL) while a consumer holds messages it has not acked: after the
    broker's restart each comes back once its invisible time has passed; the acked ones never.

Consumers start before anything is sent to their topic: a group's first contact is where it
starts reading. Every test makes topics and groups of its own; 1-9 share one cluster, 10 starts
its own. Until the brokers serve the public protocol every test fails at once saying so
(:func:`~e2e.rocketmq_support.require_v2`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apogee.client import Message, SyncAdminClient, SyncProducer, SyncPullConsumer
from apogee.client.consumer.records import ReceivedMessage
from e2e.harness import Cluster, ClusterFactory, wait_until
from e2e.rocketmq_support import (
    AWAIT_S,
    BROKER_ENV,
    CALL_SLACK_S,
    JSON,
    MAX_RECONSUME_TIMES,
    ClientCallError,
    ClientProcess,
    OfficialClients,
    by_body,
    endpoints,
    make_topic,
    one_broker,
    receive_until,
    require_v2,
    unique,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: How long a SimpleConsumer's receives may take to find what a test waits for: each asks one
#: broker, picked at random, and an empty answer takes the whole long poll (AWAIT_S).
RECEIVE_TIMEOUT = 60.0
#: The shortest invisible time a receive may ask for (RocketMQ's minimum).
MIN_INVISIBLE_S = 10
#: How late a delay message may arrive after its delivery time.
DELAY_LATE_S = 1.5
#: The message types of the public protocol (``Message.message_type``).
NORMAL, FIFO, DELAY, TRANSACTION = 1, 2, 3, 4


@pytest.fixture
def rmq(rocketmq_cluster: Cluster) -> Cluster:
    """The shared cluster, once its brokers are known to serve the public protocol."""
    require_v2(rocketmq_cluster)
    return rocketmq_cluster


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[OfficialClients]:
    official = OfficialClients(tmp_path / "clients")
    try:
        yield official
    finally:
        official.close()


def send(producer: ClientProcess, topic: str, body: str, **fields: Any) -> JSON:
    """The receipt of one ``send`` (fields: tag, keys, properties, message_group,
    delivery_timestamp, transaction)."""
    receipt: JSON = producer.call("send", topic=topic, body=body, **fields)
    return receipt


def ack_all(consumer: ClientProcess, messages: list[JSON]) -> None:
    for m in messages:
        consumer.call("ack", ref=m["ref"])


def assert_nothing_more(consumer: ClientProcess, until: float, invisible_s: int) -> None:
    """Receive until ``until`` (``time.time()``); every receive must come back empty."""
    while True:
        got = consumer.call("receive", AWAIT_S + CALL_SLACK_S, max=32, invisible_s=invisible_s)
        seen = [(m["body"], m["delivery_attempt"]) for m in got]
        assert not got, f"received again after acking: {seen}"
        if time.time() > until:
            return


# -- 1. normal messages ----------------------------------------------------------------------------


def test_normal_messages_arrive_whole_once_and_acked_ones_never_again(
    rmq: Cluster, clients: OfficialClients
) -> None:
    topic, group = unique("RmqNormal"), unique("rmq-normal")
    make_topic(rmq, topic, "NORMAL", brokers=one_broker(rmq))
    access = endpoints(rmq)
    consumer = clients.simple(access, group, topic)
    producer = clients.producer(access, [topic])
    sent: dict[str, tuple[JSON, list[str], dict[str, str]]] = {}
    for i in range(3):
        keys, props = [f"order-{i}", "batch-7"], {"order": f"o-{i}", "region": "eu-west"}
        r = send(producer, topic, f"normal {i}", tag="created", keys=keys, properties=props)
        sent[f"normal {i}"] = (r, keys, props)

    got = receive_until(
        consumer,
        lambda ms: set(by_body(ms)) >= set(sent),
        invisible_s=MIN_INVISIBLE_S,
        timeout=RECEIVE_TIMEOUT,
        what="the three messages received",
        ack=True,
    )
    received_at = max(m["at"] for m in got)

    deliveries = by_body(got)
    assert sorted(deliveries) == sorted(sent), "received other messages, or not these"
    for body, (r, keys, props) in sent.items():
        assert len(deliveries[body]) == 1, deliveries[body]
        [m] = deliveries[body]
        fields = (m["topic"], m["message_id"], m["tag"], m["keys"], m["properties"])
        assert fields == (topic, r["message_id"], "created", sorted(keys), props), m
        assert (m["delivery_attempt"], m["message_type"], m["corrupted"]) == (1, NORMAL, False), m
        # the client sends whole seconds
        assert r["at"] - 5 <= m["born_timestamp_ms"] / 1000 <= r["at"] + 1, (m, r)
    # acked: nothing comes back, not even once the invisible time has passed
    assert_nothing_more(consumer, received_at + MIN_INVISIBLE_S + 1, MIN_INVISIBLE_S)


# -- 2. change_invisible_duration ------------------------------------------------------------------


def test_a_message_made_visible_sooner_comes_back_as_its_second_attempt(
    rmq: Cluster, clients: OfficialClients
) -> None:
    topic, group = unique("RmqInvisible"), unique("rmq-invisible")
    make_topic(rmq, topic, "NORMAL", brokers=one_broker(rmq))
    access = endpoints(rmq)
    consumer = clients.simple(access, group, topic)
    producer = clients.producer(access, [topic])
    r = send(producer, topic, "try me twice", tag="t", keys=["inv-1"])
    invisible_s = 60

    [first] = receive_until(
        consumer,
        bool,
        invisible_s=invisible_s,
        timeout=RECEIVE_TIMEOUT,
        what="the message received",
    )
    assert (first["body"], first["delivery_attempt"]) == ("try me twice", 1), first
    changed_at = consumer.call("change_invisible", ref=first["ref"], invisible_s=2)
    [again] = receive_until(
        consumer, bool, invisible_s=invisible_s, timeout=RECEIVE_TIMEOUT, what="the message back"
    )
    consumer.call("ack", ref=again["ref"])

    assert (again["message_id"], again["topic"], again["body"]) == (
        r["message_id"],
        topic,
        "try me twice",
    ), again
    assert again["delivery_attempt"] == 2, again
    # after the new invisible time (the broker set it a moment before the answer came), long
    # before the first one would have passed
    assert again["at"] >= changed_at + 2 - 0.5, (again["at"] - changed_at, again)
    assert again["at"] < first["at"] + invisible_s, again


# -- 3. push consumer: retry, then dead letter -----------------------------------------------------


def test_a_message_a_push_listener_fails_is_retried_then_dead_lettered(
    rmq: Cluster, clients: OfficialClients
) -> None:
    topic, group = unique("RmqPushRetry"), unique("rmq-push-retry")
    make_topic(rmq, topic, "NORMAL")
    access = endpoints(rmq)
    poison = unique("poison")
    consumer = clients.push(access, group, topic, fail_keys=[poison])
    producer = clients.producer(access, [topic])
    bad = send(producer, topic, "poison pill", tag="bad", keys=[poison])
    send(producer, topic, "fine 1", keys=["fine-1"])
    attempts = MAX_RECONSUME_TIMES + 1

    def tries(events: list[JSON], body: str) -> list[int]:
        return [e["message"]["delivery_attempt"] for e in events if e["message"]["body"] == body]

    consumer.wait_events(
        lambda evs: len(tries(evs, "poison pill")) >= 2 and tries(evs, "fine 1") != [],
        30,
        "the failed message back for its second attempt",
        kind="consumed",
    )
    events = consumer.events("consumed")
    assert tries(events, "poison pill")[:2] == [1, 2], events
    first = next(e["message"] for e in events if e["message"]["body"] == "poison pill")
    again = [e["message"] for e in events if e["message"]["body"] == "poison pill"][1]
    assert (again["message_id"], again["topic"]) == (first["message_id"], topic), again
    assert tries(events, "fine 1") == [1], events

    # the last attempt fails too: the brokers move it to the group's dead-letter topic
    with SyncAdminClient(rmq.namesrv) as admin:
        wait_until(
            lambda: admin.list_dead_letters(group, topic=topic),
            60,
            f"the message failed {attempts} times in %DLQ%{group} (max_reconsume_times "
            f"{MAX_RECONSUME_TIMES} on the brokers)",
            every=0.5,
            detail=lambda: f"attempts seen: {tries(consumer.events('consumed'), 'poison pill')}",
        )
        [letter] = admin.list_dead_letters(group, topic=topic)
    assert (letter.unique_id, letter.origin_topic, letter.body) == (
        bad["message_id"],
        topic,
        b"poison pill",
    ), letter
    assert (letter.tags, list(letter.keys)) == ("bad", [poison]), letter
    # a later message still arrives; the dead letter is not delivered again
    send(producer, topic, "fine 2", keys=["fine-2"])
    consumer.wait_events(
        lambda evs: tries(evs, "fine 2") != [], 30, "a message after the dead letter", "consumed"
    )
    events = consumer.events("consumed")
    assert tries(events, "poison pill") == list(range(1, attempts + 1)), events


# -- 4. FIFO, and a consumer killed mid-way --------------------------------------------------------


GROUPS = ("alpha", "beta", "gamma")
PER_GROUP = 20


def test_fifo_groups_stay_in_order_across_a_killed_consumer(
    rmq: Cluster, clients: OfficialClients
) -> None:
    topic, group = unique("RmqFifo"), unique("rmq-fifo")
    make_topic(rmq, topic, "FIFO")
    access = endpoints(rmq)
    first = clients.simple(access, group, topic)
    producer = clients.producer(access, [topic])
    for i in range(PER_GROUP):
        for g in GROUPS:
            send(producer, topic, f"{g}:{i:02d}", message_group=g, keys=[f"{g}-{i}"])

    def index(m: JSON) -> tuple[str, int]:
        g, i = m["body"].split(":")
        assert m["message_group"] == g, m
        return g, int(i)

    # the first consumer acks what it receives until half is done, then holds a batch unacked
    acked: list[JSON] = []
    received: list[JSON] = []
    held: list[JSON] = []
    deadline = time.monotonic() + 60
    while not held:
        assert time.monotonic() < deadline, f"within 60 s: {len(acked)} acked, none held"
        batch = first.call("receive", AWAIT_S + CALL_SLACK_S, max=8, invisible_s=MIN_INVISIBLE_S)
        received += batch
        if len(acked) >= len(GROUPS) * PER_GROUP // 2:
            held = batch
            continue
        ack_all(first, batch)
        acked += batch
    first.kill()

    second = clients.simple(access, group, topic)
    done = {index(m) for m in acked}
    later = receive_until(
        second,
        lambda ms: len(done | {index(m) for m in ms}) == len(GROUPS) * PER_GROUP,
        invisible_s=MIN_INVISIBLE_S + 20,
        timeout=MIN_INVISIBLE_S + 60,
        what="every message of every group received by one of the consumers",
        ack=True,
        max_messages=8,
    )

    for g in GROUPS:
        mine = [i for h, i in map(index, received) if h == g]
        was_acked = [i for h, i in map(index, acked) if h == g]
        then = [i for h, i in map(index, later) if h == g]
        # in order, each once: the first consumer's, then the second's from where acks stopped
        assert mine == sorted(set(mine)), (g, mine)
        assert was_acked == list(range(len(was_acked))), (g, was_acked)
        assert then == list(range(len(was_acked), PER_GROUP)), (g, was_acked, then)
    for m in later:
        if index(m) in {index(h) for h in held}:
            assert m["delivery_attempt"] >= 2, m  # held by the killed consumer: a redelivery


# -- 5. transactions -------------------------------------------------------------------------------


def test_transactions_commit_rollback_and_the_checkers_commit(
    rmq: Cluster, clients: OfficialClients
) -> None:
    topic, group = unique("RmqTxn"), unique("rmq-txn")
    make_topic(rmq, topic, "TRANSACTION")
    access = endpoints(rmq)
    consumer = clients.simple(access, group, topic)
    producer = clients.producer(access, [topic], checker="COMMIT")
    props = {"amount": "30", "currency": "EUR"}
    committed = send(
        producer,
        topic,
        "txn committed",
        tag="pay",
        keys=["t-1"],
        properties=props,
        transaction="commit",
    )
    rolled_back = send(producer, topic, "txn rolled back", keys=["t-2"], transaction="rollback")
    left_open = send(
        producer,
        topic,
        "txn checked",
        tag="pay",
        keys=["t-3"],
        properties=props,
        transaction="open",
    )
    assert committed["transaction_id"], committed
    assert left_open["transaction_id"], left_open

    checks = producer.wait_events(
        lambda evs: any(e["message"]["message_id"] == left_open["message_id"] for e in evs),
        30,
        "the open transaction checked through the producer's TransactionChecker",
        kind="checked",
    )
    got = receive_until(
        consumer,
        lambda ms: {"txn committed", "txn checked"} <= set(by_body(ms)),
        invisible_s=30,
        timeout=RECEIVE_TIMEOUT,
        what="the committed and the checked transaction delivered",
        ack=True,
    )
    # a rolled-back message stored anyway would have been before this one
    send(producer, topic, "txn marker", transaction="commit")
    got += receive_until(
        consumer,
        lambda ms: "txn marker" in by_body(ms),
        invisible_s=30,
        timeout=RECEIVE_TIMEOUT,
        what="a transaction committed after the others delivered",
        ack=True,
    )

    deliveries = by_body(got)
    assert "txn rolled back" not in deliveries, deliveries["txn rolled back"]
    for body, r in (("txn committed", committed), ("txn checked", left_open)):
        assert len(deliveries[body]) == 1, deliveries[body]
        [m] = deliveries[body]
        fields = (m["message_id"], m["topic"], m["tag"], m["properties"])
        assert fields == (r["message_id"], topic, "pay", props), m
    checked = {e["message"]["message_id"] for e in producer.events("checked")}
    assert checked == {left_open["message_id"]}, "ended transactions were checked too"
    [asked] = [
        e["message"] for e in checks if e["message"]["message_id"] == left_open["message_id"]
    ]
    assert (asked["topic"], asked["body"], asked["keys"], asked["properties"]) == (
        topic,
        "txn checked",
        ["t-3"],
        props,
    ), asked
    assert rolled_back["message_id"] not in checked
    # as RocketMQ delivers them: a committed transaction is a TRANSACTION message
    types = {
        b: [m["message_type"] for m in deliveries[b]] for b in ("txn committed", "txn checked")
    }
    assert types == {"txn committed": [TRANSACTION], "txn checked": [TRANSACTION]}, types


# -- 6, 7. delay and recall ------------------------------------------------------------------------


def test_a_delay_message_arrives_at_its_time_not_before(
    rmq: Cluster, clients: OfficialClients
) -> None:
    topic, group = unique("RmqDelay"), unique("rmq-delay")
    make_topic(rmq, topic, "DELAY", brokers=one_broker(rmq))
    access = endpoints(rmq)
    consumer = clients.simple(access, group, topic)
    producer = clients.producer(access, [topic])
    due = math.ceil(time.time()) + 3  # whole seconds, as the client sends them
    r = send(producer, topic, "due later", tag="later", delivery_timestamp=due)

    [m] = receive_until(
        consumer, bool, invisible_s=30, timeout=RECEIVE_TIMEOUT, what="the delay message", ack=True
    )
    assert (m["message_id"], m["body"], m["tag"]) == (r["message_id"], "due later", "later"), m
    assert m["at"] >= due, f"received {due - m['at']:.2f}s before its delivery time"
    assert m["at"] <= due + DELAY_LATE_S, f"received {m['at'] - due:.2f}s after its time"
    assert m["delivery_timestamp_ms"] == due * 1000, m
    # as RocketMQ delivers it: its delivery time makes it a DELAY message
    assert m["message_type"] == DELAY, f"delivered as message type {m['message_type']}"


def test_a_recalled_delay_message_is_never_delivered(
    rmq: Cluster, clients: OfficialClients
) -> None:
    topic, group = unique("RmqRecall"), unique("rmq-recall")
    make_topic(rmq, topic, "DELAY", brokers=one_broker(rmq))
    access = endpoints(rmq)
    consumer = clients.simple(access, group, topic)
    producer = clients.producer(access, [topic])
    due = math.ceil(time.time()) + 3
    recalled = send(producer, topic, "recalled", delivery_timestamp=due)
    assert recalled["recall_handle"], f"a delay message's receipt has no recall handle: {recalled}"
    answer = producer.call("recall", topic=topic, handle=recalled["recall_handle"])
    assert answer == recalled["message_id"], answer
    kept = send(producer, topic, "kept", delivery_timestamp=due + 1)

    got = receive_until(
        consumer,
        lambda ms: "kept" in by_body(ms),
        invisible_s=30,
        timeout=RECEIVE_TIMEOUT,
        what="the delay message due after the recalled one",
        ack=True,
    )
    deliveries = by_body(got)
    assert "recalled" not in deliveries, deliveries["recalled"]
    assert [m["message_id"] for m in deliveries["kept"]] == [kept["message_id"]]


# -- 8. filters ------------------------------------------------------------------------------------


def filtered(
    rmq: Cluster,
    clients: OfficialClients,
    name: str,
    expression: str,
    sql: bool,
    messages: list[tuple[str, str | None, dict[str, str]]],
) -> list[str]:
    """The bodies a consumer filtering with ``expression`` gets of ``messages`` (body, tag,
    properties) sent in order to a topic of one queue on one broker; the last must match: once
    it is there, every message before it was either delivered or filtered out."""
    topic, group = unique(name), unique(name.lower())
    make_topic(rmq, topic, "NORMAL", queues=1, brokers=one_broker(rmq))
    access = endpoints(rmq)
    consumer = clients.simple(access, group, topic, expression=expression, sql=sql)
    producer = clients.producer(access, [topic])
    for body, tag, props in messages:
        fields: dict[str, Any] = {"properties": props}
        if tag is not None:
            fields["tag"] = tag
        send(producer, topic, body, **fields)
    last = messages[-1][0]
    got = receive_until(
        consumer,
        lambda ms: last in by_body(ms),
        invisible_s=30,
        timeout=RECEIVE_TIMEOUT,
        what=f"the last message through filter {expression!r}",
        ack=True,
    )
    return [m["body"] for m in got]


def test_a_tag_filter_takes_just_its_tags(rmq: Cluster, clients: OfficialClients) -> None:
    got = filtered(
        rmq,
        clients,
        "RmqTagFilter",
        "a || b",
        False,
        [
            ("tagged a", "a", {}),
            ("tagged b", "b", {}),
            ("tagged c", "c", {}),
            ("tagged ab", "ab", {}),
            ("no tag", None, {}),
            ("tagged a again", "a", {}),
        ],
    )
    assert sorted(got) == ["tagged a", "tagged a again", "tagged b"], got


def test_an_sql92_filter_takes_just_what_it_selects(rmq: Cluster, clients: OfficialClients) -> None:
    got = filtered(
        rmq,
        clients,
        "RmqSqlFilter",
        "color = 'red' AND size > 2",
        True,
        [
            ("red 3", "x", {"color": "red", "size": "3"}),
            ("red 1", "x", {"color": "red", "size": "1"}),
            ("blue 5", "x", {"color": "blue", "size": "5"}),
            ("no properties", "x", {}),
            ("red 9", None, {"color": "red", "size": "9"}),
        ],
    )
    assert sorted(got) == ["red 3", "red 9"], got


# -- 9. with Apogee's own SDK ----------------------------------------------------------------------


def test_an_apogee_sdk_message_reaches_the_official_consumer_whole(
    rmq: Cluster, clients: OfficialClients
) -> None:
    topic, group = unique("RmqFromSdk"), unique("rmq-from-sdk")
    make_topic(rmq, topic, "NORMAL")
    consumer = clients.simple(endpoints(rmq), group, topic)
    props = {"origin": "apogee", "n": "1"}
    with SyncProducer(rmq.namesrv, group=unique("rmq-sdk-producer")) as producer:
        r = producer.send(
            Message(topic, b"from the sdk", tags="sdk", keys=["sdk-1", "sdk-2"], properties=props)
        )

    [m] = receive_until(
        consumer, bool, invisible_s=30, timeout=RECEIVE_TIMEOUT, what="the SDK's message", ack=True
    )
    assert (m["topic"], m["message_id"], m["body"], m["tag"]) == (
        topic,
        r.message_id,
        "from the sdk",
        "sdk",
    ), m
    assert (m["keys"], m["properties"], m["delivery_attempt"]) == (["sdk-1", "sdk-2"], props, 1)


def test_an_official_client_message_reaches_the_apogee_consumer_whole(
    rmq: Cluster, clients: OfficialClients
) -> None:
    topic, group = unique("RmqToSdk"), unique("rmq-to-sdk")
    make_topic(rmq, topic, "NORMAL")
    props = {"origin": "rocketmq", "n": "2"}
    got: list[ReceivedMessage] = []
    with SyncPullConsumer(rmq.namesrv, group, consume_from="earliest") as consumer:
        consumer.subscribe(topic)
        consumer.start()
        producer = clients.producer(endpoints(rmq), [topic])
        r = send(
            producer, topic, "from rocketmq", tag="v5", keys=["v5-1", "v5-2"], properties=props
        )

        def polled() -> bool:
            got.extend(consumer.poll(timeout=0.5))
            return bool(got)

        wait_until(polled, 30, "the official client's message polled by Apogee's consumer")
    [m] = got
    assert (m.topic, m.unique_id, m.body, m.tags) == (
        topic,
        r["message_id"],
        b"from rocketmq",
        "v5",
    )
    assert sorted(m.keys) == ["v5-1", "v5-2"], m.keys
    assert props.items() <= dict(m.properties).items(), dict(m.properties)


# -- 10. the broker killed while messages are invisible --------------------------------------------


def test_unacked_messages_come_back_after_a_broker_kill_and_acked_ones_never(
    start_cluster: ClusterFactory, clients: OfficialClients
) -> None:
    cluster = start_cluster("rmq-broker-kill", brokers=1, nameservers=1, broker_env=BROKER_ENV)
    require_v2(cluster)
    topic, group = unique("RmqSurvivors"), unique("rmq-survivors")
    make_topic(cluster, topic, "NORMAL")
    access = endpoints(cluster)
    consumer = clients.simple(access, group, topic)
    producer = clients.producer(access, [topic])
    sent = {f"survivor {i}": send(producer, topic, f"survivor {i}") for i in range(10)}
    invisible_s = 15

    first = receive_until(
        consumer,
        lambda ms: set(by_body(ms)) >= set(sent),
        invisible_s=invisible_s,
        timeout=RECEIVE_TIMEOUT,
        what="every message received once",
    )
    firsts = {m["body"]: m for m in first}
    acked = sorted(sent)[:4]
    ack_all(consumer, [firsts[b] for b in acked])
    unacked = set(sent) - set(acked)

    broker = cluster.brokers[0].name
    cluster.kill(broker)
    cluster.restart(broker)
    back = receive_until(
        consumer,
        lambda ms: set(by_body(ms)) >= unacked,
        invisible_s=30,
        timeout=invisible_s + 60,
        what="every unacked message back after the broker's restart",
        ack=True,
        tolerate_errors=True,
    )
    # a message sent now arrives: anything acked that were to come back would be there too
    deadline = time.monotonic() + 60
    while True:
        try:
            send(producer, topic, "after the restart")
            break
        except ClientCallError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)  # pacing the retries of a send to a restarting broker
    back += receive_until(
        consumer,
        lambda ms: "after the restart" in by_body(ms),
        invisible_s=30,
        timeout=RECEIVE_TIMEOUT,
        what="a message sent after the restart",
        ack=True,
        tolerate_errors=True,
    )

    deliveries = by_body(back)
    assert not set(acked) & set(deliveries), {
        b: deliveries[b] for b in set(acked) & set(deliveries)
    }
    for body in sorted(unacked):
        m = deliveries[body][0]
        assert (m["message_id"], m["delivery_attempt"]) == (sent[body]["message_id"], 2), m
        # not before its invisible time (the broker set it a moment before the answer came)
        assert m["at"] >= firsts[body]["at"] + invisible_s - 1, (m["at"] - firsts[body]["at"], m)
