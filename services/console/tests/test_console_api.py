"""Every endpoint of the API in open mode (no login) against a real local cluster: happy paths,
refusals, and errors in the same sentence the CLI prints."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import time

import grpc.aio
import httpx
import pytest
from console_support import FAST_CONSUMER, assert_problem, console_app, create_topic, csrf_of
from google.protobuf.duration_pb2 import Duration

from apogee.client import (
    AdminClient,
    ConsumeResult,
    Message,
    Producer,
    PushConsumer,
    ReceivedMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
)
from apogee.local.cluster import ClusterState
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.rocketmq.v2 import service_pb2_grpc as sg
from apogee.testkit.cluster import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_health_ready_and_the_pages(cluster: ClusterState) -> None:
    async with console_app(cluster.namesrv) as (_app, client):
        health = await client.get("/healthz")
        assert (health.status_code, health.text) == (200, "ok")
        assert (await client.get("/readyz")).status_code == 200
        for path in ("/", "/ui/topics", "/ui/groups/detail"):
            page = await client.get(path)
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            assert page.headers["x-frame-options"] == "DENY"
        assert (await client.get("/static/index.html")).status_code == 200
        assert_problem(await client.get("/static/nope.js"), 404, "NOT_FOUND")
        assert_problem(await client.get("/api/v1/nope"), 404, "NOT_FOUND")
        openapi = (await client.get("/openapi.json")).json()
        assert "/api/v1/groups/{name}" in openapi["paths"]
    async with console_app("127.0.0.1:1", request_timeout_s=0.5) as (_app, client):
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code == 503
        assert_problem(await client.get("/api/v1/topics"), 503, "UNAVAILABLE")


async def test_open_mode_session_and_csrf(cluster: ClusterState) -> None:
    async with console_app(cluster.namesrv) as (app, client):
        me = (await client.get("/api/v1/session")).json()
        assert me["user"] == "anonymous"
        assert (me["role"], me["auth"], me["via"], me["expires_at"]) == (
            "admin",
            False,
            "open",
            None,
        )
        # even open, an action needs the header (a cross-site form cannot set it)
        body = assert_problem(
            await client.post("/api/v1/topics", json={"name": "NoCsrf"}), 403, "CSRF"
        )
        assert "X-CSRF-Token" in body["detail"]
        wrong = {"X-CSRF-Token": "not-it"}
        assert_problem(await client.delete("/api/v1/topics/NoCsrf", headers=wrong), 403, "CSRF")
        registry = app.state.console.metrics.registry
        assert registry.get_sample_value("apogee_console_refusals_total", {"reason": "csrf"}) == 2
        assert (
            registry.get_sample_value(
                "apogee_console_requests_total",
                {"route": "/api/v1/topics", "method": "POST", "status": "403"},
            )
            == 1
        )


async def test_cluster_view(cluster: ClusterState) -> None:
    async with console_app(cluster.namesrv) as (_app, client):
        body = (await client.get("/api/v1/cluster")).json()
    assert body["nameservers"] == [{"address": cluster.namesrv, "ok": True}]
    assert [b["name"] for b in body["brokers"]] == ["broker-a", "broker-b"]
    assert {b["address"] for b in body["brokers"]} == {p.address for p in cluster.brokers}
    for b in body["brokers"]:
        assert b["ok"] is True
        assert b["recovery"]["clean"] in (True, False)
    assert body["auth"] is False


async def test_topic_create_describe_update_delete(cluster: ClusterState) -> None:
    async with console_app(cluster.namesrv) as (_app, client):
        h = await csrf_of(client)
        created = await client.post("/api/v1/topics", json={"name": "Life", "queues": 2}, headers=h)
        assert created.status_code == 201, created.text
        assert {b["broker"] for b in created.json()["brokers"]} == {"broker-a", "broker-b"}
        assert {b["message_type"] for b in created.json()["brokers"]} == {"MIXED"}  # the default

        async def listed() -> bool:
            return any(t["name"] == "Life" for t in (await client.get("/api/v1/topics")).json())

        await eventually(listed, 20, "Life in the topic list")
        row = next(t for t in (await client.get("/api/v1/topics")).json() if t["name"] == "Life")
        assert (row["queues"], row["messages"], row["system"]) == (4, 0, False)
        assert row["message_type"] == "MIXED"
        detail = (await client.get("/api/v1/topics/Life")).json()
        assert (detail["perm"], detail["message_type"]) == ("RW-", "MIXED")
        assert sorted((q["broker"], q["queue_id"]) for q in detail["queues"]) == [
            ("broker-a", 0), ("broker-a", 1), ("broker-b", 0), ("broker-b", 1),
        ]  # fmt: skip
        updated = await client.put(
            "/api/v1/topics/Life", json={"queues": 3, "perm": "r"}, headers=h
        )
        assert updated.status_code == 200, updated.text
        assert {(b["queues"], b["perm"]) for b in updated.json()["brokers"]} == {(3, "R--")}
        typed = await client.put(
            "/api/v1/topics/Life", json={"queues": 3, "message_type": "fifo"}, headers=h
        )
        assert typed.status_code == 200, typed.text
        assert {b["message_type"] for b in typed.json()["brokers"]} == {"FIFO"}
        kept = await client.put("/api/v1/topics/Life", json={"queues": 3}, headers=h)
        assert {b["message_type"] for b in kept.json()["brokers"]} == {"FIFO"}  # left out: kept
        assert (await client.get("/api/v1/topics/Life")).json()["message_type"] == "FIFO"
        row = next(t for t in (await client.get("/api/v1/topics")).json() if t["name"] == "Life")
        assert row["message_type"] == "FIFO"
        deleted = await client.delete("/api/v1/topics/Life", headers=h)
        assert deleted.json()["deleted_from"] == ["broker-a", "broker-b"]
        gone = assert_problem(await client.get("/api/v1/topics/Life"), 404, "UNKNOWN_TOPIC")
        assert gone["detail"] == "topic 'Life' is not on any live broker"


async def test_refusals_name_the_field_and_say_what_the_cli_says(cluster: ClusterState) -> None:
    async with console_app(cluster.namesrv) as (_app, client):
        h = await csrf_of(client)
        missing = assert_problem(
            await client.post("/api/v1/topics", json={"queues": 2}, headers=h),
            400,
            "INVALID_ARGUMENT",
        )
        assert missing["field"] == "name"
        assert missing["detail"].startswith("name: ")
        typed = assert_problem(
            await client.post("/api/v1/topics", json={"name": "X", "queues": "many"}, headers=h),
            400,
            "INVALID_ARGUMENT",
        )
        assert typed["field"] == "queues"
        ranged = assert_problem(
            await client.post("/api/v1/topics", json={"name": "X", "queues": 0}, headers=h),
            400,
            "INVALID_ARGUMENT",
        )
        assert ranged["detail"] == "queues: must be an integer from 1 to 1024, got 0"
        for bad, got in (("ORDERED", "'ORDERED'"), (3, "3"), ("", "''")):
            untyped = assert_problem(
                await client.post(
                    "/api/v1/topics", json={"name": "X", "message_type": bad}, headers=h
                ),
                400,
                "INVALID_ARGUMENT",
            )
            assert untyped["field"] == "message_type"
            assert untyped["detail"] == (
                f"message_type: must be one of NORMAL, FIFO, DELAY, TRANSACTION, MIXED, got {got}"
            )
        bad_query = assert_problem(
            await client.get("/api/v1/messages", params={"topic": "X", "limit": 0}),
            400,
            "INVALID_ARGUMENT",
        )
        assert bad_query["field"] == "limit"
        no_window = assert_problem(
            await client.get("/api/v1/messages", params={"topic": "X"}), 400, "INVALID_ARGUMENT"
        )
        assert no_window["detail"].startswith("begin_ms: ")
        system = assert_problem(
            await client.post("/api/v1/topics", json={"name": "TBW102"}, headers=h),
            403,
            "PERMISSION_DENIED",
        )
    cli = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "apogee.cli", "--namesrv", cluster.namesrv, "topic", "create",
         "TBW102"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")},
    )  # fmt: skip
    assert cli.returncode == 1
    assert cli.stderr.strip() == f"apogee: {system['detail']}"


#: The rule of a time, in the words `apogee` uses for --begin, --end and --timestamp.
TIME_RULE = (
    "must be a time from 1970-01-01 to 9999-12-31 UTC (0 to 253402300799999 ms since the epoch)"
)


async def test_numbers_out_of_range_are_refused_with_the_field_and_the_range(
    cluster: ClusterState,
) -> None:
    """Numbers the cluster's protobuf fields cannot hold: 400 naming the field and the range
    (times, counts, queue ids and offsets), never a 500."""
    await create_topic(cluster.namesrv, "Ranges")
    huge = "99999999999999999999999"
    async with console_app(cluster.namesrv) as (_app, client):
        h = await csrf_of(client)

        async def refused(resp: httpx.Response, field: str, rule: str, got: object) -> None:
            body = assert_problem(resp, 400, "INVALID_ARGUMENT")
            assert (body["field"], body["detail"]) == (field, f"{field}: {rule}, got {got}")

        # times: a search by time, by key, and the end of a window; a reset; a redrive
        searches: list[tuple[dict[str, str | int], str]] = [
            ({"topic": "Ranges", "begin_ms": huge}, "begin_ms"),
            ({"topic": "Ranges", "key": "k", "begin_ms": huge}, "begin_ms"),
            ({"topic": "Ranges", "begin_ms": 0, "end_ms": huge}, "end_ms"),
            ({"topic": "Ranges", "begin_ms": -1}, "begin_ms"),
        ]
        for params, field in searches:
            resp = await client.get("/api/v1/messages", params=params)
            await refused(resp, field, TIME_RULE, params[field])
        for ms in (10**29, 1e29):
            reset = {"topic": "Ranges", "to": "timestamp", "timestamp_ms": ms, "dry_run": True}
            resp = await client.post("/api/v1/groups/g-ranges/reset", json=reset, headers=h)
            await refused(resp, "timestamp_ms", TIME_RULE, ms)
        resp = await client.post("/api/v1/dlq/g-ranges/redrive", json={"since_ms": 10**29},
                                 headers=h)  # fmt: skip
        await refused(resp, "since_ms", TIME_RULE, 10**29)
        # counts
        resp = await client.post("/api/v1/topics", json={"name": "R2", "queues": 10**29},
                                 headers=h)  # fmt: skip
        await refused(resp, "queues", "must be an integer from 1 to 1024", 10**29)
        resp = await client.get("/api/v1/dlq/g-ranges", params={"limit": huge})
        await refused(resp, "limit", "must be an integer from 1 to 10000", huge)
        # a queue id and an offset (of the copy of a message to show)
        resp = await client.get("/api/v1/messages/AB12", params={"queue_id": 2**31})
        await refused(resp, "queue_id", "must be an integer from 0 to 2147483647", 2**31)
        resp = await client.get("/api/v1/messages/AB12", params={"queue_offset": 2**63})
        await refused(resp, "queue_offset", f"must be an integer from 0 to {2**63 - 1}", 2**63)
        # the edge of the range is taken
        last = await client.get(
            "/api/v1/messages", params={"topic": "Ranges", "begin_ms": 0, "end_ms": 253402300799999}
        )
        assert last.status_code == 200, last.text


async def test_send_and_find_messages(cluster: ClusterState) -> None:
    await create_topic(cluster.namesrv, "Msgs")
    async with console_app(cluster.namesrv) as (_app, client):
        h = await csrf_of(client)
        start_ms = int(time.time() * 1000) - 1000

        async def send(**body: object) -> dict[str, object]:
            resp = await client.post("/api/v1/messages", json={"topic": "Msgs", **body}, headers=h)
            assert resp.status_code == 201, resp.text
            out: dict[str, object] = resp.json()
            return out

        as_json = await send(
            body='{"order": 17, "items": ["a"]}',
            tags="created",
            keys=["o-17"],
            properties={"traceparent": TRACEPARENT},
        )
        as_text = await send(body="hello\nworld", keys=["o-18"])
        as_binary = await send(body=base64.b64encode(b"\x00\x01\xfe").decode(), encoding="base64")
        big = await send(body="x" * (70 * 1024))
        got = (await client.get(f"/api/v1/messages/{as_json['id']}")).json()
        assert (got["topic"], got["tags"], got["keys"]) == ("Msgs", "created", ["o-17"])
        assert got["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
        assert got["body"] == {
            "kind": "json",
            "preview": '{\n  "order": 17,\n  "items": [\n    "a"\n  ]\n}',
            "size": 29,
            "truncated": False,
        }
        assert (got["broker"], got["queue_id"], got["queue_offset"]) == (
            as_json["broker"], as_json["queue_id"], as_json["queue_offset"],
        )  # fmt: skip
        text = (await client.get(f"/api/v1/messages/{as_text['id']}")).json()
        assert text["body"]["kind"] == "text"
        assert text["body"]["preview"] == "hello\nworld"
        assert text["trace_id"] is None
        binary = (await client.get(f"/api/v1/messages/{as_binary['id']}")).json()
        assert binary["body"] == {
            "kind": "binary", "preview": "00 01 fe", "size": 3, "truncated": False,
        }  # fmt: skip
        cut = (await client.get(f"/api/v1/messages/{big['id']}")).json()["body"]
        assert (cut["kind"], cut["size"], cut["truncated"]) == ("text", 70 * 1024, True)
        assert len(cut["preview"]) == 64 * 1024

        async def indexed() -> bool:
            r = await client.get("/api/v1/messages", params={"topic": "Msgs", "key": "o-17"})
            return r.status_code == 200 and len(r.json()) == 1

        await eventually(indexed, 10, "the key index")
        by_key = await client.get("/api/v1/messages", params={"topic": "Msgs", "key": "o-17"})
        assert [m["id"] for m in by_key.json()] == [as_json["id"]]
        window = await client.get(
            "/api/v1/messages", params={"topic": "Msgs", "begin_ms": start_ms, "limit": 2}
        )
        assert len(window.json()) == 2
        assert window.headers["x-more"] == "true"
        everything = await client.get(
            "/api/v1/messages", params={"topic": "Msgs", "begin_ms": start_ms}
        )
        assert {m["id"] for m in everything.json()} == {
            m["id"] for m in (as_json, as_text, as_binary, big)
        }
        unknown = assert_problem(
            await client.get("/api/v1/messages/00000000000000000000000000000000"),
            404,
            "NOT_FOUND",
        )
        assert "no live broker has it" in unknown["detail"]
        assert_problem(
            await client.post(
                "/api/v1/messages", json={"topic": "Msgs", "body": "%%", "encoding": "base64"},
                headers=h,
            ),
            400,
            "INVALID_ARGUMENT",
        )  # fmt: skip
        assert_problem(
            await client.post("/api/v1/messages", json={"topic": "Nowhere", "body": "x"},
                              headers=h),
            404,
            "UNKNOWN_TOPIC",
        )  # fmt: skip


async def test_groups_lag_and_reset(cluster: ClusterState) -> None:
    await create_topic(cluster.namesrv, "Lagged")
    async with Producer(cluster.namesrv) as producer:
        for i in range(6):
            await producer.send(Message("Lagged", f"m{i}".encode(), keys=f"k{i}"))
    seen: list[str] = []

    async def listen(msgs: list[ReceivedMessage]) -> None:
        seen.extend(m.body.decode() for m in msgs)

    async with console_app(cluster.namesrv) as (_app, client):
        h = await csrf_of(client)
        async with PushConsumer(cluster.namesrv, "g-lag", listen, **FAST_CONSUMER) as consumer:
            consumer.subscribe("Lagged")
            await consumer.start()

            async def caught_up() -> bool:
                r = await client.get("/api/v1/groups/g-lag")
                return r.status_code == 200 and r.json()["lag_messages"] == 0 and len(seen) >= 6

            await eventually(caught_up, 30, "g-lag caught up")
            groups = (await client.get("/api/v1/groups")).json()
            row = next(g for g in groups if g["name"] == "g-lag")
            assert row["members"] == 1
            assert "Lagged" in row["topics"]
            detail = (await client.get("/api/v1/groups/g-lag")).json()
            assert (detail["consumption"], detail["clients"]) == ("OFFSETS", [])
            assert len(detail["members"]) == 1
            assert "Lagged" in {s["topic"] for s in detail["members"][0]["subscriptions"]}
        queues = [q for q in detail["queues"] if q["topic"] == "Lagged"]
        assert sum(q["broker_offset"] for q in queues) == 6
        assert all(q["consumer_offset"] == q["broker_offset"] for q in queues)
        assert all((q["in_flight"], q["invisible"]) == (0, 0) for q in queues)
        assert detail["lag_seconds"] == 0

        preview = await client.post(
            "/api/v1/groups/g-lag/reset",
            json={"topic": "Lagged", "to": "earliest", "dry_run": True},
            headers=h,
        )
        assert preview.status_code == 200, preview.text
        rows = preview.json()
        assert len(rows) == 4
        assert all(r["to"] == 0 for r in rows)
        assert sum(r["from"] for r in rows) == 6
        at_time = await client.post(
            "/api/v1/groups/g-lag/reset",
            json={"topic": "Lagged", "to": "timestamp", "timestamp_ms": 0, "dry_run": True},
            headers=h,
        )
        assert all(r["to"] == 0 for r in at_time.json())
        # a dry run changed nothing
        assert (await client.get("/api/v1/groups/g-lag")).json()["lag_messages"] == 0
        done = await client.post(
            "/api/v1/groups/g-lag/reset", json={"topic": "Lagged", "to": "earliest"}, headers=h
        )
        assert done.status_code == 200, done.text
        assert sorted((r["broker"], r["queue_id"], r["to"]) for r in done.json()) == sorted(
            (r["broker"], r["queue_id"], 0) for r in rows
        )
        assert (await client.get("/api/v1/groups/g-lag")).json()["lag_messages"] == 6

        no_time = assert_problem(
            await client.post(
                "/api/v1/groups/g-lag/reset", json={"topic": "Lagged", "to": "timestamp"},
                headers=h,
            ),
            400,
            "INVALID_ARGUMENT",
        )  # fmt: skip
        assert no_time["detail"].startswith("timestamp_ms: ")
        bad_to = assert_problem(
            await client.post(
                "/api/v1/groups/g-lag/reset", json={"topic": "Lagged", "to": "soon"}, headers=h
            ),
            400,
            "INVALID_ARGUMENT",
        )
        assert bad_to["field"] == "to"
        assert_problem(await client.get("/api/v1/groups/no-such-group"), 404, "NOT_FOUND")
        assert_problem(await client.get("/api/v1/groups/bad name"), 400, "INVALID_ARGUMENT")


async def test_a_pop_group_shows_its_official_clients_and_messages_in_flight(
    cluster: ClusterState,
) -> None:
    """An official RocketMQ 5 client (the raw v2 protocol) connected to broker-a, with two
    messages it received and has not acked."""
    await create_topic(cluster.namesrv, "Popped")
    async with AdminClient(cluster.namesrv) as admin:
        address = next(b.address for b in await admin.cluster_info() if b.broker_name == "broker-a")
    md = (
        ("x-mq-client-id", "pop-java@10.0.0.7@1@c1"),
        ("x-mq-language", "JAVA"),
        ("x-mq-client-version", "5.0.7"),
    )
    topic, group = d.Resource(name="Popped"), d.Resource(name="g-pop")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = sg.MessagingServiceStub(channel)
        telemetry = stub.Telemetry(metadata=md, timeout=120)
        try:
            everything = d.FilterExpression(type=d.TAG, expression="*")
            settings = d.Settings(
                client_type=d.SIMPLE_CONSUMER,
                subscription=d.Subscription(
                    group=group,
                    subscriptions=[d.SubscriptionEntry(topic=topic, expression=everything)],
                ),
            )
            await telemetry.write(s.TelemetryCommand(settings=settings))
            first = await telemetry.read()
            assert isinstance(first, s.TelemetryCommand)
            assert first.status.code == d.OK, first.status
            for i in range(2):
                sent = await stub.SendMessage(
                    s.SendMessageRequest(
                        messages=[
                            d.Message(
                                topic=topic,
                                body=b"pop-%d" % i,
                                system_properties=d.SystemProperties(
                                    message_id=f"POP{i}", body_encoding=d.IDENTITY
                                ),
                            )
                        ]
                    ),
                    metadata=md,
                    timeout=5,
                )
                assert sent.status.code == d.OK, sent.status
            receive = s.ReceiveMessageRequest(
                group=group,
                message_queue=d.MessageQueue(topic=topic, id=-1),
                filter_expression=everything,
                batch_size=32,
                invisible_duration=Duration(seconds=300),
                long_polling_timeout=Duration(seconds=0),
            )
            received = [
                r.message
                async for r in stub.ReceiveMessage(receive, metadata=md, timeout=10)
                if r.HasField("message")
            ]
            assert len(received) == 2

            async with console_app(cluster.namesrv) as (_app, client):
                resp = await client.get("/api/v1/groups/g-pop")
                assert resp.status_code == 200, resp.text
                detail = resp.json()
                groups = (await client.get("/api/v1/groups")).json()
        finally:
            telemetry.cancel()
    assert detail["consumption"] == "POP"
    assert detail["members"] == []
    [java] = detail["clients"]
    assert java["host"].startswith("127.0.0.1")
    assert java == {
        "client_id": "pop-java@10.0.0.7@1@c1",
        "language": "JAVA",
        "version": "5.0.7",
        "client_type": "SIMPLE_CONSUMER",
        "host": java["host"],
        "broker": "broker-a",
    }
    popped = [q for q in detail["queues"] if q["topic"] == "Popped"]
    assert {q["broker"] for q in popped} == {"broker-a"}
    assert sum(q["in_flight"] for q in popped) == 2
    assert sum(q["invisible"] for q in popped) == 2
    assert (detail["in_flight"], detail["invisible"]) == (2, 2)
    row = next(g for g in groups if g["name"] == "g-pop")
    assert (row["members"], row["topics"], row["brokers"]) == (0, ["Popped"], ["broker-a"])


async def test_dead_letters_and_redrive(cluster: ClusterState) -> None:
    await create_topic(cluster.namesrv, "Fragile")
    async with Producer(cluster.namesrv) as producer:
        for body in ("bad-1", "bad-2"):
            await producer.send(Message("Fragile", body.encode(), tags="T", keys=body))

    async def fail(_msgs: list[ReceivedMessage]) -> ConsumeResult:
        return ConsumeResult.RETRY_LATER

    async with console_app(cluster.namesrv) as (_app, client):
        h = await csrf_of(client)
        async with PushConsumer(
            cluster.namesrv, "g-dead", fail, max_reconsume_times=0, **FAST_CONSUMER
        ) as consumer:
            consumer.subscribe("Fragile")
            await consumer.start()

            async def dead() -> bool:
                return len((await client.get("/api/v1/dlq/g-dead")).json()) >= 2

            await eventually(dead, 30, "two dead letters")
        letters = (await client.get("/api/v1/dlq/g-dead")).json()
        assert sorted(d["body"]["preview"] for d in letters) == ["bad-1", "bad-2"]
        for d in letters:
            assert (d["origin_topic"], d["attempts"]) == ("Fragile", 1)
            assert d["reason"] == "listener returned RETRY_LATER"
        # a dead letter keeps its message id: the original is shown unless the copy is asked for
        d = letters[0]
        original = (await client.get(f"/api/v1/messages/{d['id']}")).json()
        assert original["topic"] == "Fragile"
        assert [c["topic"] for c in original["other_copies"]] == ["%DLQ%g-dead"]
        in_dlq = (
            await client.get(f"/api/v1/messages/{d['id']}", params={"topic": "%DLQ%g-dead"})
        ).json()
        assert (in_dlq["topic"], in_dlq["queue_offset"]) == ("%DLQ%g-dead", d["queue_offset"])
        assert [c["topic"] for c in in_dlq["other_copies"]] == ["Fragile"]
        nowhere = assert_problem(
            await client.get(f"/api/v1/messages/{d['id']}", params={"topic": "Elsewhere"}),
            404,
            "NOT_FOUND",
        )
        assert "no copy of it matches topic 'Elsewhere'" in nowhere["detail"]
        assert "it is stored in topic 'Fragile'" in nowhere["detail"]
        assert (await client.get("/api/v1/dlq/g-dead", params={"limit": 1})).json()[0]["id"] in {
            d["id"] for d in letters
        }
        assert (await client.get("/api/v1/dlq/g-nobody")).json() == []
        dry = await client.post(
            "/api/v1/dlq/g-dead/redrive", json={"key": "bad-1", "dry_run": True}, headers=h
        )
        assert dry.status_code == 200, dry.text
        assert (dry.json()["matched"], dry.json()["redriven"]) == (1, 0)
        sent = (await client.post("/api/v1/dlq/g-dead/redrive", json={}, headers=h)).json()
        assert (sent["matched"], sent["redriven"], sent["failed"]) == (2, 2, 0)
        new_ids = [i["new_id"] for i in sent["items"]]
        again = (await client.get(f"/api/v1/messages/{new_ids[0]}")).json()
        assert again["topic"] == "Fragile"
        assert_problem(
            await client.post("/api/v1/dlq/g-dead/redrive", json={"since_ms": -1}, headers=h),
            400,
            "INVALID_ARGUMENT",
        )


async def test_pending_transactions_resolved(cluster: ClusterState) -> None:
    await create_topic(cluster.namesrv, "Payments")

    def undecided(_m: TransactionMessage, _arg: object) -> TransactionDecision:
        return TransactionDecision.UNKNOWN

    async with console_app(cluster.namesrv) as (_app, client):
        h = await csrf_of(client)
        async with TransactionProducer(cluster.namesrv, "pay-producers") as producer:
            result = await producer.send_in_transaction(Message("Payments", b"p-1"), undecided)
        txn_id = result.transaction_id
        pending = (
            await client.get("/api/v1/transactions", params={"group": "pay-producers"})
        ).json()
        assert [p["id"] for p in pending] == [txn_id]
        assert (pending[0]["topic"], pending[0]["checking"]) == ("Payments", True)
        by_topic = await client.get("/api/v1/transactions", params={"topic": "Other"})
        assert by_topic.json() == []
        resolved = await client.post(
            f"/api/v1/transactions/{txn_id}/resolve", json={"commit": True}, headers=h
        )
        assert resolved.status_code == 200, resolved.text
        assert (resolved.json()["outcome"], resolved.json()["topic"]) == ("committed", "Payments")
        assert (await client.get("/api/v1/transactions")).json() == []
        assert_problem(
            await client.post(
                f"/api/v1/transactions/{txn_id}/resolve", json={"commit": False}, headers=h
            ),
            404,
            "NOT_FOUND",
        )
        assert_problem(
            await client.post(f"/api/v1/transactions/{txn_id}/resolve", json={}, headers=h),
            400,
            "INVALID_ARGUMENT",
        )


async def test_schedule_backlog_and_sampled_charts(cluster: ClusterState) -> None:
    await create_topic(cluster.namesrv, "Later")
    async with console_app(cluster.namesrv) as (app, client):
        console = app.state.console
        await console.sampler.sample_once()
        async with Producer(cluster.namesrv) as producer:
            await producer.send(Message("Later", b"in 10 s", delay_level=3))
            for i in range(5):
                await producer.send(Message("Later", f"now {i}".encode()))
        levels = (await client.get("/api/v1/schedule")).json()
        assert [r["level"] for r in levels][:3] == [1, 2, 3]
        level3 = next(r for r in levels if r["level"] == 3)
        assert (level3["delay"], level3["backlog"]) == ("10s", 1)  # no schedule service runs
        await console.sampler.sample_once()

        rate = (await client.get("/api/v1/metrics/topics/Later/rate?minutes=5")).json()
        assert rate["source"] == "sampling"
        [series] = rate["series"]
        assert series["label"] == "Later"
        assert series["points"][-1][1] > 0  # 5 messages (and 1 delayed) between two samples
        backlog = (await client.get("/api/v1/metrics/schedule/backlog")).json()
        by_level = {s["label"]: s["points"][-1][1] for s in backlog["series"]}
        assert by_level["3"] == 1
        topics = (await client.get("/api/v1/topics")).json()
        assert next(t for t in topics if t["name"] == "Later")["rate_per_s"] > 0
        lag = (await client.get("/api/v1/metrics/groups/nobody/lag")).json()
        assert lag == {"source": "sampling", "series": [{"label": "nobody", "points": []}]}
        assert_problem(
            await client.get("/api/v1/metrics/schedule/backlog?minutes=0"), 400, "INVALID_ARGUMENT"
        )
