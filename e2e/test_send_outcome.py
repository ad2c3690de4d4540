"""A send that fails after its request reached a broker says the message may have been stored,
with its id, and an idempotent send of it again is stored once: against a broker paused with
SIGSTOP, and across a broker's ``kill -9`` and restart (the broker reads its dedup window back
from its CommitLog). A send that fails before anything was sent says nothing of the kind."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from apogee.client import AdminClient, Message, Producer, QueueReader, SendResult
from apogee.common.errors import DeadlineExceededError, UnavailableError
from e2e.harness import ClusterFactory, eventually, wait_for_route, wait_registered

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOPIC = "E2ESendOutcome"
BROKER = "broker-a"


async def copies(namesrv: str, body: bytes, answers: list[SendResult]) -> int:
    """How many messages of the topic hold ``body``, counted once every offset ``answers``
    name is readable (a second copy, had one been stored, would be among them) and one is."""
    async with QueueReader(namesrv) as reader:
        queues = {q.queue_id: q for q in await reader.queues(TOPIC)}

        async def count() -> int:
            n = 0
            for q in queues.values():
                bounds = await reader.offsets(q)
                async for m in reader.read(q, bounds.min_offset, bounds.max_offset):
                    n += m.body == body
            return n

        async def settled() -> bool:
            for r in answers:
                if (await reader.offsets(queues[r.queue_id])).max_offset <= r.queue_offset:
                    return False
            return await count() >= 1

        await eventually(settled, 10, f"{body!r} stored and readable")
        return await count()


async def test_an_unknown_outcome_is_said_and_an_idempotent_send_again_is_stored_once(
    start_cluster: ClusterFactory,
) -> None:
    cluster = await asyncio.to_thread(
        start_cluster, "send-outcome", brokers=1, nameservers=1, flush_mode="sync"
    )
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(TOPIC, queues=4)
    await wait_for_route(cluster.nameservers, TOPIC, {BROKER})
    pid = cluster.member(BROKER).pid

    # a paused broker: the send times out after its request was written to the broker
    async with Producer(cluster.namesrv, idempotent=True, send_timeout=1.0) as producer:
        before_kill = await producer.send(Message(TOPIC, b"before-kill"))
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(DeadlineExceededError) as caught:
                await producer.send(Message(TOPIC, b"paused"))
        finally:
            os.kill(pid, signal.SIGCONT)
        err = caught.value
        assert err.outcome_unknown
        assert err.message_id is not None
        assert f"the message may have been stored (message id {err.message_id})" in str(err)
        # the application sends it again under its id, twice: whether or not the first try
        # was stored, one copy is
        again = [
            await producer.send(Message(TOPIC, b"paused"), message_id=err.message_id)
            for _ in range(2)
        ]
    assert {r.message_id for r in again} == {err.message_id}
    assert await copies(cluster.namesrv, b"paused", again) == 1

    # kill -9: a send refused before anything was sent is a plain failure
    await asyncio.to_thread(cluster.kill, BROKER)
    async with Producer(cluster.namesrv, send_timeout=2.0) as producer:
        with pytest.raises(UnavailableError) as refused:
            await producer.send(Message(TOPIC, b"refused"))
    assert (refused.value.outcome_unknown, refused.value.message_id) == (False, None)
    assert "may have been stored" not in str(refused.value)

    # after the restart the broker still knows what it stored within its dedup window
    await asyncio.to_thread(cluster.restart, BROKER)
    await wait_registered(cluster.nameservers, BROKER)
    async with Producer(cluster.namesrv, idempotent=True) as producer:
        resent = await producer.send(
            Message(TOPIC, b"before-kill"), message_id=before_kill.message_id
        )
    assert (resent.queue_id, resent.queue_offset) == (
        before_kill.queue_id,
        before_kill.queue_offset,
    )
    assert await copies(cluster.namesrv, b"before-kill", [resent]) == 1
