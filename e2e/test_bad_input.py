"""Every bad input gets its own error - the right kind and status code, a sentence naming the
field and the rule - and the broker keeps serving without anything stored being touched.

Bad messages go through the SDK (which refuses most of them before sending, with the broker's
own sentences) and, to reach the broker's checks, through raw ``apogee.v1.Broker/SendMessages``
requests, as protobuf messages and as send records, in which each bad message travels with a
good one: the bad one gets its error, the good one is stored. Requests that fail as a whole,
and the ``apogee`` command's bad arguments, follow. The kinds are tabled in
:mod:`e2e.test_bad_input_kinds` (reserved properties, control characters, unique ids, bodies
flagged compressed, times); the cases below are the first ones. Afterwards every broker answers
its health check, good sends work, and the topic holds exactly the good messages.

The shared cluster does not create topics automatically and takes bodies of at most 64 KiB.
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys
import time
import zlib
from pathlib import Path

import grpc
import grpc.aio
import pytest

from apogee.client import AdminClient, Message, Producer, QueueReader, SendResult, SyncProducer
from apogee.common.errors import ApogeeError, UnknownTopicError
from apogee.rpc.errors import KIND_KEY
from apogee.rpc.server import check_health
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from e2e.harness import SHARED_MAX_MESSAGE_SIZE, Cluster, eventually, wait_for_route
from e2e.test_bad_input_kinds import (
    BIG_PROPERTIES,
    CLI_KINDS,
    LONG_TOPIC,
    MSG,
    QUEUES,
    RAW_COMPRESSION,
    RAW_EDGES,
    RAW_IDS,
    RAW_NAMES,
    RAW_OTHER,
    RAW_RESERVED,
    RAW_TIMES,
    RECORD_KINDS,
    REQUEST_KINDS,
    SDK_KINDS,
    TOO_LARGE,
    TOPIC,
    UNKNOWN,
    Case,
    CliCase,
    RawCase,
    RecordCase,
    pb,
    record,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BROKERS = {"broker-a", "broker-b"}
#: Kinds of bad input the test sends, at the least (the audit's count).
AUDITED_KINDS = 137


def incompressible(size: int) -> bytes:
    return os.urandom(size)  # the SDK compresses large bodies only when that makes them smaller


#: Through the SDK: the first five are refused by the SDK itself, the broker answers the others.
SDK_CASES = [
    Case(
        "bad topic name",
        lambda: Message("bad topic", b"x"),
        "INVALID_TOPIC",
        "INVALID_ARGUMENT",
        ("topic 'bad topic'", "character outside [%|a-zA-Z0-9_-]"),
    ),
    Case(
        "too long topic",
        lambda: Message(LONG_TOPIC, b"x"),
        "INVALID_TOPIC",
        "INVALID_ARGUMENT",
        ("is 128 characters; at most 127",),
    ),
    Case(
        "empty body",
        lambda: Message(TOPIC, b""),
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        ("body: must not be empty",),
    ),
    Case(
        "properties too large",
        lambda: Message(TOPIC, b"bad-sdk", properties=BIG_PROPERTIES),
        "PROPERTIES_TOO_LARGE",
        "INVALID_ARGUMENT",
        ("properties are", "the maximum is 32767 bytes (max_properties_size)"),
    ),
    Case(
        "delay level 19",
        lambda: Message(TOPIC, b"bad-sdk", delay_level=19),
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        ("delay_level", "from 0 to 18, got 19"),
    ),
    Case(
        "system topic TBW102",
        lambda: Message("TBW102", b"x"),
        "PERMISSION_DENIED",
        "PERMISSION_DENIED",
        ("topic 'TBW102'", "is a system topic"),
    ),
    Case(
        "system topic SCHEDULE_TOPIC_XXXX",
        lambda: Message("SCHEDULE_TOPIC_XXXX", b"x"),
        "PERMISSION_DENIED",
        "PERMISSION_DENIED",
        ("topic 'SCHEDULE_TOPIC_XXXX'", "is a system topic"),
    ),
    Case(
        "unknown topic",
        lambda: Message(UNKNOWN, b"x"),
        "UNKNOWN_TOPIC",
        "NOT_FOUND",
        (f"topic '{UNKNOWN}'", "has no route"),
    ),
    # the SDK takes bodies up to 4 MiB; this broker only up to 64 KiB
    Case(
        "body over the broker's maximum",
        lambda: Message(TOPIC, incompressible(TOO_LARGE)),
        "MESSAGE_TOO_LARGE",
        "INVALID_ARGUMENT",
        (
            f"body is {TOO_LARGE} bytes",
            f"the maximum is {SHARED_MAX_MESSAGE_SIZE} bytes (max_message_size)",
        ),
    ),
    Case(
        "delivery time beyond the broker's cap",
        lambda: Message(TOPIC, b"bad-sdk", deliver_at=time.time() + 30 * 86_400),
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        ("deliver_at_ms", "the maximum is 7 days"),
    ),
]


RAW_CASES = [
    RawCase(
        "bad topic name",
        pb("bad topic"),
        "INVALID_TOPIC",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("topic 'bad topic'", "character outside [%|a-zA-Z0-9_-]"),
    ),
    RawCase(
        "too long topic",
        pb(LONG_TOPIC),
        "INVALID_TOPIC",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("is 128 characters; at most 127",),
    ),
    RawCase(
        "empty body",
        pb(body=b""),
        "INVALID_ARGUMENT",
        grpc.StatusCode.INVALID_ARGUMENT,
        (f"{MSG}.body: must not be empty",),
    ),
    RawCase(
        "body over the maximum",
        pb(body=b"b" * TOO_LARGE),
        "MESSAGE_TOO_LARGE",
        grpc.StatusCode.INVALID_ARGUMENT,
        (
            f"{MSG}.body is {TOO_LARGE} bytes",
            f"the maximum is {SHARED_MAX_MESSAGE_SIZE} bytes (max_message_size)",
        ),
    ),
    RawCase(
        "properties too large",
        pb(properties=BIG_PROPERTIES),
        "PROPERTIES_TOO_LARGE",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("properties are", "the maximum is 32767 bytes (max_properties_size)"),
    ),
    RawCase(
        "separator in a property",
        pb(properties={"note": "a\x01b"}),
        "INVALID_PROPERTY",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("property 'note'",),
    ),
    RawCase(
        "unknown topic",
        pb(UNKNOWN),
        "UNKNOWN_TOPIC",
        grpc.StatusCode.NOT_FOUND,
        (f"topic '{UNKNOWN}' does not exist on broker", "auto_create_topics is off"),
    ),
    RawCase(
        "system topic TBW102",
        pb("TBW102"),
        "PERMISSION_DENIED",
        grpc.StatusCode.PERMISSION_DENIED,
        ("topic 'TBW102'", "is a system topic"),
    ),
    RawCase(
        "system topic SCHEDULE_TOPIC_XXXX",
        pb("SCHEDULE_TOPIC_XXXX"),
        "PERMISSION_DENIED",
        grpc.StatusCode.PERMISSION_DENIED,
        ("topic 'SCHEDULE_TOPIC_XXXX'", "is a system topic"),
    ),
    RawCase(
        "delay level 19",
        pb(delay_level=19),
        "INVALID_ARGUMENT",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("delay_level 19", "between 1 and 18"),
    ),
    RawCase(
        "queue id past the topic's queues",
        pb(queue_id=QUEUES),
        "INVALID_QUEUE_ID",
        grpc.StatusCode.INVALID_ARGUMENT,
        (f"queue_id {QUEUES}", f"between 0 and {QUEUES - 1}"),
    ),
    RawCase(
        "unknown system flag",
        pb(sys_flag=0x4),
        "INVALID_ARGUMENT",
        grpc.StatusCode.INVALID_ARGUMENT,
        (f"{MSG}.sys_flag", "only bit 0x1"),
    ),
]

SDK = [*SDK_CASES, *SDK_KINDS]
#: Raw protobuf messages, a request per group (each bad message followed by a good one).
RAW_GROUPS = [RAW_CASES, RAW_RESERVED, RAW_NAMES, RAW_IDS, RAW_COMPRESSION, RAW_TIMES, RAW_OTHER]
#: Send records, in requests of at most this many bad ones (each followed by a good one).
RECORDS_PER_REQUEST = 40


def count_kinds() -> int:
    return (
        len(SDK)
        + sum(map(len, RAW_GROUPS))
        + len(RECORD_KINDS)
        + len(REQUEST_KINDS)
        + len(CLI_KINDS)
    )


def check_error(err: BaseException, kind: str, code: str, says: tuple[str, ...]) -> None:
    assert isinstance(err, ApogeeError), repr(err)
    assert (err.kind.name, err.kind.code, err.retriable) == (kind, code, False), str(err)
    for fragment in says:
        assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"


def check_status(status: common_pb2.Status, case: RawCase | RecordCase, index: int) -> None:
    """``status`` is ``case``'s refusal; ``{i}`` in a fragment is ``index``."""
    assert (status.code, status.reason, status.retriable) == (
        case.code.value[0],
        case.kind,
        False,
    ), f"{case.name}: {status}"
    for fragment in case.says:
        expected = fragment.replace("{i}", str(index))
        assert expected in status.message, f"{case.name}: {expected!r} not in {status.message!r}"


@pytest.mark.parametrize("kinds", [count_kinds()], ids=lambda n: f"{n}-kinds")
async def test_every_bad_input_gets_its_error_and_the_broker_keeps_serving(
    cluster: Cluster, tmp_path: Path, kinds: int
) -> None:
    assert kinds >= AUDITED_KINDS, f"{kinds} kinds of bad input, fewer than the audit found"
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(TOPIC, queues=QUEUES)
        await wait_for_route(cluster.nameservers, TOPIC, BROKERS)
        async with Producer(cluster.namesrv, group="e2e-input") as producer:
            before = list(
                await asyncio.gather(
                    *(producer.send(Message(TOPIC, f"before-{i}".encode())) for i in range(40))
                )
            )
            for case in SDK:
                with pytest.raises(ApogeeError) as caught:
                    await producer.send(case.message())
                check_error(caught.value, case.kind, case.code, case.says)

        def sync_sends() -> None:
            with SyncProducer(cluster.namesrv, group="e2e-input-sync") as sync:
                for case in SDK:
                    with pytest.raises(ApogeeError) as caught:
                        sync.send(case.message())
                    check_error(caught.value, case.kind, case.code, case.says)

        await asyncio.to_thread(sync_sends)

        #: unique id -> body of every good message sent raw
        raw_good: dict[str, bytes] = {}
        for broker in cluster.brokers:
            raw_good |= await raw_bad_sends(broker.address, broker.name)
        await cli_bad_arguments(cluster.namesrv, tmp_path / "home")

        # the broker still serves, and good sends work
        for broker in cluster.brokers:
            assert await check_health(broker.address, 2.0)
        async with Producer(cluster.namesrv, group="e2e-input") as producer:
            after = await asyncio.gather(
                *(producer.send(Message(TOPIC, f"after-{i}".encode())) for i in range(40))
            )
        assert {r.broker_name for r in after} == BROKERS

        # nothing stored was touched: every message is where it was, with its body
        async def same(r: SendResult, body: bytes) -> None:
            m = await admin.get_message(r.message_id)
            assert (m.broker_name, m.queue_id, m.queue_offset, m.body) == (
                r.broker_name,
                r.queue_id,
                r.queue_offset,
                body,
            )

        await asyncio.gather(*(same(r, f"before-{i}".encode()) for i, r in enumerate(before)))

        # the topic holds the good messages, each once, and nothing else
        good = {r.message_id: f"before-{i}".encode() for i, r in enumerate(before)}
        good |= {r.message_id: f"after-{i}".encode() for i, r in enumerate(after)}
        good |= raw_good
        stored: dict[str, bytes] = {}

        async def all_readable() -> bool:  # the last sends may still be on their way to queues
            nonlocal stored
            stored = await read_topic(cluster.namesrv)
            return stored.keys() >= good.keys()

        await eventually(all_readable, 10.0, "every good message readable")
        extra = {uid: stored[uid][:40] for uid in stored.keys() - good.keys()}
        assert not extra, f"stored, yet not sent as a good message: {extra}"
        assert stored == good
        status = await admin.describe_topic(TOPIC)
        assert status.messages == len(good)
        assert all(q.min_offset == 0 for b in status.brokers for q in b.queues)

        # nothing was created by the bad sends
        with pytest.raises(UnknownTopicError):
            await admin.describe_topic(UNKNOWN)
        assert UNKNOWN not in await admin.list_topics()
        system = await admin.describe_topic("TBW102")
        assert system.messages == 0

    for broker in cluster.brokers:
        log = await asyncio.to_thread(Path(broker.log).read_text)
        errors = [line for line in log.splitlines() if " ERROR " in line]
        assert not errors, f"{broker.name} logged errors: {errors[:3]}"


async def read_topic(namesrv: str) -> dict[str, bytes]:
    """unique id -> body of every message of the topic, read queue by queue from offset 0."""
    out: dict[str, bytes] = {}
    async with QueueReader(namesrv) as reader:
        for queue in await reader.queues(TOPIC):
            async for m in reader.read(queue, 0):
                assert m.unique_id not in out, f"{m.unique_id} stored twice"
                out[m.unique_id] = m.body
    return out


async def raw_bad_sends(address: str, broker: str) -> dict[str, bytes]:
    """Every raw kind, each bad message or record with a good one behind it: the bad one gets
    its status, the good one is stored. Then the messages on the good side of each rule's edge,
    and the request-level problems. Returns unique id -> body of the good messages."""
    good: dict[str, bytes] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = broker_pb2_grpc.BrokerStub(channel)
        for g, group in enumerate(RAW_GROUPS):
            good |= await raw_messages(stub, broker, g, group)
        for start in range(0, len(RECORD_KINDS), RECORDS_PER_REQUEST):
            chunk = RECORD_KINDS[start : start + RECORDS_PER_REQUEST]
            good |= await raw_records(stub, broker, start, chunk)
        good |= await raw_edges(stub, broker)

        # request-level problems fail the call, with the kind in the trailing metadata
        for case in REQUEST_KINDS:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.SendMessages(case.request(), timeout=5)
            err = caught.value
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, case.name
            assert case.says in (err.details() or ""), f"{case.name}: {err.details()!r}"
            assert (KIND_KEY, "INVALID_ARGUMENT") in tuple(err.trailing_metadata() or ())
    return good


async def raw_messages(
    stub: broker_pb2_grpc.BrokerAsyncStub, broker: str, g: int, group: list[RawCase]
) -> dict[str, bytes]:
    """One request: the group's bad messages, each followed by a good one."""
    messages: list[common_pb2.Message] = []
    bodies = []
    for k, case in enumerate(group):
        body = f"good-raw-{broker}-{g}-{k}".encode()
        bodies.append(body)
        bad = case.message() if callable(case.message) else case.message
        messages += [bad, pb(body=body, queue_id=k % QUEUES)]
    resp = await stub.SendMessages(broker_pb2.SendMessagesRequest(messages=messages), timeout=10)
    assert resp.broker_name == broker
    assert len(resp.results) == len(messages)
    good = {}
    for k, case in enumerate(group):
        bad_result, good_result = resp.results[2 * k], resp.results[2 * k + 1]
        check_status(bad_result.status, case, 2 * k)
        assert good_result.status.code == 0, f"{case.name}: the good message {good_result}"
        good[good_result.unique_id] = bodies[k]
    return good


async def raw_records(
    stub: broker_pb2_grpc.BrokerAsyncStub, broker: str, start: int, chunk: list[RecordCase]
) -> dict[str, bytes]:
    """One request of send records: the chunk's bad ones, each followed by a good one."""
    good = {}
    data = []
    for k, case in enumerate(chunk, start):
        uid = f"GOOD-REC-{broker}-{k}"
        good[uid] = f"good-record-{broker}-{k}".encode()
        bad = case.record() if callable(case.record) else case.record
        data += [bad, record(uid, body=good[uid], queue_id=k % QUEUES)]
    resp = await stub.SendMessages(
        broker_pb2.SendMessagesRequest(records=b"".join(data)), timeout=10
    )
    assert resp.broker_name == broker
    offsets = struct.unpack(f"<{2 * len(chunk)}q", resp.queue_offsets)
    results = {r.index: r for r in resp.results}
    for k, case in enumerate(chunk):
        assert offsets[2 * k] == -1, f"{case.name}: stored at offset {offsets[2 * k]}"
        check_status(results[2 * k].status, case, 2 * k)
        assert offsets[2 * k + 1] >= 0, f"{case.name}: the good record {results.get(2 * k + 1)}"
    assert sorted(results) == list(range(0, 2 * len(chunk), 2))
    return good


async def raw_edges(stub: broker_pb2_grpc.BrokerAsyncStub, broker: str) -> dict[str, bytes]:
    """Messages on the good side of each rule: every one is stored."""
    messages = [make(broker) for _, make in RAW_EDGES]
    resp = await stub.SendMessages(broker_pb2.SendMessagesRequest(messages=messages), timeout=10)
    good = {}
    for (what, _), m, r in zip(RAW_EDGES, messages, resp.results, strict=True):
        assert r.status.code == 0, f"{what}: {r.status}"
        good[r.unique_id] = zlib.decompress(m.body) if m.sys_flag & 1 else m.body
    return good


async def cli_bad_arguments(namesrv: str, home: Path) -> None:
    """The command's bad arguments against the cluster, a few at a time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
    env["APOGEE_HOME"] = str(home)
    limit = asyncio.Semaphore(3)

    async def run(case: CliCase) -> None:
        async with limit:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "apogee.cli",
                "--namesrv",
                namesrv,
                *case.argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        text = err.decode()
        assert proc.returncode == case.status, f"{case.name}: exit {proc.returncode}: {text}"
        assert out == b"", f"{case.name}: {out!r}"
        assert "Traceback" not in text, text
        lines = text.strip().splitlines()
        assert lines, f"{case.name}: nothing on stderr"
        assert case.says in lines[-1], f"{case.name}: {text}"

    await asyncio.gather(*(run(case) for case in CLI_KINDS))
