"""The copying stream (``Replication/Replicate``) as a follower sees it on the wire: the leader
pushes its log from the offset asked, never more than the window past what was acknowledged,
says it is there when it has nothing new, and ends the stream with an error that names what
was wrong when an acknowledgement or an epoch is. A real leader in this process; the
"follower" is a raw gRPC stream of the test's (a replica id of its own)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.client import Message, Producer
from apogee.common.errors import InvalidArgumentError, StaleEpochError
from apogee.rpc.errors import from_rpc_error
from apogee.rpc.security import ClientSecurity
from apogee.rpc.server import GrpcServer
from apogee.store import MessageStore
from apogee.store.epochs import EpochFile
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.replicas import ReplicaGroup as Group
from apogee.v1 import replication_pb2 as pb
from apogee.v1 import replication_pb2_grpc
from apogee_broker.replication.follower import Follower, FollowerConfig
from apogee_broker.replication.node import ReplicaNode

pytestmark = pytest.mark.integration

TOPIC = "Streamed"
Stream = grpc.aio.StreamStreamCall[pb.ReplicateRequest, pb.FetchResponse]


@pytest.fixture
async def group(tmp_path: Path) -> AsyncIterator[Group]:
    """A group of two, 40 messages of 1 KiB acknowledged."""
    async with (
        InProcessCluster(tmp_path / "ns", nameservers=1, brokers=()) as ns,
        Group(tmp_path, ns.namesrv, 2) as g,
    ):
        await g.start_all()
        await g.wait_leader(in_sync=2)
        async with Producer(g.namesrv) as producer:
            for i in range(40):
                await producer.send(Message(TOPIC, bytes([i]) * 1024))
        yield g


@pytest.fixture
async def leader(group: Group) -> ReplicaNode:
    return await group.wait_leader(in_sync=2)


def opening(
    node: ReplicaNode, offset: int, max_bytes: int = 0, window_bytes: int = 0, idle_ms: int = 0
) -> pb.ReplicateRequest:
    term = node.leader
    assert term is not None
    return pb.ReplicateRequest(
        broker_name="broker-a",
        replica_id="raw-follower",
        epoch=term.epoch,
        offset=offset,
        max_bytes=max_bytes,
        window_bytes=window_bytes,
        idle_ms=idle_ms,
        session="raw-session",
    )


async def read(stream: Stream) -> pb.FetchResponse:
    got = await asyncio.wait_for(stream.read(), 5)
    assert isinstance(got, pb.FetchResponse), f"the stream ended: {got!r}"
    return got


async def failure(stream: Stream) -> Exception:
    """The error the stream ends with (within a few answers)."""
    for _ in range(10):
        try:
            await read(stream)
        except grpc.aio.AioRpcError as exc:
            return from_rpc_error(exc, "the leader")
    raise AssertionError("the stream goes on")


async def test_the_leader_pushes_its_log_within_the_window_past_the_acknowledged(
    leader: ReplicaNode,
) -> None:
    term = leader.leader
    assert term is not None
    assert leader.store is not None
    end = term.written_end
    async with grpc.aio.insecure_channel(leader.address) as channel:
        stream: Stream = replication_pb2_grpc.ReplicationStub(channel).Replicate()
        await stream.write(opening(leader, 0, max_bytes=8192, window_bytes=20000, idle_ms=200))
        pushed: list[pb.FetchResponse] = []
        while (got := await read(stream)).data:
            pushed.append(got)
        # nothing more until an acknowledgement: the next answer is an empty one where the
        # pushed bytes end, which are the window's worth (whole records: one may pass it)
        at = pushed[-1].offset + len(pushed[-1].data)
        assert (got.offset, got.log_end) == (at, end)
        assert 20000 - 8192 < at <= 20000 + 2048 < end
        assert [r.offset for r in pushed] == [0, *(r.offset + len(r.data) for r in pushed[:-1])]
        assert all(0 < len(r.data) <= 8192 for r in pushed)
        await stream.write(pb.ReplicateRequest(offset=at))
        while at < end:  # acknowledged: the rest comes
            got = await read(stream)
            assert got.offset == at
            at += len(got.data)
            await stream.write(pb.ReplicateRequest(offset=at))
        assert at == end
        # the bytes are the leader's, unchanged
        pushed_bytes = b"".join(r.data for r in pushed)
        assert pushed_bytes == leader.store.commitlog.read(0, len(pushed_bytes))
        stream.cancel()


async def test_an_acknowledgement_not_where_an_answer_ends_ends_the_stream_naming_it(
    leader: ReplicaNode,
) -> None:
    async with grpc.aio.insecure_channel(leader.address) as channel:
        stream: Stream = replication_pb2_grpc.ReplicationStub(channel).Replicate()
        await stream.write(opening(leader, 0, max_bytes=4096, window_bytes=4096))
        first = await read(stream)
        await stream.write(pb.ReplicateRequest(offset=len(first.data) + 1))
        err = await failure(stream)
    assert isinstance(err, InvalidArgumentError)
    assert "offset" in str(err)
    assert str(len(first.data) + 1) in str(err)
    term = leader.leader
    assert term is not None
    assert not term.ended  # the leader goes on


async def test_a_stream_from_an_old_epoch_is_refused(leader: ReplicaNode) -> None:
    async with grpc.aio.insecure_channel(leader.address) as channel:
        stream: Stream = replication_pb2_grpc.ReplicationStub(channel).Replicate()
        old = opening(leader, 0)
        old.epoch -= 1
        await stream.write(old)
        err = await failure(stream)
    assert isinstance(err, StaleEpochError)


async def test_a_follower_that_stops_leaves_its_stream_at_once(group: Group) -> None:
    """The follower of the group stops (as on SIGTERM): its goodbye ends its stream at the
    leader, and it is out of the in-sync set at once, not after replica_lag_max_s."""
    node = await group.wait_leader(in_sync=2)
    term = node.leader
    assert term is not None
    i, follower = next((i, n) for i, n in enumerate(group.nodes) if n is not None and n is not node)
    assert term.streaming() == [follower.replica_id]
    loop = asyncio.get_running_loop()
    began = loop.time()
    await group.stop(i)
    while term.streaming() or follower.replica_id in term.in_sync:
        assert loop.time() - began < 3, (
            f"still streaming {term.streaming()}, in sync {term.in_sync}"
        )
        await asyncio.sleep(0.02)  # a poll with a deadline


class SilentLeader(replication_pb2_grpc.ReplicationServicer):
    """A leader that answers Epochs and then says nothing on the stream it accepts (a process
    hung after its listener accepted, as SIGSTOP leaves one once the kernel's backlog took the
    connection)."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def Epochs(self, request: pb.EpochsRequest, context: Any) -> pb.EpochsResponse:
        return pb.EpochsResponse(entries=[pb.EpochEntry(epoch=1, start_offset=0)])

    async def Replicate(  # type: ignore[override]  # never answers
        self, request_iterator: AsyncIterator[pb.ReplicateRequest], context: Any
    ) -> None:
        await anext(aiter(request_iterator))
        self.opened.set()
        await asyncio.Event().wait()  # held until the follower gives up and cancels


async def test_a_follower_gives_up_on_a_stream_that_says_nothing(tmp_path: Path) -> None:
    """Silence from the first request on counts: the follower ends after ``lost_after_s``,
    so its node looks at the group's record again instead of waiting on the stream."""
    leader = SilentLeader()  # type: ignore[abstract]  # only Epochs and Replicate are called
    srv = GrpcServer("127.0.0.1:0", "silent leader")
    replication_pb2_grpc.add_ReplicationServicer_to_server(leader, srv.server)
    port = await srv.start([])
    store = MessageStore.open(tmp_path / "store")
    epochs = EpochFile(tmp_path / "epochs")
    epochs.load()
    follower = Follower(
        FollowerConfig("broker-a", "quiet-follower", "127.0.0.1:1", lost_after_s=0.5),
        store,
        epochs,
        ClientSecurity(),
        "silent",
        f"127.0.0.1:{port}",
        1,
        unclean=False,
    )
    try:
        why = await asyncio.wait_for(follower.run(), 10)
        assert leader.opened.is_set()
        assert "unreachable" in why
        assert "sent nothing for 0.5s" in why
    finally:
        follower.stop()
        store.close()
        await srv.stop(0)
