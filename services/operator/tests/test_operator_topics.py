"""Topic resources applied, changed and deleted through the real ``kubernetes`` client against
the stand-in API server (not a real Kubernetes API server) give the same topics on real brokers
(an in-process cluster of two): status conditions and observedGeneration follow, drift is put
right, both deletion policies hold, specs the brokers refuse are reported as Ready=False with
the reason (the schema's refusals: test_crds.py)."""

from __future__ import annotations

from typing import Any

import pytest

from apogee.common.topics import READ_WRITE, MessageType

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# ``env`` (conftest.py): the cluster, the stand-in API server and the operator


async def test_a_topic_follows_its_resource_through_create_change_drift_and_delete(
    env: Any,
) -> None:
    await env.create(
        "topics", "orders", {"name": "Orders", "queues": 4, "deletionPolicy": "delete"}
    )
    ready = await env.wait_ready("topics", "orders")
    assert ready["reason"] == "Synced"
    assert ready["observedGeneration"] == 1
    assert "broker-a, broker-b" in ready["message"]
    assert await env.queues("Orders") == {"broker-a": 4, "broker-b": 4}
    obj = env.get("topics", "orders")
    assert obj is not None
    assert obj["metadata"]["finalizers"] == ["apogee.io/cleanup"]
    assert obj["status"]["topicName"] == "Orders"
    assert obj["status"]["brokers"] == ["broker-a", "broker-b"]
    assert obj["spec"]["perm"] == "rw"  # the schema's default

    await env.patch_spec("topics", "orders", {"queues": 8})
    ready = await env.wait_ready("topics", "orders")
    assert ready["observedGeneration"] == 2
    assert await env.queues("Orders") == {"broker-a": 8, "broker-b": 8}
    described = await env.admin.describe_topic("Orders")
    assert {int(b.topic.perm) for b in described.brokers} == {int(READ_WRITE)}

    # drift: deleted on one broker, changed on the other, behind the operator's back
    await env.admin.delete_topic("Orders", brokers=["broker-a"])
    await env.admin.create_or_update_topic("Orders", queues=2, brokers=["broker-b"])

    async def restored() -> bool:
        return bool(await env.queues("Orders") == {"broker-a": 8, "broker-b": 8})

    await env.until(restored, 10, "the topic put back on both brokers by a resync")

    await env.delete("topics", "orders")
    await env.until(lambda: env.get("topics", "orders") is None, 10, "the resource gone")

    async def deleted() -> bool:
        return bool(await env.queues("Orders") == {})

    await env.until(deleted, 5, "the topic deleted from the brokers")


async def test_the_message_type_is_put_on_the_brokers_changed_and_kept_true(env: Any) -> None:
    await env.create("topics", "seq", {"name": "Seq", "queues": 2, "messageType": "FIFO"})
    ready = await env.wait_ready("topics", "seq")
    assert "FIFO messages" in ready["message"]

    async def types() -> set[MessageType]:
        described = await env.admin.describe_topic("Seq")
        return {b.topic.message_type for b in described.brokers}

    assert await types() == {MessageType.FIFO}
    obj = env.get("topics", "seq")
    assert obj is not None
    assert obj["status"]["messageType"] == "FIFO"

    await env.patch_spec("topics", "seq", {"messageType": "DELAY"})
    ready = await env.wait_ready("topics", "seq")
    assert ready["observedGeneration"] == 2
    assert "DELAY messages" in ready["message"]
    assert await types() == {MessageType.DELAY}

    # changed behind the operator's back: put back by a resync
    await env.admin.create_or_update_topic("Seq", queues=2, message_type="NORMAL")

    async def restored() -> bool:
        return await types() == {MessageType.DELAY}

    await env.until(restored, 10, "the type put back by a resync")

    # a resource without a type: the schema's default, MIXED, even for an existing topic
    await env.admin.create_or_update_topic("Typed", queues=1, message_type="TRANSACTION")
    await env.create("topics", "typed", {"name": "Typed", "queues": 1})
    await env.wait_ready("topics", "typed")
    described = await env.admin.describe_topic("Typed")
    assert {b.topic.message_type for b in described.brokers} == {MessageType.MIXED}


async def test_an_orphaned_topic_stays_when_its_resource_goes(env: Any) -> None:
    await env.create("topics", "audit", {"name": "Audit", "queues": 2, "perm": "r"})
    await env.wait_ready("topics", "audit")
    described = await env.admin.describe_topic("Audit")
    assert {b.topic.perm for b in described.brokers} == {4}  # read only
    obj = env.get("topics", "audit")
    assert obj is not None
    assert obj["spec"]["deletionPolicy"] == "orphan"  # the default

    await env.delete("topics", "audit")
    await env.until(lambda: env.get("topics", "audit") is None, 10, "the resource gone")
    assert await env.queues("Audit") == {"broker-a": 2, "broker-b": 2}


async def test_specs_the_brokers_refuse_are_reported_on_the_ready_condition(env: Any) -> None:
    await env.create("topics", "system", {"name": "TBW102"})
    cond = await env.wait_ready("topics", "system", status="False")
    assert cond["reason"] == "InvalidSpec"
    assert "system topic" in cond["message"]

    await env.create("topics", "elsewhere", {"name": "Elsewhere", "cluster": "nowhere"})
    cond = await env.wait_ready("topics", "elsewhere", status="False")
    assert cond["reason"] == "ClusterNotFound"
    assert "'nowhere'" in cond["message"]
    assert await env.queues("Elsewhere") == {}

    # a name change (a real API server refuses it by the CRD's CEL rule; the stand-in does
    # not evaluate CEL, so this is the operator's own check)
    await env.create("topics", "renamed", {"name": "First", "queues": 1})
    await env.wait_ready("topics", "renamed")
    await env.patch_spec("topics", "renamed", {"name": "Second"})
    cond = await env.wait_ready("topics", "renamed", status="False")
    assert "changed from 'First' to 'Second'" in cond["message"]
    assert await env.queues("Second") == {}
    obj = env.get("topics", "renamed")
    assert obj is not None
    assert obj["status"]["topicName"] == "First"

    # fixed: Ready again, at the new generation
    await env.patch_spec("topics", "renamed", {"name": "First", "queues": 2})
    cond = await env.wait_ready("topics", "renamed")
    assert cond["observedGeneration"] == 3
    assert await env.queues("First") == {"broker-a": 2, "broker-b": 2}


async def test_two_resources_naming_one_topic_the_older_manages_it(env: Any) -> None:
    await env.create("topics", "first", {"name": "Shared", "queues": 2, "deletionPolicy": "delete"})
    await env.wait_ready("topics", "first")
    await env.create(
        "topics", "second", {"name": "Shared", "queues": 6, "deletionPolicy": "delete"}
    )
    cond = await env.wait_ready("topics", "second", status="False")
    assert cond["reason"] == "Conflict"
    assert f"Topic {env.ns}/first" in cond["message"]
    assert await env.queues("Shared") == {"broker-a": 2, "broker-b": 2}
    await env.delete("topics", "second")  # deletes nothing: it does not manage the topic
    await env.until(lambda: env.get("topics", "second") is None, 10, "the second resource gone")
    assert await env.queues("Shared") == {"broker-a": 2, "broker-b": 2}
