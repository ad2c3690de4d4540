"""The Consumer and ConsumerAdmin services of a BrokerApp in-process, over real gRPC: pulls and
long polling, tag filtering, statuses, every bad input, sessions and membership, offsets across
a restart, resets told to sessions, queue locks, and lag."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.common.clock import SYSTEM_CLOCK, Clock, ManualClock
from apogee.common.errors import ApogeeError
from apogee.rpc.mux import MuxClient
from apogee.rpc.server import check_health
from apogee.testkit.broker import decode_records, running_broker, small_settings
from apogee.testkit.store import watched_offsets
from apogee.testkit.waiting import eventually
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2, consumer_pb2, consumer_pb2_grpc
from apogee_broker.app import BrokerApp
from apogee_broker.settings import BrokerSettings

pytestmark = pytest.mark.integration

pb = consumer_pb2
KIND_KEY = "apogee-error-kind"
HOUR_S = 3600
PULL_STREAM = "/apogee.v1.Consumer/PullStream"
SessionCall = grpc.aio.StreamStreamCall[pb.SessionRequest, pb.SessionEvent]


@dataclass
class Client:
    """A broker in-process and stubs on one channel to it."""

    app: BrokerApp
    consumer: consumer_pb2_grpc.ConsumerAsyncStub
    admin: consumer_pb2_grpc.ConsumerAdminAsyncStub
    broker: broker_pb2_grpc.BrokerAsyncStub
    topics: broker_pb2_grpc.BrokerAdminAsyncStub
    #: pulls on Consumer.PullStream
    pulls: MuxClient[pb.PullResponse]

    async def put_topic(self, name: str, queues: int = 4, perm: int = 6) -> None:
        await self.topics.PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(
                    name=name, read_queues=queues, write_queues=queues, perm=perm
                )
            ),
            timeout=5,
        )

    async def send(
        self, topic: str, bodies: list[bytes], queue_id: int = 0, tags: str = ""
    ) -> list[broker_pb2.SendResult]:
        reply = await self.broker.SendMessages(
            broker_pb2.SendMessagesRequest(
                messages=[
                    common_pb2.Message(topic=topic, body=b, queue_id=queue_id, tags=tags)
                    for b in bodies
                ]
            ),
            timeout=5,
        )
        assert all(r.status.code == 0 for r in reply.results), reply
        store = self.app.store
        assert store is not None
        # readable by pulls once dispatched (a held pull would wait for it by itself)
        assert await asyncio.to_thread(store.wait_dispatched, 5.0)
        return list(reply.results)

    async def pull(self, timeout: float = 5, **fields: Any) -> pb.PullResponse:
        fields.setdefault("group", "g")
        fields.setdefault("client_id", "c1")
        fields.setdefault("topic", "T")
        request = pb.PullRequest(**fields).SerializeToString()
        return await self.pulls.call(request, timeout, no_unary)

    async def join(
        self, client_id: str, group: str = "g", topics: tuple[str, ...] = ("T",), tags: str = ""
    ) -> tuple[SessionCall, pb.SessionEvent]:
        """Open a session, send its first heartbeat, return it with the first event."""
        call = self.consumer.Session()
        await call.write(heartbeat(client_id, group, topics, tags))
        return call, await read(call)


@contextlib.asynccontextmanager
async def connected(settings: BrokerSettings, clock: Clock = SYSTEM_CLOCK) -> AsyncIterator[Client]:
    async with running_broker(settings, clock) as app, grpc.aio.insecure_channel(app.address) as ch:
        pulls = pull_stream(ch)
        try:
            yield Client(
                app,
                consumer_pb2_grpc.ConsumerStub(ch),
                consumer_pb2_grpc.ConsumerAdminStub(ch),
                broker_pb2_grpc.BrokerStub(ch),
                broker_pb2_grpc.BrokerAdminStub(ch),
                pulls,
            )
        finally:
            await pulls.close()


def pull_stream(ch: grpc.aio.Channel) -> MuxClient[pb.PullResponse]:
    return MuxClient(ch, PULL_STREAM, pb.PullStreamResponse.FromString, "broker b1")


async def no_unary() -> pb.PullResponse:
    raise AssertionError("the broker serves PullStream: nothing else is tried")


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[Client]:
    async with connected(small_settings(tmp_path / "b", broker_name="b1")) as c:
        await c.put_topic("T")
        yield c


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start_ms=time.time_ns() // 1_000_000)


@pytest.fixture
async def manual(tmp_path: Path, clock: ManualClock) -> AsyncIterator[Client]:
    """A broker on a clock that moves only when told to (lag, expiry, retention)."""
    async with connected(small_settings(tmp_path / "m", broker_name="b1"), clock) as c:
        await c.put_topic("T")
        yield c


def heartbeat(
    client_id: str,
    group: str = "g",
    topics: tuple[str, ...] = ("T",),
    tags: str = "",
    mode: int = pb.CLUSTERING,
) -> pb.SessionRequest:
    return pb.SessionRequest(
        heartbeat=pb.Heartbeat(
            client_id=client_id,
            group=group,
            mode=mode,  # type: ignore[arg-type]
            subscriptions=[pb.Subscription(topic=t, tag_expression=tags) for t in topics],
            heartbeat_interval_ms=30_000,
        )
    )


async def read(call: SessionCall, timeout: float = 3.0) -> pb.SessionEvent:
    event = await asyncio.wait_for(call.read(), timeout)
    assert isinstance(event, pb.SessionEvent), event
    return event


def members_of(event: pb.SessionEvent) -> list[str]:
    assert event.WhichOneof("kind") == "members_changed", event
    return list(event.members_changed.client_ids)


def kind_of(exc: grpc.aio.AioRpcError) -> str:
    for key, value in exc.trailing_metadata() or ():
        if key == KIND_KEY:
            return value if isinstance(value, str) else value.decode()
    return ""


def bodies(resp: pb.PullResponse) -> list[bytes]:
    msgs = decode_records(resp.records)
    assert len(msgs) == resp.count
    return [m.body for m in msgs]


# -- pulls ----------------------------------------------------------------------------------------


async def test_health_covers_the_consumer_services(client: Client) -> None:
    for service in ("apogee.v1.Consumer", "apogee.v1.ConsumerAdmin"):
        assert await check_health(client.app.address, timeout=5, service=service)


async def test_a_pull_returns_what_was_sent(client: Client) -> None:
    sent = await client.send("T", [f"m{i}".encode() for i in range(5)], queue_id=1, tags="TagA")
    got = await client.pull(queue_id=1, offset=0)
    assert got.status == pb.PULL_FOUND
    assert (got.count, got.next_offset, got.min_offset, got.max_offset) == (5, 5, 0, 5)
    assert got.broker_name == "b1"
    msgs = decode_records(got.records)
    assert [m.body for m in msgs] == [f"m{i}".encode() for i in range(5)]
    assert [(m.topic, m.queue_id, m.queue_offset) for m in msgs] == [("T", 1, i) for i in range(5)]
    assert [m.unique_id for m in msgs] == [r.unique_id for r in sent]
    assert {m.tags for m in msgs} == {"TagA"}
    part = await client.pull(queue_id=1, offset=2, max_messages=2)
    assert (bodies(part), part.next_offset) == ([b"m2", b"m3"], 4)
    t0 = time.monotonic()
    done = await client.pull(queue_id=1, offset=5)  # hold_ms 0: answered at once
    assert (done.status, done.next_offset, done.count, done.records) == (
        pb.PULL_NO_NEW_MESSAGE,
        5,
        0,
        b"",
    )
    assert time.monotonic() - t0 < 1.0


async def test_a_held_pull_is_answered_as_soon_as_a_message_arrives(client: Client) -> None:
    held = asyncio.create_task(client.pull(offset=0, hold_ms=10_000, timeout=20))
    pulling = client.app.pulling
    assert pulling is not None
    await eventually(lambda: pulling.held == 1, 5, "the pull is held")
    t0 = time.monotonic()
    await client.send("T", [b"now"])
    got = await asyncio.wait_for(held, 5)
    assert time.monotonic() - t0 < 0.5  # well before the 10 s hold
    assert (got.status, bodies(got)) == (pb.PULL_FOUND, [b"now"])


async def test_without_a_message_a_held_pull_returns_after_hold_ms(client: Client) -> None:
    t0 = time.monotonic()
    got = await client.pull(offset=0, hold_ms=400)
    assert 0.38 <= time.monotonic() - t0 < 2.0
    assert (got.status, got.next_offset) == (pb.PULL_NO_NEW_MESSAGE, 0)


async def test_a_held_pull_ends_before_the_calls_deadline(client: Client) -> None:
    t0 = time.monotonic()
    got = await client.pull(offset=0, hold_ms=30_000, timeout=0.8)
    assert time.monotonic() - t0 < 0.8
    assert got.status == pb.PULL_NO_NEW_MESSAGE


async def test_a_held_pull_whose_stream_the_client_ends_leaves_nothing_behind(
    client: Client,
) -> None:
    assert client.app.address
    async with grpc.aio.insecure_channel(client.app.address) as ch:
        mux = pull_stream(ch)
        request = pb.PullRequest(group="g", client_id="c1", topic="T", offset=0, hold_ms=10_000)
        call = asyncio.create_task(mux.call(request.SerializeToString(), 20, no_unary))
        pulling, store = client.app.pulling, client.app.store
        assert pulling is not None
        assert store is not None
        await eventually(lambda: pulling.held == 1, 5, "the pull is held")
        await mux.close()  # the stream ends under the held pull
        with pytest.raises(ApogeeError):
            await call
    await eventually(
        lambda: pulling.held == 0 and store.notifier.pending() == 0, 5, "the hold ended"
    )
    await client.send("T", [b"after"])
    assert bodies(await client.pull(offset=0)) == [b"after"]


async def test_long_poll_max_ms_caps_hold_ms(tmp_path: Path) -> None:
    async with connected(small_settings(tmp_path / "b", long_poll_max_ms=300)) as c:
        await c.put_topic("T")
        t0 = time.monotonic()
        await c.pull(offset=0, hold_ms=60_000)
        assert 0.28 <= time.monotonic() - t0 < 2.0


async def test_stopping_the_broker_answers_held_pulls_and_ends_sessions(tmp_path: Path) -> None:
    async with connected(small_settings(tmp_path / "b", shutdown_grace_s=10)) as c:
        await c.put_topic("T")
        held = [
            asyncio.create_task(c.pull(offset=0, queue_id=q, hold_ms=15_000, timeout=30))
            for q in range(4)
        ]
        session, _ = await c.join("c1")
        pulling = c.app.pulling
        assert pulling is not None
        await eventually(lambda: pulling.held == 4, 5, "the pulls are held")
        t0 = time.monotonic()
        await c.app.stop()
        assert time.monotonic() - t0 < 3.0  # not the 15 s hold, not the 10 s grace
        answers = await asyncio.wait_for(asyncio.gather(*held), 5)
        assert {a.status for a in answers} == {pb.PULL_NO_NEW_MESSAGE}
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await read(session)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stopping" in (caught.value.details() or "")


async def test_tag_filtering_is_exact_with_colliding_tags(
    client: Client, crc32_twins: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = crc32_twins
    for tag, body in ((a, b"a0"), (b, b"b0"), ("other", b"o0"), (a, b"a1"), (b, b"b1")):
        await client.send("T", [body], tags=tag)
    only_a = await client.pull(offset=0, tag_expression=a)
    assert (bodies(only_a), only_a.next_offset) == ([b"a0", b"a1"], 5)
    only_b = await client.pull(offset=0, tag_expression=b)
    assert bodies(only_b) == [b"b0", b"b1"]
    both = await client.pull(offset=0, tag_expression=f"{a} || other")
    assert bodies(both) == [b"a0", b"o0", b"a1"]
    everything = await client.pull(offset=0, tag_expression="*")
    assert everything.count == 5
    nothing = await client.pull(offset=0, tag_expression="missing")
    assert (nothing.status, nothing.next_offset, nothing.count) == (
        pb.PULL_NO_MATCHED_MESSAGE,
        5,
        0,
    )
    # a held filtered pull ignores the twin and answers the real match
    held = asyncio.create_task(client.pull(offset=5, tag_expression=a, hold_ms=10_000, timeout=20))
    pulling = client.app.pulling
    assert pulling is not None
    await eventually(lambda: pulling.held == 1, 5, "the pull is held")
    store = client.app.store
    assert store is not None
    watched = watched_offsets(store, monkeypatch)
    await client.send("T", [b"b2"], tags=b)  # wakes the pull: it reads the twin and holds on
    await eventually(lambda: 6 in watched, 5, "the pull holding on past the twin")
    assert not held.done()
    await client.send("T", [b"a2"], tags=a)
    got = await asyncio.wait_for(held, 5)
    assert [(m.body, m.queue_offset) for m in decode_records(got.records)] == [(b"a2", 6)]


async def test_sql_filtering_at_the_broker(client: Client) -> None:
    """RocketMQ's MessageSelector.bySql: a condition on properties, evaluated at the broker."""
    sent = [
        ("red", "1", b"r1"),
        ("blue", "5", b"b5"),
        ("red", "7", b"r7"),
        (None, "9", b"n9"),
        ("red", "x", b"rx"),
    ]
    reply = await client.broker.SendMessages(
        broker_pb2.SendMessagesRequest(
            messages=[
                common_pb2.Message(
                    topic="T",
                    body=body,
                    queue_id=0,
                    properties={"size": size} | ({"color": color} if color else {}),
                )
                for color, size, body in sent
            ]
        ),
        timeout=5,
    )
    assert all(r.status.code == 0 for r in reply.results), reply
    store = client.app.store
    assert store is not None
    assert await asyncio.to_thread(store.wait_dispatched, 5.0)

    async def selected(sql: str, **fields: Any) -> list[bytes]:
        return bodies(await client.pull(offset=0, sql_expression=sql, **fields))

    assert await selected("color = 'red'") == [b"r1", b"r7", b"rx"]
    assert await selected("color = 'red' AND size > 3") == [b"r7"]  # 'x' is no number
    assert await selected("size BETWEEN 2 AND 8") == [b"b5", b"r7"]
    assert await selected("color IN ('blue', 'green') OR color IS NULL") == [b"b5", b"n9"]
    assert await selected("NOT (color = 'red')") == [b"b5"]  # NULL is neither
    nothing = await client.pull(offset=0, sql_expression="color = 'pink'")
    assert (nothing.status, nothing.next_offset) == (pb.PULL_NO_MATCHED_MESSAGE, 5)
    # a condition that does not parse is refused, naming the field and the position
    with pytest.raises(ApogeeError) as caught:
        await client.pull(offset=0, sql_expression="color = 'red' AND")
    assert caught.value.kind.name == "INVALID_ARGUMENT"
    assert str(caught.value) == (
        "sql_expression: syntax error at position 18: expected a condition after 'AND', "
        "got end of expression"
    )


async def test_offset_statuses(manual: Client, clock: ManualClock) -> None:
    await manual.send("T", [b"x"] * 3)
    over = await manual.pull(offset=10)
    assert (over.status, over.next_offset, over.max_offset) == (pb.PULL_OFFSET_OVERFLOW, 3, 3)
    never = await manual.pull(queue_id=2, offset=4)  # a queue never written
    assert (never.status, never.next_offset) == (pb.PULL_OFFSET_OVERFLOW, 0)
    store = manual.app.store
    assert store is not None
    big = [bytes(60_000)] * 10
    while store.commitlog.max_offset <= 2 * store.cfg.commitlog_file_size:
        await manual.send("T", big)
    clock.advance(73 * HOUR_S)  # past the 72 h retention
    await asyncio.to_thread(store.retention.run_once)
    low = store.min_offset("T", 0)
    assert low > 0
    small = await manual.pull(offset=0)
    assert (small.status, small.next_offset, small.min_offset) == (
        pb.PULL_OFFSET_TOO_SMALL,
        low,
        low,
    )
    again = await manual.pull(offset=small.next_offset, max_messages=1)
    assert decode_records(again.records)[0].queue_offset == low


# -- bad input ------------------------------------------------------------------------------------


async def test_every_bad_pull_gets_its_own_error_and_the_server_goes_on(client: Client) -> None:
    await client.put_topic("WriteOnly", perm=2)
    await client.send("T", [b"x"] * 3)
    cases: list[tuple[dict[str, Any], grpc.StatusCode, str, str]] = [
        (
            {"group": ""},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "group: must not be empty",
        ),
        (
            {"group": "a b"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "group: 'a b' has a character outside [%|a-zA-Z0-9_-]",
        ),
        (
            {"client_id": ""},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "client_id: must not be empty",
        ),
        (
            {"topic": "a b"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_TOPIC",
            "topic 'a b': has a character outside [%|a-zA-Z0-9_-]",
        ),
        (
            {"topic": "Nope"},
            grpc.StatusCode.NOT_FOUND,
            "UNKNOWN_TOPIC",
            "topic 'Nope' does not exist on broker b1",
        ),
        (
            {"topic": "WriteOnly"},
            grpc.StatusCode.PERMISSION_DENIED,
            "PERMISSION_DENIED",
            "topic 'WriteOnly': is not readable on broker b1 (perm -W-, read permission R is "
            "missing)",
        ),
        (
            {"queue_id": 4},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_QUEUE_ID",
            "queue_id 4: must be between 0 and 3: topic 'T' has 4 read queues on broker b1",
        ),
        (
            {"queue_id": -1},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_QUEUE_ID",
            "queue_id -1: must be between 0 and 3: topic 'T' has 4 read queues on broker b1",
        ),
        (
            {"offset": -1},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "offset: must not be negative, got -1",
        ),
        (
            {"tag_expression": "A || || B"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "tag_expression: 'A || || B' has an empty tag: write tags separated by '||', e.g. "
            "'A || B'",
        ),
        (
            {"commit_offset": -4},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "commit_offset: must not be negative, got -4",
        ),
    ]
    for fields, code, kind, details in cases:
        with pytest.raises(ApogeeError) as caught:
            await client.pull(**fields)
        err = caught.value
        assert (err.code, err.kind.name, str(err)) == (code.name, kind, details), fields
    ok = await client.pull(offset=0)
    assert ok.count == 3


async def test_caps_on_messages_and_bytes(tmp_path: Path) -> None:
    settings = small_settings(tmp_path / "b", pull_max_messages=20, pull_max_bytes=4096)
    async with connected(settings) as c:
        await c.put_topic("T")
        await c.send("T", [bytes(10)] * 40)
        assert (await c.pull(offset=0)).count == 20  # the default 32, capped
        assert (await c.pull(offset=0, max_messages=5)).count == 5
        assert (await c.pull(offset=0, max_messages=4_000_000)).count == 20
        await c.send("T", [bytes(3000)] * 3, queue_id=1)
        assert (await c.pull(offset=0, queue_id=1)).count == 1  # 4096 bytes hold one
        assert (await c.pull(offset=0, queue_id=1, max_bytes=10)).count == 1  # at least one


async def test_bad_requests_of_the_other_calls(client: Client) -> None:
    await client.send("T", [b"x"] * 2)
    calls: list[tuple[Any, str]] = [
        (
            client.consumer.CommitOffsets(
                pb.CommitOffsetsRequest(
                    group="g",
                    offsets=[
                        pb.QueueOffset(topic="T", queue_id=0, offset=1),
                        pb.QueueOffset(topic="T", queue_id=0, offset=-5),
                    ],
                ),
                timeout=5,
            ),
            "offsets[1]: must not be negative, got -5",
        ),
        (
            client.consumer.QueryOffsets(
                pb.QueryOffsetsRequest(group="g", topic="T", queue_ids=[7]), timeout=5
            ),
            "queue_id 7: must be between 0 and 3: topic 'T' has 4 read queues on broker b1",
        ),
        (
            client.consumer.LockQueues(
                pb.LockQueuesRequest(group="g", queues=[pb.QueueRef(topic="T")]), timeout=5
            ),
            "client_id: must not be empty",
        ),
        (client.consumer.GetMembers(pb.GetMembersRequest(), timeout=5), "group: must not be empty"),
        (
            client.admin.ResetOffsets(pb.ResetOffsetsRequest(group="g", topic="T"), timeout=5),
            "to: choose one of earliest, latest or timestamp_ms",
        ),
        (
            client.admin.ResetOffsets(
                pb.ResetOffsetsRequest(group="g", topic="T", earliest=False), timeout=5
            ),
            "earliest: must be true when chosen",
        ),
        (
            client.admin.DescribeGroup(pb.DescribeGroupRequest(group="x y"), timeout=5),
            "group: 'x y' has a character outside [%|a-zA-Z0-9_-]",
        ),
    ]
    for call, details in calls:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert (caught.value.code(), caught.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            details,
        )
    queried = await client.consumer.QueryOffsets(
        pb.QueryOffsetsRequest(group="g", topic="T", queue_ids=[0]), timeout=5
    )
    assert queried.queues[0].committed == -1  # the refused commit changed nothing


# -- sessions -------------------------------------------------------------------------------------


async def test_sessions_and_membership(client: Client) -> None:
    c1, first = await client.join("c1")
    assert members_of(first) == ["c1"]
    assert first.members_changed.group == "g"
    c2, second = await client.join("c2")
    assert members_of(second) == ["c1", "c2"]
    assert members_of(await read(c1)) == ["c1", "c2"]
    await c1.write(heartbeat("c1"))  # a renewal: no event, still a member
    listed = await client.consumer.GetMembers(pb.GetMembersRequest(group="g"), timeout=5)
    assert [m.client_id for m in listed.members] == ["c1", "c2"]
    m = listed.members[0]
    assert m.host.startswith("127.0.0.1:")
    assert m.mode == pb.CLUSTERING
    assert [(s.topic, s.tag_expression) for s in m.subscriptions] == [("T", "")]
    assert m.last_heartbeat_ms > 0
    t0 = time.monotonic()
    c2.cancel()  # the client goes away: the other member hears of it at once
    assert members_of(await read(c1)) == ["c1"]
    assert time.monotonic() - t0 < 1.0
    await c1.done_writing()  # the client closes its side: the stream ends cleanly
    assert await c1.code() == grpc.StatusCode.OK
    sessions = client.app.sessions
    assert sessions is not None
    await eventually(lambda: len(sessions) == 0, 5, "no session is left")
    listed = await client.consumer.GetMembers(pb.GetMembersRequest(group="g"), timeout=5)
    assert list(listed.members) == []


async def test_bad_sessions_end_with_the_error_and_the_server_goes_on(client: Client) -> None:
    not_a_heartbeat = client.consumer.Session()
    await not_a_heartbeat.write(pb.SessionRequest())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await read(not_a_heartbeat)
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "kind: each request of a session must be a heartbeat, got none",
    )
    no_mode = client.consumer.Session()
    await no_mode.write(heartbeat("c1", mode=pb.CONSUME_MODE_UNSPECIFIED))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await read(no_mode)
    assert caught.value.details() == (
        "heartbeat.mode: must be CLUSTERING or BROADCASTING, got unspecified"
    )
    assert kind_of(caught.value) == "INVALID_ARGUMENT"
    later_bad, _ = await client.join("c2")
    await later_bad.write(heartbeat("c2", topics=("bad topic",)))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await read(later_bad)
    assert caught.value.details() == (
        "heartbeat.subscriptions[0].topic: 'bad topic' has a character outside [%|a-zA-Z0-9_-]"
    )
    good, event = await client.join("c3")
    assert members_of(event) == ["c3"]  # c2 left with its bad heartbeat
    good.cancel()


async def test_conflicting_members_are_warned_about(client: Client) -> None:
    c1, _ = await client.join("c1", tags="A")
    c2, _ = await client.join("c2", tags="B")
    described = await client.admin.DescribeGroup(pb.DescribeGroupRequest(group="g"), timeout=5)
    assert list(described.warnings) == [
        "members select different messages of topic T (messages of a queue assigned to a client "
        "that does not select them are skipped): 'A' by c1; 'B' by c2"
    ]
    c1.cancel()
    c2.cancel()


# -- offsets --------------------------------------------------------------------------------------


async def test_offsets_survive_a_restart(tmp_path: Path) -> None:
    settings = small_settings(tmp_path / "b")
    async with connected(settings) as c:
        await c.put_topic("T")
        await c.send("T", [b"x"] * 5, queue_id=0)
        await c.send("T", [b"x"] * 3, queue_id=2)
        await c.consumer.CommitOffsets(
            pb.CommitOffsetsRequest(
                group="g", client_id="c1", offsets=[pb.QueueOffset(topic="T", queue_id=0, offset=4)]
            ),
            timeout=5,
        )
        await c.pull(queue_id=2, offset=3, commit_offset=3)  # piggybacked
    async with connected(settings) as c:
        got = await c.consumer.QueryOffsets(pb.QueryOffsetsRequest(group="g", topic="T"), timeout=5)
        assert got.topic == "T"
        assert [(q.queue_id, q.committed, q.min_offset, q.max_offset) for q in got.queues] == [
            (0, 4, 0, 5),
            (1, -1, 0, 0),
            (2, 3, 0, 3),
            (3, -1, 0, 0),
        ]
        groups = await c.admin.ListGroups(pb.ListGroupsRequest(), timeout=5)
        assert [(g.group, g.members, list(g.topics)) for g in groups.groups] == [("g", 0, ["T"])]


async def test_a_reset_moves_offsets_and_tells_the_sessions(
    manual: Client, clock: ManualClock
) -> None:
    start = clock.time_ms()
    for i in range(6):
        await manual.send("T", [f"m{i}".encode()], queue_id=1)
        clock.advance(1)
    s1, _ = await manual.join("c1")
    s2, _ = await manual.join("c2")
    await read(s1)  # c2 joined
    latest = await manual.admin.ResetOffsets(
        pb.ResetOffsetsRequest(group="g", topic="T", latest=True), timeout=5
    )
    assert [(o.topic, o.queue_id, o.offset) for o in latest.offsets] == [
        ("T", 0, 0),
        ("T", 1, 6),
        ("T", 2, 0),
        ("T", 3, 0),
    ]
    for session in (s1, s2):
        event = await read(session)
        assert event.WhichOneof("kind") == "offsets_reset"
        reset = event.offsets_reset
        assert (reset.group, reset.topic) == ("g", "T")
        assert [(o.queue_id, o.offset) for o in reset.offsets] == [(0, 0), (1, 6), (2, 0), (3, 0)]
    by_time = await manual.admin.ResetOffsets(
        pb.ResetOffsetsRequest(group="g", topic="T", timestamp_ms=start + 2_500), timeout=5
    )
    assert [o.offset for o in by_time.offsets] == [0, 3, 0, 0]
    assert [o.offset for o in (await read(s1)).offsets_reset.offsets] == [0, 3, 0, 0]
    queried = await manual.consumer.QueryOffsets(
        pb.QueryOffsetsRequest(group="g", topic="T", queue_ids=[1]), timeout=5
    )
    assert queried.queues[0].committed == 3
    s1.cancel()
    s2.cancel()


# -- locks ----------------------------------------------------------------------------------------


async def lock(c: Client, client_id: str, *queues: int) -> list[int]:
    got = await c.consumer.LockQueues(
        pb.LockQueuesRequest(
            group="g",
            client_id=client_id,
            queues=[pb.QueueRef(topic="T", queue_id=q) for q in queues],
        ),
        timeout=5,
    )
    return [q.queue_id for q in got.locked]


async def test_locks_are_exclusive_expire_and_go_with_their_holder(
    manual: Client, clock: ManualClock
) -> None:
    assert await lock(manual, "c1", 0, 1) == [0, 1]
    assert await lock(manual, "c2", 1, 2) == [2]
    assert await lock(manual, "c1", 0, 1) == [0, 1]  # renewed
    described = await manual.admin.DescribeGroup(pb.DescribeGroupRequest(group="g"), timeout=5)
    assert [(q.queue_id, q.locked_by) for q in described.queues] == []  # no topic known yet
    await manual.consumer.UnlockQueues(
        pb.UnlockQueuesRequest(
            group="g", client_id="c1", queues=[pb.QueueRef(topic="T", queue_id=0)]
        ),
        timeout=5,
    )
    assert await lock(manual, "c2", 0) == [0]
    clock.advance(61)  # lock_expiry_ms 60 s without renewal
    assert await lock(manual, "c3", 0, 1, 2) == [0, 1, 2]
    # a member whose session ends loses its locks at once
    session, _ = await manual.join("c4")
    clock.advance(61)
    assert await lock(manual, "c4", 3) == [3]
    assert await lock(manual, "c5", 3) == []
    described = await manual.admin.DescribeGroup(pb.DescribeGroupRequest(group="g"), timeout=5)
    assert [(q.queue_id, q.locked_by) for q in described.queues] == [
        (0, ""),
        (1, ""),
        (2, ""),
        (3, "c4"),
    ]
    session.cancel()
    groups = manual.app.groups
    assert groups is not None
    await eventually(lambda: groups.client_ids("g") == [], 5, "c4 has left")
    assert await lock(manual, "c5", 3) == [3]


# -- lag ------------------------------------------------------------------------------------------


async def test_describe_group_lag(manual: Client, clock: ManualClock) -> None:
    stored = []
    for i in range(10):
        stored += await manual.send("T", [f"m{i}".encode()], queue_id=0)
        clock.advance(2)
    await manual.send("T", [b"x", b"y"], queue_id=1)
    session, _ = await manual.join("c1")
    await manual.consumer.CommitOffsets(
        pb.CommitOffsetsRequest(
            group="g",
            offsets=[
                pb.QueueOffset(topic="T", queue_id=0, offset=4),
                pb.QueueOffset(topic="T", queue_id=1, offset=2),
            ],
        ),
        timeout=5,
    )
    clock.advance(5)
    d = await manual.admin.DescribeGroup(pb.DescribeGroupRequest(group="g"), timeout=5)
    assert (d.group, d.broker_name) == ("g", "b1")
    assert [m.client_id for m in d.members] == ["c1"]
    lags = [
        (q.topic, q.queue_id, q.broker_offset, q.consumer_offset, q.lag_messages, q.lag_ms)
        for q in d.queues
    ]
    oldest_waiting = clock.time_ms() - stored[4].store_timestamp_ms
    assert oldest_waiting == 17_000  # stored 6 s (3 sends of 2 s) before the last, then 5 s
    assert lags == [
        ("T", 0, 10, 4, 6, oldest_waiting),
        ("T", 1, 2, 2, 0, 0),  # caught up
        ("T", 2, 0, -1, -1, -1),  # nothing committed: unknown
        ("T", 3, 0, -1, -1, -1),
    ]
    assert list(d.warnings) == []
    listed = await manual.admin.ListGroups(pb.ListGroupsRequest(), timeout=5)
    assert [(g.group, g.members, g.mode, list(g.topics)) for g in listed.groups] == [
        ("g", 1, pb.CLUSTERING, ["T"])
    ]
    unknown = await manual.admin.DescribeGroup(pb.DescribeGroupRequest(group="nobody"), timeout=5)
    assert (list(unknown.members), list(unknown.queues)) == ([], [])
    session.cancel()
