"""``apogee cluster up --replicas 3``: each broker a replica group of three processes on this
machine (leadership by the file coordination), which fails over when its leader is killed."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from apogee.cli.main import main
from apogee.client import AdminClient, Message, Producer
from apogee.local import cluster as local_cluster
from apogee.testkit.waiting import eventually

pytestmark = pytest.mark.integration


async def test_replicas_make_each_broker_a_group_that_fails_over(
    data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = await asyncio.to_thread(
        local_cluster.up,
        data,
        brokers=1,
        nameservers=1,
        replicas=3,
        schedule=False,
        txn_checker=False,
        console=False,
    )
    assert [p.name for p in state.brokers] == ["broker-a-0", "broker-a-1", "broker-a-2"]
    assert {p.broker_name for p in state.brokers} == {"broker-a"}
    async with AdminClient(state.namesrv) as admin:

        async def all_in_sync() -> bool:
            return len((await admin.describe_broker("broker-a")).in_sync) == 3

        await eventually(all_in_sync, 30, "three replicas in sync")
        assert await asyncio.to_thread(main, ["--data", str(data), "cluster", "status"]) == 0
        assert "replicas: 3/3 in sync" in capsys.readouterr().out
        async with Producer(state.namesrv) as producer:
            sent = await producer.send(Message("Replicated", b"before"))
        group = await admin.describe_broker("broker-a")
        leader = next(p for p in state.brokers if p.address == group.leader_address)
        os.kill(leader.pid, signal.SIGKILL)

        async def failed_over() -> bool:
            try:
                now = await admin.describe_broker("broker-a")
            except Exception:
                return False
            return now.epoch > group.epoch and now.leader_address != leader.address

        await eventually(failed_over, 30, "a new leader of broker-a")
        async with Producer(state.namesrv) as producer:

            async def sends() -> bool:
                try:
                    await producer.send(Message("Replicated", b"after"))
                except Exception:
                    return False
                return True

            await eventually(sends, 30, "a send acknowledged by the new leader")
        assert (await admin.get_message(sent.message_id)).body == b"before"
