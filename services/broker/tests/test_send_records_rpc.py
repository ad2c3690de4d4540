"""Send records over gRPC, against a real broker: a pool of SendStream streams carries them, the
packed answer tells where each was stored, and what a pull reads back is what was sent."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest

from apogee.codec.send import QUEUE_AT, QUEUE_ID, encode_properties, encode_send_record
from apogee.common.errors import InvalidArgumentError
from apogee.rpc.mux import MuxPool
from apogee.testkit.broker import decode_records, pull, running_broker, small_settings
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2, consumer_pb2
from apogee_broker.app import BrokerApp

pytestmark = pytest.mark.integration

SEND_STREAM = "/apogee.v1.Broker/SendStream"


@dataclass
class Wired:
    app: BrokerApp
    channel: grpc.aio.Channel


@pytest.fixture
async def wired(tmp_path: Path) -> AsyncIterator[Wired]:
    async with (
        running_broker(small_settings(tmp_path / "b", broker_name="b1")) as app,
        grpc.aio.insecure_channel(app.address) as channel,
    ):
        await broker_pb2_grpc.BrokerAdminStub(channel).PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(name="T", read_queues=4, write_queues=4, perm=6)
            ),
            timeout=5,
        )
        yield Wired(app, channel)


def record(body: bytes, queue_id: int = 0, topic: str = "T") -> bytes:
    rec = encode_send_record(
        topic.encode(), body, encode_properties("tag", (), f"U{body.hex()}", None)
    )
    QUEUE_ID.pack_into(rec, QUEUE_AT, queue_id)
    return bytes(rec)


def request(*records: bytes) -> bytes:
    return broker_pb2.SendMessagesRequest(records=b"".join(records)).SerializeToString()


def offsets(resp: broker_pb2.SendMessagesResponse) -> list[int]:
    packed = resp.queue_offsets
    return list(struct.unpack(f"<{len(packed) // 8}q", packed))


async def test_a_pool_opens_streams_as_requests_overlap_and_no_more(wired: Wired) -> None:
    pool = MuxPool(
        wired.channel, SEND_STREAM, broker_pb2.SendStreamResponse.FromString, "broker b1", 3
    )
    try:
        lone = await pool.call(request(record(b"lone")), 5.0)
        assert offsets(lone) == [0]
        assert pool.streams == 1  # one at a time: one stream
        bodies = [f"m{i}".encode() for i in range(40)]
        answers = await asyncio.gather(
            *(pool.call(request(record(b, i % 4)), 5.0) for i, b in enumerate(bodies))
        )
        assert 1 <= pool.streams <= 3
        assert all(len(offsets(a)) == 1 and offsets(a)[0] >= 0 for a in answers)
        assert all(a.store_timestamp_ms > 0 and not a.results for a in answers)
    finally:
        await pool.close()
    stored: list[bytes] = []
    for queue_id in range(4):
        resp = await pull(
            wired.channel,
            consumer_pb2.PullRequest(
                group="g", client_id="c", topic="T", queue_id=queue_id, max_messages=100
            ),
        )
        got = decode_records(resp.records)
        assert all(m.born_host.startswith("127.0.0.1:") and m.tags == "tag" for m in got)
        stored += [m.body for m in got]
    assert sorted(stored) == sorted([b"lone", *bodies])  # each exactly once


async def test_a_bad_record_is_answered_by_index_and_the_others_stored(wired: Wired) -> None:
    stub = broker_pb2_grpc.BrokerStub(wired.channel)
    resp = await stub.SendMessages(
        broker_pb2.SendMessagesRequest(
            records=b"".join((record(b"a", 1), record(b"b", 9), record(b"c", 1)))
        ),
        timeout=5,
    )
    assert offsets(resp) == [0, -1, 1]
    [bad] = resp.results
    assert (bad.index, bad.status.reason, bad.queue_id) == (1, "INVALID_QUEUE_ID", 9)
    assert "queue_id 9: must be between 0 and 3" in bad.status.message


async def test_messages_and_records_in_one_request_are_refused(wired: Wired) -> None:
    pool = MuxPool(
        wired.channel, SEND_STREAM, broker_pb2.SendStreamResponse.FromString, "broker b1", 1
    )
    both = broker_pb2.SendMessagesRequest(
        messages=[common_pb2.Message(topic="T", body=b"x")], records=record(b"y")
    )
    try:
        with pytest.raises(InvalidArgumentError, match="messages or records, not both"):
            await pool.call(both.SerializeToString(), 5.0)
    finally:
        await pool.close()
