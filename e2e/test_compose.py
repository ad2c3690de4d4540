"""docker-compose.yml under ``podman-compose``, with the images built once for the session: one
stack for the module (profile ``monitoring`` included), under a project name, published ports
and a /24 network of its own, taken down with its volumes at the end whatever happened.

- Every service passes its health check; both brokers register, advertising the compose
  network's gateway and their published ports.
- A client on this machine (through the published ports) and a client in a container on the
  compose network (through ``nameserver:9876``) each send 10,000 messages and consume them all.
- A delayed message (delay level 1) arrives no earlier than a second later, through the schedule
  service; a transaction left undecided by its producer is checked back by the txn-checker
  (rounds every second here) and delivered once the producer says COMMIT.
- ``podman kill`` (SIGKILL) of broker-a while a producer keeps sending, then its restart: every
  message acknowledged before, during and after is consumed; its store says it recovered from a
  crash.
- Prometheus scrapes every service.
- ``down -v`` leaves no container, volume or network of the project behind.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator

import pytest

from apogee.client import (
    AdminClient,
    Message,
    Producer,
    PullConsumer,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
)
from apogee.codec import PROP_CHECK_IMMUNITY
from apogee.common.errors import ApogeeError
from e2e.compose_client import round_trip
from e2e.containers import (
    ROOT,
    ComposeStack,
    inspect,
    podman,
    wait_for,
    wait_healthy,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

SERVICES = ("nameserver", "broker-a", "broker-b", "schedule", "txn-checker")
COUNT = 10_000
#: seconds to wait for deliveries and consumption
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def stack(images: float) -> Iterator[ComposeStack]:
    s = ComposeStack(
        profiles=["monitoring"], extra_env={"APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": "1"}
    )
    try:
        s.up()
        for service in SERVICES:
            wait_healthy(s.container(service))
        wait_for("both brokers registered", lambda: len(asyncio.run(_brokers(s))) == 2, 60)
        yield s
    finally:
        s.down()


async def _brokers(s: ComposeStack) -> dict[str, str]:
    async with AdminClient(s.namesrv) as admin:
        try:
            return {b.broker_name: b.address for b in await admin.cluster_info()}
        except ApogeeError:
            return {}


async def test_brokers_advertise_the_gateway_and_their_published_ports(
    stack: ComposeStack,
) -> None:
    assert await _brokers(stack) == {
        "broker-a": f"{stack.gateway}:{stack.ports['BROKER_A']}",
        "broker-b": f"{stack.gateway}:{stack.ports['BROKER_B']}",
    }


async def test_a_client_on_the_host_sends_and_consumes_10000_messages(
    stack: ComposeStack,
) -> None:
    summary = await round_trip(stack.namesrv, "ComposeFromHost", "compose-host", COUNT)
    assert summary["sent"] == COUNT
    assert summary["missing"] == 0, summary
    assert summary["brokers"] == ["broker-a", "broker-b"]


def test_a_client_on_the_compose_network_sends_and_consumes_10000_messages(
    stack: ComposeStack,
) -> None:
    """The client runs in the broker's image (the SDK's source mounted read-only: the image
    holds everything else it needs), as any container of the compose network would."""
    out = podman(
        "run",
        "--rm",
        "--network",
        stack.network,
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--cap-drop=ALL",
        "-e",
        "PYTHONPATH=/opt/client",
        "-v",
        f"{ROOT / 'libs/apogee-client/src'}:/opt/client:ro",
        "-v",
        f"{ROOT / 'e2e/compose_client.py'}:/opt/compose_client.py:ro",
        "--entrypoint",
        "python",
        "apogee/broker:dev",
        "/opt/compose_client.py",
        "nameserver:9876",
        "ComposeFromNetwork",
        "compose-net",
        str(COUNT),
        timeout=300,
    )
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["sent"] == COUNT
    assert summary["missing"] == 0, summary
    assert summary["brokers"] == ["broker-a", "broker-b"]


async def test_a_delayed_and_a_transactional_message_are_delivered(stack: ComposeStack) -> None:
    topic = "ComposeSpecial"
    async with AdminClient(stack.namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=2)
    checks: list[str] = []

    async def commit_when_asked(m: TransactionCheckMessage) -> TransactionDecision:
        checks.append(m.transaction_id)
        return TransactionDecision.COMMIT

    got: dict[bytes, float] = {}
    async with (
        PullConsumer(
            stack.namesrv, "compose-special", consume_from="earliest", rebalance_interval=1.0
        ) as consumer,
        Producer(stack.namesrv, group="compose-delays") as producer,
        TransactionProducer(stack.namesrv, "compose-txn", check_listener=commit_when_asked) as txn,
    ):
        consumer.subscribe(topic)
        await consumer.start()
        sent_at = time.time()
        await producer.send(Message(topic, b"delayed", delay_level=1))
        await txn.send_in_transaction(
            Message(topic, b"committed"), deciding(TransactionDecision.COMMIT)
        )
        undecided = Message(topic, b"checked", properties={PROP_CHECK_IMMUNITY: "1"})
        await txn.send_in_transaction(undecided, deciding(TransactionDecision.UNKNOWN))
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < 3 and time.monotonic() < deadline:
            for m in await consumer.poll(timeout=1.0):
                got.setdefault(m.body, time.time())
    assert set(got) == {b"delayed", b"committed", b"checked"}, got
    assert got[b"delayed"] - sent_at >= 0.9
    assert checks, "the txn-checker never asked the producer"


def deciding(
    decision: TransactionDecision,
) -> Callable[[TransactionMessage, object], Awaitable[TransactionDecision]]:
    async def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        return decision

    return executor


async def test_a_broker_killed_and_restarted_loses_no_acknowledged_message(
    stack: ComposeStack,
) -> None:
    topic = "ComposeKill"
    broker = stack.container("broker-a")
    async with AdminClient(stack.namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=4)
    acked: set[str] = set()
    on_a = 0
    restarted = asyncio.Event()
    async with Producer(stack.namesrv, group="compose-kill", send_timeout=15.0) as producer:
        before = await asyncio.gather(
            *(producer.send_nowait(Message(topic, f"before-{i}".encode())) for i in range(2000))
        )
        acked.update(r.message_id for r in before)
        on_a = sum(r.broker_name == "broker-a" for r in before)

        async def keep_sending() -> None:
            i = 0
            while not restarted.is_set():
                try:
                    r = await producer.send(Message(topic, f"during-{i}".encode()))
                except ApogeeError:
                    pass  # not acknowledged: no promise made
                else:
                    acked.add(r.message_id)
                i += 1
                await asyncio.sleep(0.005)  # a steady trickle, not a flood

        sender = asyncio.create_task(keep_sending())
        await asyncio.to_thread(podman, "kill", "--signal", "KILL", broker)
        assert inspect(broker)["State"]["Running"] is False
        # podman counts a kill as the user's stop: the restart policy leaves it, an operator
        # (here the test) starts it again on the same volume
        await asyncio.to_thread(podman, "start", broker)
        await asyncio.to_thread(wait_healthy, broker)
        restarted.set()
        await sender
        after = await asyncio.gather(
            *(producer.send_nowait(Message(topic, f"after-{i}".encode())) for i in range(500))
        )
        acked.update(r.message_id for r in after)
    assert on_a > 0
    async with AdminClient(stack.namesrv) as admin:
        recoveries = {r.broker_name: r for r in await admin.last_recoveries()}
    assert recoveries["broker-a"].clean is False, recoveries["broker-a"].summary
    seen: set[str] = set()
    async with PullConsumer(
        stack.namesrv, "compose-kill-readers", consume_from="earliest", rebalance_interval=1.0
    ) as consumer:
        consumer.subscribe(topic)
        await consumer.start()
        deadline = time.monotonic() + DEADLINE_S
        while not acked <= seen and time.monotonic() < deadline:
            seen.update(m.unique_id for m in await consumer.poll(timeout=1.0))
    assert len(acked - seen) == 0, f"{len(acked - seen)} of {len(acked)} acknowledged lost"


def test_prometheus_scrapes_every_service(stack: ComposeStack) -> None:
    url = f"http://127.0.0.1:{stack.ports['PROMETHEUS']}/api/v1/targets"
    members: dict[str, str] = {}

    def all_up() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                targets = json.load(resp)["data"]["activeTargets"]
        except OSError:
            return False
        members.clear()
        members.update({t["labels"]["member"]: t["health"] for t in targets})
        return len(members) == len(SERVICES) and set(members.values()) == {"up"}

    try:
        wait_for("every service scraped by Prometheus", all_up, 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: targets {members}") from None
    assert set(members) == set(SERVICES)


def test_down_removes_every_container_volume_and_the_network(stack: ComposeStack) -> None:
    assert stack.down() == []
    label = f"label=io.podman.compose.project={stack.project}"
    assert podman("ps", "-a", "-q", "--filter", label) == ""
    assert podman("volume", "ls", "-q", "--filter", label) == ""
