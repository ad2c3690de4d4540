"""A real nameserver and broker in-process, with a short delay table and a small, fast timer
wheel, for the schedule service's integration tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc.aio
import pytest

from apogee.codec import StoredMessage
from apogee.testkit.broker import decode_records, pull, small_settings
from apogee.testkit.processes import quick_leader_settings
from apogee.testkit.waiting import eventually
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2, consumer_pb2
from apogee_broker.app import BrokerApp
from apogee_nameserver.app import NameServerApp
from apogee_nameserver.settings import NameServerSettings
from apogee_schedule.app import ScheduleApp
from apogee_schedule.settings import ScheduleSettings

TOPIC = "Orders"
QUEUES = 2
DELAYS_MS = (1000, 2000)
SLOT_MS = 250
SLOTS = 12  # timers more than (12 - 4) * 250 ms = 2 s ahead are rolled, then parked


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Cluster:
    """One nameserver and one broker (restartable on the same data), and what tests do with
    them: send, read what was delivered, run schedule services."""

    delays_ms = DELAYS_MS

    @staticmethod
    def now_ms() -> int:
        return now_ms()

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.nameserver = NameServerApp(
            NameServerSettings(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
        )
        self.namesrv = ""
        self.broker: BrokerApp | None = None
        self.schedules: list[ScheduleApp] = []

    async def start(self) -> None:
        port = await self.nameserver.start()
        self.namesrv = f"127.0.0.1:{port}"
        await self.start_broker()
        async with grpc.aio.insecure_channel(self.address) as ch:
            await broker_pb2_grpc.BrokerAdminStub(ch).PutTopic(
                broker_pb2.PutTopicRequest(
                    topic=common_pb2.TopicConfig(
                        name=TOPIC, read_queues=QUEUES, write_queues=QUEUES, perm=6
                    )
                ),
                timeout=5,
            )

    async def start_broker(self) -> None:
        settings = small_settings(
            self.tmp_path / "broker",
            broker_name="broker-a",
            namesrv=self.namesrv,
            delay_levels=" ".join(f"{d // 1000}s" for d in DELAYS_MS),
            timer_slot_ms=SLOT_MS,
            timer_slots=SLOTS,
            timer_max_delay_s=60,
            first_retry_delay_level=1,
        )
        self.broker = BrokerApp(settings)
        try:
            await self.broker.start()
        except BaseException:
            self.broker = None
            raise

    async def stop_broker(self) -> None:
        broker, self.broker = self.broker, None
        if broker is not None:
            await broker.stop()

    @property
    def address(self) -> str:
        assert self.broker is not None
        return self.broker.address

    def schedule_settings(self, **overrides: Any) -> ScheduleSettings:
        values = {
            **quick_leader_settings(self.namesrv, self.tmp_path / "schedule.lock"),
            "scan_hold_ms": 200,
            "progress_interval_s": 0.2,
            **overrides,
        }
        return ScheduleSettings(**values)

    async def start_schedule(self, **overrides: Any) -> ScheduleApp:
        app = ScheduleApp(self.schedule_settings(**overrides))
        self.schedules.append(app)
        await app.start()
        return app

    async def send(self, *msgs: common_pb2.Message) -> list[broker_pb2.SendResult]:
        async with grpc.aio.insecure_channel(self.address) as ch:
            reply = await broker_pb2_grpc.BrokerStub(ch).SendMessages(
                broker_pb2.SendMessagesRequest(messages=list(msgs)), timeout=5
            )
        for r in reply.results:
            assert r.status.code == 0, r.status.message
        return list(reply.results)

    async def delivered(self) -> list[StoredMessage]:
        """Every message in the topic's queues, read from the start."""
        out: list[StoredMessage] = []
        async with grpc.aio.insecure_channel(self.address) as ch:
            for q in range(QUEUES):
                offset = 0
                while True:
                    reply = await pull(
                        ch,
                        consumer_pb2.PullRequest(
                            group="checker", client_id="t", topic=TOPIC, queue_id=q, offset=offset
                        ),
                    )
                    got = decode_records(reply.records)
                    if not got:
                        break
                    out.extend(got)
                    offset = reply.next_offset
        return out

    async def wait_delivered(self, count: int, timeout: float) -> list[StoredMessage]:
        got: list[StoredMessage] = []

        async def enough() -> bool:
            nonlocal got
            got = await self.delivered()
            return len({m.unique_id for m in got}) >= count

        await eventually(enough, timeout, f"{count} messages delivered (have {len(got)})")
        return got

    async def close(self) -> None:
        for app in reversed(self.schedules):
            with contextlib.suppress(Exception):
                await app.stop()
        await self.stop_broker()
        await self.nameserver.stop()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        await c.start()
        yield c
    finally:
        await c.close()


def timer(body: str, deliver_at_ms: int, queue_id: int = 0) -> common_pb2.Message:
    return common_pb2.Message(
        topic=TOPIC,
        body=body.encode(),
        queue_id=queue_id,
        tags="due",
        keys=[body],
        properties={"kind": "timer"},
        deliver_at_ms=deliver_at_ms,
    )


def delayed(body: str, level: int, queue_id: int = 1) -> common_pb2.Message:
    return common_pb2.Message(
        topic=TOPIC,
        body=body.encode(),
        queue_id=queue_id,
        tags="later",
        keys=[body],
        properties={"kind": "delayed"},
        delay_level=level,
    )


@pytest.fixture
def make_timer() -> Callable[..., common_pb2.Message]:
    return timer


@pytest.fixture
def make_delayed() -> Callable[..., common_pb2.Message]:
    return delayed
