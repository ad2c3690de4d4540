"""Transactions across ``kill -9`` of a real broker process: an acknowledged half survives and
can still be committed; a decision survives (the same commit again is ALREADY_DONE, the message
is stored once)."""

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
from apogee.testkit.ports import free_port
from apogee.testkit.waiting import eventually
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    transaction_pb2,
    transaction_pb2_grpc,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

pb = transaction_pb2
MiB = 1 << 20
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
GROUP = "crash-producers"


class Broker:
    """One ``python -m apogee_broker``, its output in a file (shown when a test fails)."""

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
                    *("--listen", self.address, "--data-dir", str(data_dir)),
                    *("--name", "broker-t", "--namesrv", ""),
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

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def brokers() -> Iterator[list[Broker]]:
    started: list[Broker] = []
    try:
        yield started
    finally:
        for b in started:
            b.kill()


async def test_halves_and_decisions_survive_kill_9(tmp_path: Path, brokers: list[Broker]) -> None:
    data, log, port = tmp_path / "data", tmp_path / "broker.log", free_port()
    first = Broker(data, port, log)
    brokers.append(first)
    await first.wait_serving()
    async with grpc.aio.insecure_channel(first.address) as ch:
        await broker_pb2_grpc.BrokerAdminStub(ch).PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(name="Ledger", read_queues=1, write_queues=1, perm=6)
            ),
            timeout=5,
        )
        txn = transaction_pb2_grpc.TransactionStub(ch)
        halves = [
            await txn.SendHalf(
                pb.SendHalfRequest(
                    producer_group=GROUP,
                    message=common_pb2.Message(topic="Ledger", body=body, unique_id=uid),
                ),
                timeout=5,
            )
            for uid, body in (("DONE", b"committed before the crash"), ("OPEN", b"pending"))
        ]
        done = await txn.EndTransaction(
            pb.EndTransactionRequest(
                producer_group=GROUP,
                unique_id="DONE",
                half_offset=halves[0].half_offset,
                decision=pb.COMMIT,
                source=pb.PRODUCER,
            ),
            timeout=5,
        )
        assert done.outcome == pb.COMMITTED
    first.kill()

    second = Broker(data, port, log)
    brokers.append(second)
    await second.wait_serving()
    assert "recovery after a crash" in second.output()
    async with grpc.aio.insecure_channel(second.address) as ch:
        txn = transaction_pb2_grpc.TransactionStub(ch)
        outcomes = []
        for half in halves:
            reply = await txn.EndTransaction(
                pb.EndTransactionRequest(
                    producer_group=GROUP,
                    unique_id=half.unique_id,
                    half_offset=half.half_offset,
                    decision=pb.COMMIT,
                    source=pb.PRODUCER,
                ),
                timeout=5,
            )
            outcomes.append((reply.outcome, reply.topic, reply.queue_offset))
        assert outcomes == [(pb.ALREADY_DONE, "Ledger", 0), (pb.COMMITTED, "Ledger", 1)]
        described = await broker_pb2_grpc.BrokerAdminStub(ch).DescribeTopic(
            broker_pb2.DescribeTopicRequest(topic="Ledger"), timeout=5
        )
        assert sum(q.max_offset for q in described.queues) == 2
        for uid, body in (("DONE", b"committed before the crash"), ("OPEN", b"pending")):
            got = await broker_pb2_grpc.BrokerStub(ch).GetMessage(
                broker_pb2.GetMessageRequest(unique_id=uid), timeout=5
            )
            # (recovery may index a record again: one message can be listed twice)
            copies = {m.phys_offset: m for m in [got.message, *got.more] if m.topic == "Ledger"}
            assert [m.body for m in copies.values()] == [body]
