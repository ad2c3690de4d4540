"""An end or a check whose call is cut off (its deadline passes, the caller goes away) after the
broker wrote its records, while it waited for them to be durable (``flush_mode = sync``): the
broker still remembers what it wrote, so the transaction is decided once and stored once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.codec import StoredMessage
from apogee.store import AppendResult, Message
from apogee.testkit.broker import decode_records, running_broker, small_settings
from apogee.testkit.broker import pull as stream_pull
from apogee.testkit.waiting import eventually
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    consumer_pb2,
    transaction_pb2,
    transaction_pb2_grpc,
)
from apogee_broker.app import BrokerApp

pytestmark = pytest.mark.integration

pb = transaction_pb2
GROUP = "txn-producers"
TOPIC = "Payments"


class SlowDisk:
    """Holds back the store's durability callbacks while ``holding``: a write is done, its
    fsync seems to take for ever."""

    def __init__(self, app: BrokerApp) -> None:
        assert app.store is not None
        self.store = app.store
        self.real = app.store.append_async
        self.holding = False
        self.held: list[tuple[Callable[[BaseException | None], None], BaseException | None]] = []
        self.store.append_async = self._append_async  # type: ignore[method-assign]

    def _append_async(
        self,
        messages: Message | Sequence[Message],
        on_durable: Callable[[BaseException | None], None],
    ) -> list[AppendResult]:
        if not self.holding:
            return self.real(messages, on_durable)

        def later(err: BaseException | None) -> None:
            self.held.append((on_durable, err))

        return self.real(messages, later)

    def release(self) -> None:
        self.holding = False
        for on_durable, err in self.held:
            on_durable(err)
        self.held.clear()


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[BrokerApp]:
    settings = small_settings(tmp_path / "broker", broker_name="b1", flush_mode="sync")
    async with running_broker(settings) as app:
        async with grpc.aio.insecure_channel(app.address) as ch:
            await broker_pb2_grpc.BrokerAdminStub(ch).PutTopic(
                broker_pb2.PutTopicRequest(
                    topic=common_pb2.TopicConfig(name=TOPIC, read_queues=1, write_queues=1, perm=6)
                ),
                timeout=5,
            )
        yield app


def end_request(half: Any, decision: Any) -> transaction_pb2.EndTransactionRequest:
    return pb.EndTransactionRequest(
        producer_group=GROUP,
        unique_id=half.unique_id,
        half_offset=half.half_offset,
        decision=decision,
        source=pb.PRODUCER,
        client_id="producer-1",
    )


async def topic_messages(app: BrokerApp, ch: grpc.aio.Channel) -> list[StoredMessage]:
    assert app.store is not None
    assert await asyncio.to_thread(app.store.wait_dispatched, 5)
    reply = await stream_pull(
        ch,
        consumer_pb2.PullRequest(
            group="readers", client_id="t", topic=TOPIC, queue_id=0, offset=0, max_messages=32
        ),
    )
    return decode_records(reply.records)


async def test_a_commit_cut_off_while_it_waits_for_its_fsync_is_decided_once(
    app: BrokerApp,
) -> None:
    disk = SlowDisk(app)
    async with grpc.aio.insecure_channel(app.address) as ch:
        stub = transaction_pb2_grpc.TransactionStub(ch)
        half = await stub.SendHalf(
            pb.SendHalfRequest(
                producer_group=GROUP,
                message=common_pb2.Message(topic=TOPIC, body=b"pay 10", queue_id=0),
            ),
            timeout=5,
        )
        disk.holding = True
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await stub.EndTransaction(end_request(half, pb.COMMIT), timeout=0.5)
        assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: bool(disk.held), 5, "the commit written")
        disk.release()
        # the producer tries again, as it does after a deadline: the commit is not repeated
        again = await stub.EndTransaction(end_request(half, pb.COMMIT), timeout=5)
        assert again.outcome == pb.ALREADY_DONE
        assert [m.body for m in await topic_messages(app, ch)] == [b"pay 10"]
        with pytest.raises(grpc.aio.AioRpcError) as other:
            await stub.EndTransaction(end_request(half, pb.ROLLBACK), timeout=5)
        assert other.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_check_cut_off_while_it_waits_for_its_fsync_puts_one_copy_back(
    app: BrokerApp,
) -> None:
    disk = SlowDisk(app)
    async with grpc.aio.insecure_channel(app.address) as ch:
        half = await transaction_pb2_grpc.TransactionStub(ch).SendHalf(
            pb.SendHalfRequest(
                producer_group=GROUP,
                message=common_pb2.Message(topic=TOPIC, body=b"pay 20", queue_id=0),
            ),
            timeout=5,
        )
        checker = transaction_pb2_grpc.TransactionCheckStub(ch)
        check = pb.CheckHalfRequest(half_offset=half.half_offset)
        disk.holding = True
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await checker.CheckHalf(check, timeout=0.5)
        assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: bool(disk.held), 5, "the copy put back, this one closed")
        disk.release()
        # the checker, started again, checks the same copy: it is closed, not put back again
        again = await checker.CheckHalf(check, timeout=5)
        assert again.outcome == pb.CLOSED
        state = await checker.GetTransactionState(pb.GetTransactionStateRequest(), timeout=5)
        assert (state.half_max_offset, state.op_max_offset) == (half.half_offset + 2, 1)
