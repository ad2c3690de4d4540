"""``python -m apogee_broker`` as a real process: an acknowledged message survives ``kill -9``,
and SIGTERM stops the broker cleanly (exit 0, the store reports a clean shutdown)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc.aio
import pytest

from apogee.rpc.server import check_health
from apogee.store import FlushMode, MessageStore, StoreConfig
from apogee.testkit.ports import free_port
from apogee.testkit.waiting import eventually
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MiB = 1 << 20
#: The tiny store of these tests, given to the process through its environment.
ENV = {
    "APOGEE_BROKER_COMMITLOG_FILE_SIZE": str(MiB),
    "APOGEE_BROKER_MAX_MESSAGE_SIZE": str(256 * 1024),
    "APOGEE_BROKER_CONSUME_QUEUE_ENTRIES_PER_FILE": "1024",
    "APOGEE_BROKER_INDEX_SLOTS": "997",
    "APOGEE_BROKER_INDEX_ENTRIES_PER_FILE": "4096",
    "APOGEE_BROKER_FLUSH_MODE": "sync",
    "APOGEE_BROKER_SHUTDOWN_GRACE_S": "2",
    "APOGEE_BROKER_METRICS_LISTEN": "127.0.0.1:0",
}
STORE_CONFIG = StoreConfig(
    commitlog_file_size=MiB,
    max_message_size=256 * 1024,
    consume_queue_entries_per_file=1024,
    index_slots=997,
    index_entries_per_file=4096,
    flush_mode=FlushMode.SYNC,
)


class BrokerProcess:
    """One ``python -m apogee_broker`` with its output in a file (shown when a test fails)."""

    def __init__(self, data_dir: Path, port: int, log: Path) -> None:
        self.address = f"127.0.0.1:{port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
        env.update(ENV)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "apogee_broker",
                    "--listen",
                    self.address,
                    "--data-dir",
                    str(data_dir),
                    "--name",
                    "broker-p",
                    "--namesrv",
                    "",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_serving(self, timeout: float = 20.0) -> None:
        async def serving() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the broker exited with {self.proc.returncode}:\n{self.output()}"
                )
            return await check_health(self.address, timeout=1.0)

        await eventually(serving, timeout, "the broker serving", every=0.05, detail=self.output)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def processes() -> Iterator[list[BrokerProcess]]:
    started: list[BrokerProcess] = []
    try:
        yield started
    finally:
        for p in started:
            p.stop()


def start(processes: list[BrokerProcess], data_dir: Path, port: int, log: Path) -> BrokerProcess:
    p = BrokerProcess(data_dir, port, log)
    processes.append(p)
    return p


async def send_one(address: str, topic: str, body: bytes) -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        await broker_pb2_grpc.BrokerAdminStub(ch).PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(name=topic, read_queues=2, write_queues=2, perm=6)
            ),
            timeout=5,
        )
        reply = await broker_pb2_grpc.BrokerStub(ch).SendMessages(
            broker_pb2.SendMessagesRequest(
                messages=[common_pb2.Message(topic=topic, body=body, keys=["k-1"])]
            ),
            timeout=5,
        )
    [res] = reply.results
    assert res.status.code == 0, res.status
    return str(res.unique_id)


async def test_an_acknowledged_message_survives_kill_9(
    tmp_path: Path, processes: list[BrokerProcess]
) -> None:
    data, log, port = tmp_path / "data", tmp_path / "broker.log", free_port()
    first = start(processes, data, port, log)
    await first.wait_serving()
    uid = await send_one(first.address, "Orders", b"must survive")

    first.proc.send_signal(signal.SIGKILL)
    assert first.proc.wait(timeout=10) == -signal.SIGKILL

    second = start(processes, data, port, log)
    await second.wait_serving()
    async with grpc.aio.insecure_channel(second.address) as ch:
        got = await broker_pb2_grpc.BrokerStub(ch).GetMessage(
            broker_pb2.GetMessageRequest(unique_id=uid), timeout=5
        )
        described = await broker_pb2_grpc.BrokerAdminStub(ch).DescribeTopic(
            broker_pb2.DescribeTopicRequest(topic="Orders"), timeout=5
        )
    assert (got.message.body, got.message.topic) == (b"must survive", "Orders")
    assert sum(q.max_offset for q in described.queues) == 1
    assert "recovery after a crash" in second.output()


async def test_sigterm_stops_cleanly(tmp_path: Path, processes: list[BrokerProcess]) -> None:
    data, log = tmp_path / "data", tmp_path / "broker.log"
    p = start(processes, data, free_port(), log)
    await p.wait_serving()
    uid = await send_one(p.address, "Orders", b"kept")

    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(timeout=20) == 0, p.output()
    assert not await check_health(p.address, timeout=0.5)
    lines = p.output().splitlines()
    assert any(" INFO apogee_broker.app broker broker-p stopped" in line for line in lines)

    with MessageStore.open(data, STORE_CONFIG) as store:
        assert store.recovery.clean_shutdown
        found = store.by_unique_id(uid)
        assert found is not None
        assert found.body == b"kept"
