"""What an operator does from Kubernetes, with the real ``kubectl`` (its discovery, OpenAPI
v3 validation, client-side apply, Tables and describe) against the in-test stand-in for the API
server (``apogee.testkit.apiserver``: not a real Kubernetes API server) serving the chart's
CRDs, and Apogee's operator reconciling the resources against an Apogee cluster in this
process: a nameserver and a replica group ``broker-a`` of two replicas whose record and leader
are in the Lease ``apogee-replicas-broker-a`` on that same stand-in.

- ``kubectl apply -f`` of a Topic and a ConsumerGroup, then ``kubectl get`` shows them with
  their printer columns and Ready, and the topic is on the brokers;
- ``kubectl describe topic`` prints its spec and status;
- ``kubectl apply`` of a changed manifest changes the topic's queues on the brokers;
- a manifest that breaks the CRD's schema is refused, naming the field, and nothing is made;
- ``kubectl get leases`` shows the group's Lease with its leader as holder (and the operator's),
  and ``kubectl describe lease`` its record: epoch and in-sync set.

One API server, one Apogee cluster and one operator for the module; each test has resources of
its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from apogee.client.admin import AdminClient
from apogee.common.errors import UnknownTopicError
from apogee.service.lease import lease_leadership
from apogee.service.lease_group import (
    RECORD_ANNOTATION,
    KubeLeaseCoordination,
    group_lease_name,
)
from apogee.service.replica_group import GroupRecord
from apogee.testkit.apiserver import FakeApiServer
from apogee.testkit.broker import small_settings
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.waiting import eventually
from apogee_broker.replication.node import ReplicaNode, replica_id_of
from apogee_operator.app import OperatorApp
from apogee_operator.settings import OperatorSettings

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
]

CRDS = Path(__file__).resolve().parents[1] / "charts" / "apogee" / "crds"
NS = "apogee"
LEASE_PREFIX = "apogee-replicas"
BROKER = "broker-a"
#: how long one kubectl command may take
KUBECTL_TIMEOUT_S = 60.0


@dataclass
class Ran:
    rc: int
    out: str
    err: str


class Env:
    """The stand-in API server, the Apogee cluster (nameserver and replica group), the operator,
    and ``kubectl`` with a kubeconfig for the stand-in whose namespace is :data:`NS`."""

    def __init__(self, api: FakeApiServer, root: Path, namesrv: str) -> None:
        kubectl = shutil.which("kubectl")
        assert kubectl is not None, "kubectl is not on PATH"
        self.kubectl_path = kubectl
        self.api = api
        self.root = root
        self.kubeconfig = api.kubeconfig(root / "kubeconfig", namespace=NS)
        self.namesrv = namesrv
        self.admin = AdminClient(namesrv)
        self.nodes: list[ReplicaNode] = []

    async def kubectl(self, *args: str) -> Ran:
        """``kubectl --kubeconfig <file> <args>`` run in the module's folder, cut after
        :data:`KUBECTL_TIMEOUT_S`."""
        proc = await asyncio.create_subprocess_exec(
            self.kubectl_path,
            "--kubeconfig",
            str(self.kubeconfig),
            "--cache-dir",
            str(self.root / "kube-cache"),
            *args,
            cwd=self.root,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "HOME": str(self.root)},
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), KUBECTL_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(
                f"kubectl {' '.join(args)}: no answer in {KUBECTL_TIMEOUT_S}s"
            ) from None
        assert proc.returncode is not None
        return Ran(proc.returncode, out.decode(), err.decode())

    async def ok(self, *args: str) -> str:
        ran = await self.kubectl(*args)
        assert ran.rc == 0, f"kubectl {' '.join(args)}: {ran.rc}\n{ran.out}\n{ran.err}"
        return ran.out

    def manifest(self, file: str, doc: dict[str, Any]) -> str:
        (self.root / file).write_text(yaml.safe_dump(doc, sort_keys=False))
        return file

    async def get(self, plural: str) -> dict[str, dict[str, str]]:
        """``kubectl get <plural>`` as {NAME: {COLUMN: cell}}."""
        return table(await self.ok("get", plural))

    async def row_when(self, plural: str, name: str, **cells: str) -> dict[str, str]:
        """The row of ``name`` in ``kubectl get <plural>`` once it shows ``cells``."""
        last: dict[str, dict[str, str]] = {}

        async def shown() -> bool:
            nonlocal last
            last = await self.get(plural)
            row = last.get(name, {})
            return all(row.get(column) == value for column, value in cells.items())

        try:
            await eventually(shown, 20, f"kubectl get {plural}: {name} with {cells}", every=0.2)
        except AssertionError as err:
            raise AssertionError(f"{err}; last seen: {last}") from None
        return last[name]

    async def queues(self, topic: str) -> dict[str, int]:
        """Broker name -> read queues of ``topic`` at the brokers ({} when none has it)."""
        try:
            described = await self.admin.describe_topic(topic)
        except UnknownTopicError:
            return {}
        return {b.broker_name: b.topic.read_queues for b in described.brokers}

    def leader(self) -> ReplicaNode | None:
        for node in self.nodes:
            if node.leader is not None and not node.leader.ended:
                return node
        return None


def table(text: str) -> dict[str, dict[str, str]]:
    """kubectl's human-readable table: the cells cut at the columns of the header line."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "an empty table"
    header = lines[0]
    starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", header)]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    rows: dict[str, dict[str, str]] = {}
    for line in lines[1:]:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        rows[cells[0]] = dict(zip(names, cells, strict=True))
    return rows


def crds() -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted(CRDS.glob("*.yaml"))]


def topic(object_name: str, /, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apogee.io/v1alpha1",
        "kind": "Topic",
        "metadata": {"name": object_name},
        "spec": spec,
    }


def operator(api: FakeApiServer, namesrv: str) -> OperatorApp:
    settings = OperatorSettings(
        namesrv=namesrv,
        listen="127.0.0.1:0",
        metrics_listen="",
        watch_namespace=NS,
        resync_s=0.5,
        retry_s=0.1,
        watch_timeout_s=5.0,
        kube_timeout_s=2.0,
        rpc_timeout_s=2.0,
        lease_namespace=NS,
        lease_duration_s=2,
        lease_renew_deadline_s=1.0,
        lease_retry_period_s=0.2,
        shutdown_grace_s=1.0,
    )
    lead = lease_leadership(
        NS,
        settings.lease_name,
        "operator-0",
        settings.lease_duration_s,
        settings.lease_renew_deadline_s,
        settings.lease_retry_period_s,
        api_client_factory=api.api_client,
    )
    return OperatorApp(settings, leadership=lead, api_client_factory=api.api_client)


async def start_replica(env: Env, i: int, api_client: Any) -> None:
    data_dir = env.root / f"replica-{i}"
    settings = small_settings(
        data_dir,
        broker_name=BROKER,
        namesrv=env.namesrv,
        shutdown_grace_s=0.5,
        # how a broker started on its own finds its coordination; here it is passed in
        replication="file",
        replica_group_dir=env.root / "unused",
        replica_lag_max_s=2.0,
        replication_timeout_s=3.0,
    )
    coordination = KubeLeaseCoordination(
        api_client,
        NS,
        group_lease_name(LEASE_PREFIX, BROKER),
        replica_id_of(data_dir),  # the id the replica reads from its data directory
        lease_s=3.0,
        timeout_s=1.0,
    )
    node = ReplicaNode(settings, coordination=coordination)
    await node.start()
    env.nodes.append(node)


@pytest.fixture(scope="module")
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer(crds()) as server:
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(api: FakeApiServer, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    root = tmp_path_factory.mktemp("kubectl")
    api_client = api.api_client()
    async with InProcessCluster(root / "ns", nameservers=1, brokers=()) as cluster:
        environment = Env(api, root, cluster.namesrv)
        app = operator(api, cluster.namesrv)
        try:
            for i in range(2):
                await start_replica(environment, i, api_client)

            async def led() -> bool:
                lead = environment.leader()
                return (
                    lead is not None and lead.leader is not None and len(lead.leader.in_sync) == 2
                )

            await eventually(led, 20, "a leader of broker-a with both replicas in sync")
            await app.start()
            await asyncio.wait_for(app.wait_active(), 10)
            yield environment
        finally:
            await app.stop()
            lead = environment.leader()  # the follower first: the leader has nobody to hand to
            for node in sorted(environment.nodes, key=lambda n: n is lead):
                await node.stop()
            await environment.admin.close()
            await asyncio.to_thread(api_client.close)


async def test_applied_topic_and_group_are_listed_ready_and_the_topic_is_on_the_brokers(
    env: Env,
) -> None:
    applied = await env.ok(
        "apply",
        "-f",
        env.manifest("topic.yaml", topic("orders", name="Orders", queues=4, messageType="FIFO")),
    )
    assert applied.strip() == "topic.apogee.io/orders created"
    row = await env.row_when("topics", "orders", READY="True")
    assert row == {
        "NAME": "orders",
        "TOPIC": "Orders",
        "QUEUES": "4",
        "PERM": "rw",
        "TYPE": "FIFO",
        "READY": "True",
        "REASON": "Synced",
        "AGE": row["AGE"],
    }
    assert re.fullmatch(r"\d+s", row["AGE"]), row
    assert await env.queues("Orders") == {BROKER: 4}

    group = {
        "apiVersion": "apogee.io/v1alpha1",
        "kind": "ConsumerGroup",
        "metadata": {"name": "billing"},
        "spec": {"name": "billing", "topics": ["Orders"], "consumeFrom": "earliest"},
    }
    applied = await env.ok("apply", "-f", env.manifest("group.yaml", group))
    assert applied.strip() == "consumergroup.apogee.io/billing created"
    row = await env.row_when("consumergroups", "billing", READY="True")
    assert (row["GROUP"], row["MEMBERS"], row["REASON"]) == ("billing", "0", "Synced"), row
    # the CRDs' category lists both
    both = await env.ok("get", "apogee")
    assert re.search(r"^consumergroup\.apogee\.io/billing\s+billing\s+0\s+True", both, re.M), both
    assert re.search(r"^topic\.apogee\.io/orders\s+Orders\s+4\s+rw\s+FIFO\s+True", both, re.M), both


async def test_describe_prints_the_topics_spec_and_status(env: Env) -> None:
    await env.ok("apply", "-f", env.manifest("audit.yaml", topic("audit", perm="r")))
    await env.row_when("topics", "audit", READY="True")
    described = await env.ok("describe", "topic", "audit")
    for line in (
        r"Name:\s+audit",
        r"Namespace:\s+apogee",
        r"Kind:\s+Topic",
        r"Spec:",
        r"  Deletion Policy:\s+orphan",  # defaults filled in by the CRD's schema
        r"  Message Type:\s+MIXED",
        r"  Perm:\s+r",
        r"  Queues:\s+8",
        r"Status:",
        r"  Brokers:\n\s+broker-a",
        r"  Observed Generation:\s+1",
        r"  Topic Name:\s+audit",
        r"    Reason:\s+Synced",
        r"    Status:\s+True",
        r"    Type:\s+Ready",
        r"Events:\s+<none>",
    ):
        assert re.search(line, described), f"{line!r} not in:\n{described}"


async def test_applying_a_changed_manifest_changes_the_topic_on_the_brokers(env: Env) -> None:
    file = env.manifest("payments.yaml", topic("payments", name="Payments", queues=2))
    await env.ok("apply", "-f", file)
    await env.row_when("topics", "payments", READY="True", QUEUES="2")
    assert await env.queues("Payments") == {BROKER: 2}

    file = env.manifest("payments.yaml", topic("payments", name="Payments", queues=6))
    assert (await env.ok("apply", "-f", file)).strip() == "topic.apogee.io/payments configured"
    await env.row_when("topics", "payments", READY="True", QUEUES="6")

    async def six() -> bool:
        return await env.queues("Payments") == {BROKER: 6}

    await eventually(six, 20, "Payments with 6 queues at the brokers")
    generation = await env.ok(
        "get", "topic", "payments", "-o", "jsonpath={.status.observedGeneration}"
    )
    assert generation == "2"
    assert (await env.ok("apply", "-f", file)).strip() == "topic.apogee.io/payments unchanged"


async def test_a_manifest_breaking_the_schema_is_refused_naming_the_field(env: Env) -> None:
    bad = env.manifest("broken.yaml", topic("broken", queues=0, perm="rw+"))
    ran = await env.kubectl("apply", "-f", bad)
    assert ran.rc != 0
    assert 'The Topic "broken" is invalid' in ran.err, ran.err
    assert (
        "spec.queues: Invalid value: 0: spec.queues in body should be greater than or "
        "equal to 1" in ran.err
    ), ran.err
    assert 'spec.perm: Unsupported value: "rw+"' in ran.err, ran.err

    unknown = env.manifest("unknown.yaml", topic("broken", partitions=3))
    ran = await env.kubectl("apply", "-f", unknown)
    assert ran.rc != 0
    assert 'strict decoding error: unknown field "spec.partitions"' in ran.err, ran.err

    ran = await env.kubectl("get", "topic", "broken")
    assert ran.rc != 0
    assert 'topics.apogee.io "broken" not found' in ran.err, ran.err
    assert await env.queues("broken") == {}


async def test_leases_show_the_replica_groups_leader_and_record(env: Env) -> None:
    lead = env.leader()
    assert lead is not None
    name = group_lease_name(LEASE_PREFIX, BROKER)
    leases = await env.get("leases")
    assert leases[name]["HOLDER"] == lead.replica_id, leases
    assert leases["apogee-operator"]["HOLDER"] == "operator-0", leases
    assert set(leases) == {name, "apogee-operator"}

    raw = await env.ok("get", "lease", name, "-o", "jsonpath={.metadata.annotations}")
    record = GroupRecord.from_json(json.loads(raw)[RECORD_ANNOTATION], name)
    assert record.leader == lead.replica_id
    assert set(record.in_sync) == {n.replica_id for n in env.nodes}

    described = await env.ok("describe", "lease", name)
    assert re.search(rf"Holder Identity:\s+{lead.replica_id}", described), described
    # describe shows the annotation (cut at 140 characters, as kubectl does)
    shown = re.search(rf"Annotations:\s+{re.escape(RECORD_ANNOTATION)}:\s+(.*)", described)
    assert shown is not None, described
    assert f'"epoch": {record.epoch}' in shown[1], shown[1]
    assert f'"in_sync": {json.dumps(list(record.in_sync))}' in shown[1], shown[1]
