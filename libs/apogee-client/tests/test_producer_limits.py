"""Timeouts and the bound on unsettled sends, against a peer that accepts connections and never
answers (a hung nameserver), and against a real cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.client import Message, Producer, SendHook, SyncProducer
from apogee.common.errors import DeadlineExceededError
from apogee.testkit.cluster import InProcessCluster

pytestmark = pytest.mark.integration


@pytest.fixture
async def hung_peer() -> AsyncIterator[str]:
    """host:port of a TCP server that accepts and then says nothing."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


async def test_a_send_gives_up_after_send_timeout(hung_peer: str) -> None:
    async with Producer(hung_peer, send_timeout=0.3, close_timeout=0.5) as producer:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(DeadlineExceededError) as info:
            await producer.send(Message("T", b"x"))
        assert str(info.value) == "sending a message to topic 'T' took longer than 0.3s"
        assert info.value.retriable
        assert 0.25 < loop.time() - start < 2.0


async def test_max_pending_bounds_unsettled_sends(tmp_path: Path) -> None:
    unsettled = 0
    most = 0

    def before(_: Message) -> None:
        nonlocal unsettled, most
        unsettled += 1
        most = max(most, unsettled)

    def after(_: Message, __: object) -> None:
        nonlocal unsettled
        unsettled -= 1

    async with InProcessCluster(tmp_path, nameservers=1, brokers=["broker-a"]) as cluster:
        await cluster.create_topic("Orders")
        async with Producer(
            cluster.namesrv, max_pending=5, hooks=[SendHook(before, after)]
        ) as producer:
            results = await asyncio.gather(
                *(producer.send(Message("Orders", f"m{i}".encode())) for i in range(50))
            )
        assert len({r.message_id for r in results}) == 50
        assert most == 5

        def flood() -> int:
            with SyncProducer(cluster.namesrv, max_pending=3) as sync_producer:
                futs = [sync_producer.send_async(Message("Orders", b"s")) for _ in range(30)]
                return len({f.result(5.0).message_id for f in futs})

        assert await asyncio.to_thread(flood) == 30
