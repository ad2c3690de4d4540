"""A fuzz pass over every RPC of the internal protocol, against a cluster of real processes.

Every service and method is found in the generated descriptors (``apogee.v1.*_pb2``), so a
method added later is fuzzed without touching this file. Each service goes to the members that
serve it (the nameserver, the broker, the schedule service), found by sending every member bytes
that do not parse (refused before any handler runs; a member without the service answers
UNIMPLEMENTED); a member that serves a service must list it in its health service too. Each
method gets :data:`CALLS_PER_METHOD` calls, each built from (seed, method, index) alone:

- bytes that do not parse as the method's request (refused with INVALID_ARGUMENT);
- random bytes, which may or may not parse;
- requests that parse but are hostile (:class:`~e2e.fuzzing.Hostile`): empty, 10,000-character,
  control-character and non-ASCII strings, int limits, NaN and infinities, unknown enum
  numbers, 0, 1 or 1,000 repeated items, nested messages, random bytes and mutated send
  records; a share of the values are the names and offsets that exist in the cluster (its
  topic, group, broker, stored messages), so that calls get past the first check into the core.

Streaming methods get 0 to 4 such messages on the stream, which is then closed. Every call has
a deadline of :data:`~e2e.fuzzing.CALL_TIMEOUT` seconds. (A client still writing a stream when
the server ends the call sometimes reports grpcio's own INTERNAL "Internal error from Core" in
place of the server's status; such a call is made again, see :attr:`~e2e.fuzzing.Answer.lost`.)

What must hold: no call ends with UNKNOWN or INTERNAL; every other failure is the server's own
answer (its error kind in the ``apogee-error-kind`` trailer) with a sentence as details; bytes
that do not parse get INVALID_ARGUMENT; no answer carries an UNKNOWN or INTERNAL status inside;
a deadline is exceeded only by a call that asked to be held (a ``hold_ms`` above 0, the
documented long polls of PullStream and Scan); no call outlives its deadline. After the pass
every member answers its health check, the nameserver lists only the real brokers again, a
message is sent and read back, no member's log holds a traceback or an ERROR line, and the
cluster stops gracefully.

Methods with lasting effects run last (:data:`LAST`): DeleteTopic (it may delete the topic the
others aim at) and UnregisterBroker (it may drop the real broker from the nameserver until its
next heartbeat, a second later). No method stops a member by design. RegisterBroker adds made-up
brokers to the nameserver; they expire after 5 s of silence, and the checks wait for that.

The seed is printed; ``APOGEE_FUZZ_SEED=<n>`` runs another one. A failure names the method, the
seed and the call's index, shows what was sent, and quotes the logs.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
import grpc.aio
import pytest

from apogee.client import AdminClient, Producer, QueueReader
from apogee.client import Message as ClientMessage
from apogee.rpc.server import check_health
from e2e.fuzzing import (
    Answer,
    Call,
    Known,
    Rpc,
    all_rpcs,
    build_call,
    check_answer,
    send,
    unparsable,
)
from e2e.harness import Cluster, ClusterFactory, eventually, live_brokers, wait_for_route

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEED: Final = int(os.environ.get("APOGEE_FUZZ_SEED", "20250611"))
#: Calls per method (``APOGEE_FUZZ_CALLS=<n>`` for a longer run).
CALLS_PER_METHOD: Final = int(os.environ.get("APOGEE_FUZZ_CALLS", "96"))
#: Calls in flight at once.
CONCURRENCY: Final = 8
#: Tries of a call whose status the client lost (see Answer.lost).
LOST_RETRIES: Final = 3
#: At least this many methods must be found (31 when this was written).
MIN_METHODS: Final = 31
#: Services the cluster must serve; others found in the descriptors are fuzzed too.
KNOWN_SERVICES: Final = frozenset(
    {
        "apogee.v1.NameServer",
        "apogee.v1.Broker",
        "apogee.v1.BrokerAdmin",
        "apogee.v1.Consumer",
        "apogee.v1.ConsumerAdmin",
        "apogee.v1.Schedule",
    }
)
#: Methods with lasting effects on what the others aim at: fuzzed after all the others.
LAST: Final = frozenset(
    {"apogee.v1.BrokerAdmin/DeleteTopic", "apogee.v1.NameServer/UnregisterBroker"}
)

TOPIC: Final = "FuzzTopic"
GROUP: Final = "FuzzGroup"
PRODUCER_GROUP: Final = "FuzzProducers"
AFTER_TOPIC: Final = "FuzzAfter"
BROKER: Final = "broker-a"
CLUSTER: Final = "DefaultCluster"
#: Brokers hold pulls for at most a second here (a fuzzed hold_ms may be anything).
BROKER_ENV: Final = {"APOGEE_BROKER_LONG_POLL_MAX_MS": "1000"}

# -- the cluster -------------------------------------------------------------------------------


async def servers_of(
    cluster: Cluster, rpcs: Sequence[Rpc]
) -> tuple[dict[str, list[str]], list[str]]:
    """Service -> addresses of the members that serve it, found by sending each member bytes
    that do not parse on the service's first method: a member with the service refuses them
    before any handler runs (no side effects), one without answers UNIMPLEMENTED. Also returns
    what is wrong: a probe answered otherwise, a service served but not in the member's health
    service."""
    first: dict[str, Rpc] = {}
    for r in rpcs:
        first.setdefault(r.service, r)
    out: dict[str, list[str]] = {}
    wrong: list[str] = []
    for service, rpc in sorted(first.items()):
        out[service] = []
        bad = unparsable(random.Random(0), rpc.method.input_type)
        probe = Call(rpc, SEED, -1, "unparsable", [bad])
        for p in cluster.state.all():
            async with grpc.aio.insecure_channel(p.address) as channel:
                answer = await send(channel, probe)
            if answer.code == grpc.StatusCode.UNIMPLEMENTED:
                continue
            if answer.code != grpc.StatusCode.INVALID_ARGUMENT or answer.kind != "INVALID_ARGUMENT":
                wrong.append(f"{p.name} answered {rpc.path} {answer.code.name}: {answer.details}")
                continue
            out[service].append(p.address)
            if not await check_health(p.address, 5.0, service):
                wrong.append(f"{p.name} serves {service}, but its health service says not")
    return out, wrong


async def seed_cluster(cluster: Cluster) -> Known:
    """A topic with messages (plain, keyed, delayed), so that fuzzed calls find things."""
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(TOPIC, queues=4)
        await wait_for_route(cluster.nameservers, TOPIC, {BROKER})
        async with Producer(cluster.namesrv, group=GROUP) as producer:
            results = [
                await producer.send(
                    ClientMessage(TOPIC, f"seed-{i}".encode(), tags="TagA", keys=f"k{i}")
                )
                for i in range(8)
            ]
            results.append(await producer.send(ClientMessage(TOPIC, b"delayed", delay_level=3)))
        stored = [await admin.get_message(r.message_id) for r in results[:8]]
    broker = cluster.member(BROKER)
    ints = [0, 1, 2, 3, 4]
    for m in stored:
        ints += [m.queue_offset, m.phys_offset, m.queue_id]
    now = int(time.time() * 1000)
    ints += [now, now - 3_600_000, now + 3_600_000, now + 8 * 86_400_000]
    ids = [r.message_id for r in results]
    return Known(
        strings={
            "topic": [TOPIC, TOPIC, f"%RETRY%{GROUP}", "SCHEDULE_TOPIC_XXXX"],
            "group": [GROUP, GROUP, "APOGEE_QUEUE_READER"],
            "client_id": ["fuzz-client-1", "fuzz-client-2"],
            "unique_id": ids,
            "key": ["k1", "k2"],
            "keys": ["k1"],
            "tag_expression": ["*", "TagA", "TagA || TagB", ""],
            "tags": ["TagA"],
            "sql_expression": ["", "color = 'red'", "TAGS = 'TagA'", "a >"],
            "broker_name": [BROKER],
            "cluster": [CLUSTER],
            "address": [broker.address],
            "name": [TOPIC, f"%DLQ%{GROUP}"],
            "producer_group": [PRODUCER_GROUP],
        },
        ints=ints,
    )


@dataclass
class Finding:
    call: Call
    address: str
    problem: str

    def __str__(self) -> str:
        return (
            f"{self.call.where} at {self.address}: {self.problem}\n  sent:\n{self.call.describe()}"
        )


#: ``check(call, answer)``: what else is wrong with an answer (a variant's own rules)
ExtraCheck = Callable[[Call, Answer], list[str]]


async def fuzz(
    servers: dict[str, list[str]],
    rpcs: Sequence[Rpc],
    known: Known,
    open_channel: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel,
    calls_per_method: int = CALLS_PER_METHOD,
    extra_check: ExtraCheck | None = None,
) -> tuple[int, int, list[Finding]]:
    """Every call of every method at each member that serves it, on channels ``open_channel``
    makes (plain ones by default); returns how many calls were made, of how many the client
    lost the status every time, and what was wrong with the answers."""
    findings: list[Finding] = []
    made = lost = 0
    room = asyncio.Semaphore(CONCURRENCY)
    channels: dict[str, grpc.aio.Channel] = {}

    def channel(address: str) -> grpc.aio.Channel:
        if address not in channels:
            channels[address] = open_channel(address)
        return channels[address]

    async def one(rpc: Rpc, index: int) -> None:
        nonlocal made, lost
        async with room:
            call = build_call(rpc, SEED, index, known)
            for address in servers[rpc.service]:
                for _ in range(LOST_RETRIES):
                    answer = await send(channel(address), call)
                    made += 1
                    if not answer.lost:
                        break
                else:  # the server's logs still tell whether it failed
                    lost += 1
                    continue
                problems = check_answer(call, answer)
                if extra_check is not None:
                    problems += extra_check(call, answer)
                for problem in problems:
                    findings.append(Finding(call, address, problem))

    try:
        for batch in (
            [r for r in rpcs if r.key not in LAST],
            [r for r in rpcs if r.key in LAST],
        ):
            await asyncio.gather(*(one(r, i) for r in batch for i in range(calls_per_method)))
    finally:
        for ch in channels.values():
            await ch.close()
    return made, lost, findings


#: ERROR lines that are a member's right answer to what the fuzz does, not a handler's bug.
EXPECTED_ERRORS: Final = (
    # a fuzzed DeleteTopic removed a topic that delayed messages of fuzzed sends were waiting
    # for: when due, the broker keeps them as dead letters, and says so
    re.compile(
        r" ERROR apogee_broker\.core\.schedule\.service delayed message \S+ cannot be delivered "
        r"\(its topic .* no longer exists on this broker\); kept in %DLQ%SYS_SCHEDULE$"
    ),
)


def log_problems(cluster: Cluster) -> list[str]:
    """Tracebacks and unexpected ERROR lines in the members' logs, each with its neighbours."""
    found = []
    for p in cluster.state.all():
        lines = Path(p.log).read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "Traceback" not in line and any(e.search(line) for e in EXPECTED_ERRORS):
                continue
            if "Traceback" in line or " ERROR " in line or " CRITICAL " in line:
                excerpt = "\n".join(x[:3000] for x in lines[max(0, i - 2) : i + 8])
                found.append(f"==> {p.name} ({p.log}) line {i + 1}:\n{excerpt}")
    return found


async def send_and_read(cluster: Cluster) -> None:
    """A normal send, and reading it back by offset and by id."""
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(AFTER_TOPIC, queues=2)
        await wait_for_route(cluster.nameservers, AFTER_TOPIC, {BROKER})
        async with Producer(cluster.namesrv, group="fuzz-after") as producer:
            sent = await producer.send(ClientMessage(AFTER_TOPIC, b"after the fuzz", keys="k"))
        assert (await admin.get_message(sent.message_id)).body == b"after the fuzz"
    async with QueueReader(cluster.namesrv) as reader:
        queue = next(q for q in await reader.queues(AFTER_TOPIC) if q.queue_id == sent.queue_id)
        batch = await reader.read_batch(queue, sent.queue_offset, 1)
    assert [m.body for m in batch.messages] == [b"after the fuzz"], batch


# -- the test ----------------------------------------------------------------------------------


def test_every_method_is_found_in_the_descriptors() -> None:
    rpcs = all_rpcs()
    listing = "\n".join(f"  {r.path}" for r in rpcs)
    assert len(rpcs) >= MIN_METHODS, (
        f"{len(rpcs)} methods found, expected {MIN_METHODS}:\n{listing}"
    )
    assert {r.service for r in rpcs} >= KNOWN_SERVICES, listing
    assert {r.key for r in rpcs} >= LAST, listing


async def test_fuzzing_every_rpc_gets_clear_errors_and_breaks_nothing(
    start_cluster: ClusterFactory,
) -> None:
    print(f"fuzz seed {SEED} (APOGEE_FUZZ_SEED={SEED} repeats this run)")
    rpcs = all_rpcs()
    listing = "\n".join(f"  {r.path}" for r in rpcs)
    assert len(rpcs) >= MIN_METHODS, f"{len(rpcs)} methods found:\n{listing}"
    cluster = await asyncio.to_thread(
        lambda: start_cluster("fuzz", brokers=1, nameservers=1, broker_env=BROKER_ENV)
    )
    assert cluster.state.schedule, "the schedule service did not start"
    known = await seed_cluster(cluster)

    servers, wrong = await servers_of(cluster, rpcs)
    served = [r for r in rpcs if servers[r.service]]
    unserved = sorted(s for s, addresses in servers.items() if not addresses)
    assert KNOWN_SERVICES.isdisjoint(unserved), f"no member serves {unserved}:\n{listing}"
    assert not wrong, wrong

    started = time.monotonic()
    made, lost, findings = await fuzz(servers, served, known)
    took = time.monotonic() - started
    print(
        f"{made} calls to {len(served)} methods in {took:.1f}s ({lost} statuses lost to the "
        f"client's write race); services no member serves: {', '.join(unserved) or 'none'}\n"
        + "\n".join(f"  {r.path} at {', '.join(servers[r.service])}" for r in served)
    )
    assert made >= len(served) * CALLS_PER_METHOD

    # every member still serves, and the made-up brokers have expired from the nameserver
    for p in cluster.state.all():
        assert await check_health(p.address, 5.0), f"{p.name} does not answer its health check"
    for ns in cluster.nameservers:

        async def only_real(address: str = ns.address) -> bool:
            return await live_brokers(address) == {BROKER}

        await eventually(only_real, 15.0, f"{ns.name} lists only {BROKER}")
    await send_and_read(cluster)

    logged = await asyncio.to_thread(log_problems, cluster)
    report = []
    if findings:
        report.append(f"{len(findings)} bad answers of {made} calls (seed {SEED}):")
        findings.sort(key=lambda f: (f.call.rpc.key, f.call.index))
        report += [str(f) for f in findings[:15]]
    if logged:
        report.append(f"{len(logged)} tracebacks or ERROR lines in the logs (seed {SEED}):")
        report += logged[:10]
    assert not report, "\n\n".join(report)
    await asyncio.to_thread(cluster.stop)
