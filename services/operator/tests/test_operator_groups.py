"""ConsumerGroup resources through the real ``kubernetes`` client against the stand-in API
server (not a real Kubernetes API server), on real brokers (an in-process cluster of two): the
group starts where consumeFrom says on the topics it has no offset in (a topic that does not
exist yet is waited for), its members are reported, and deletion follows its policy."""

from __future__ import annotations

from typing import Any

import pytest

from apogee.client import Message, Producer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# ``env`` (conftest.py): the cluster, the stand-in API server and the operator


async def committed(env: Any, group: str, topic: str) -> dict[tuple[str, int], int | None]:
    described = await env.admin.describe_group(group)
    return {
        (q.broker_name, q.queue_id): q.consumer_offset for q in described.queues if q.topic == topic
    }


async def test_a_group_starts_where_it_is_told_and_waits_for_its_topics(env: Any) -> None:
    await env.cluster.create_topic("Payments", queues=2)
    async with Producer(env.cluster.namesrv) as producer:
        for i in range(6):
            await producer.send(Message("Payments", f"p{i}".encode()))
    ends = {
        (b.broker_name, q.queue_id): q.max_offset
        for b in (await env.admin.describe_topic("Payments")).brokers
        for q in b.queues
    }
    assert sum(ends.values()) == 6

    spec = {
        "consumeFrom": "earliest",
        "topics": ["Payments", "Refunds"],
        "deletionPolicy": "delete",
    }
    await env.create("consumergroups", "billing", spec)
    cond = await env.wait_ready("consumergroups", "billing", status="False")
    assert cond["reason"] == "TopicNotFound"
    assert "Refunds" in cond["message"]
    assert await committed(env, "billing", "Payments") == dict.fromkeys(ends, 0)

    await env.cluster.create_topic("Refunds", queues=1)
    cond = await env.wait_ready("consumergroups", "billing")
    assert cond["reason"] == "Synced"
    obj = env.get("consumergroups", "billing")
    assert obj["status"]["initializedTopics"] == ["Payments", "Refunds"]
    assert obj["status"]["groupName"] == "billing"
    assert obj["status"]["members"] == 0

    # latest: the group starts at the end, and only where it had no offset
    await env.create("consumergroups", "audit", {"name": "Audit", "topics": ["Payments"]})
    await env.wait_ready("consumergroups", "audit")
    assert await committed(env, "Audit", "Payments") == ends

    # deletion with policy delete removes the group's retry and dead-letter topics
    await env.admin.create_or_update_topic("%RETRY%billing", queues=1)
    await env.admin.create_or_update_topic("%DLQ%billing", queues=1)
    await env.delete("consumergroups", "billing")
    await env.until(lambda: env.get("consumergroups", "billing") is None, 10, "billing gone")
    assert await env.queues("%RETRY%billing") == {}
    assert await env.queues("%DLQ%billing") == {}
    # orphan (the default) leaves them
    await env.admin.create_or_update_topic("%RETRY%Audit", queues=1)
    await env.delete("consumergroups", "audit")
    await env.until(lambda: env.get("consumergroups", "audit") is None, 10, "audit gone")
    assert await env.queues("%RETRY%Audit") == {"broker-a": 1, "broker-b": 1}


async def test_a_bad_group_spec_is_reported(env: Any) -> None:
    # passes the schema (CEL rules are the API server's; the stand-in does not run them)
    await env.create("consumergroups", "late", {"consumeFrom": "timestamp", "topics": ["X"]})
    cond = await env.wait_ready("consumergroups", "late", status="False")
    assert cond["reason"] == "InvalidSpec"
    assert "spec.consumeTimestamp: is required" in cond["message"]
