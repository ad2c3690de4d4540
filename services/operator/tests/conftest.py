"""A broker cluster in this process (apogee.testkit.cluster), the stand-in API server serving the
chart's CRDs (apogee.testkit.apiserver: not a real Kubernetes API server), and the operator
reconciling the one against the other, leading by a Lease on that same stand-in."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from apogee.client.admin import AdminClient
from apogee.common.errors import UnknownTopicError
from apogee.service.lease import lease_leadership
from apogee.testkit.apiserver import FakeApiServer
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.waiting import eventually
from apogee_operator.app import OperatorApp
from apogee_operator.settings import OperatorSettings

CRDS = Path(__file__).resolve().parents[3] / "charts" / "apogee" / "crds"
NS = "apogee"
GROUP, VERSION = "apogee.io", "v1alpha1"


def crds() -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted(CRDS.glob("*.yaml"))]


async def poll(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``check`` (sync or async) every 50 ms until it returns something true; that."""
    last: list[Any] = [None]

    async def holds() -> bool:
        value = check()
        last[0] = await value if inspect.isawaitable(value) else value
        return bool(last[0])

    await eventually(holds, timeout, what, every=0.05)
    return last[0]


class Env:
    """What a test drives: the cluster, the stand-in API server, the operator, an admin client
    of the cluster and the kubernetes client's CustomObjectsApi of the stand-in."""

    ns = NS

    def __init__(self, cluster: InProcessCluster, api: FakeApiServer, app: OperatorApp) -> None:
        self.cluster = cluster
        self.api = api
        self.app = app
        self.admin = AdminClient(cluster.namesrv)
        self.objects = client.CustomObjectsApi(api.api_client())

    async def create(self, plural: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        kind = "Topic" if plural == "topics" else "ConsumerGroup"
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": kind,
            "metadata": {"name": name},
            "spec": spec,
        }
        result: Any = await asyncio.to_thread(
            self.objects.create_namespaced_custom_object, GROUP, VERSION, NS, plural, body
        )
        return dict(result)

    async def patch_spec(self, plural: str, name: str, spec: dict[str, Any]) -> None:
        await asyncio.to_thread(
            self.objects.patch_namespaced_custom_object,
            GROUP,
            VERSION,
            NS,
            plural,
            name,
            {"spec": spec},
        )

    async def delete(self, plural: str, name: str) -> None:
        await asyncio.to_thread(
            self.objects.delete_namespaced_custom_object, GROUP, VERSION, NS, plural, name
        )

    async def until(self, check: Callable[[], Any], timeout: float, what: str) -> Any:
        return await poll(check, timeout, what)

    def get(self, plural: str, name: str) -> dict[str, Any] | None:
        return self.api.get(plural, NS, name)

    def ready(self, plural: str, name: str) -> dict[str, Any] | None:
        """The Ready condition of the object's status, when it describes its generation."""
        obj = self.get(plural, name)
        if obj is None:
            return None
        status = obj.get("status") or {}
        if status.get("observedGeneration") != obj["metadata"].get("generation"):
            return None
        return next((c for c in status.get("conditions", []) if c["type"] == "Ready"), None)

    async def wait_ready(
        self, plural: str, name: str, status: str = "True", timeout: float = 10.0
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            cond = self.ready(plural, name)
            return cond if cond is not None and cond["status"] == status else None

        try:
            cond: dict[str, Any] = await poll(check, timeout, f"{plural}/{name} Ready={status}")
        except AssertionError as err:
            raise AssertionError(f"{err}; the object: {self.get(plural, name)}") from None
        return cond

    async def queues(self, topic: str) -> dict[str, int]:
        """Broker name -> read queues of ``topic`` ({} when no broker has it)."""
        try:
            described = await self.admin.describe_topic(topic)
        except UnknownTopicError:
            return {}
        return {b.broker_name: b.topic.read_queues for b in described.brokers}


def operator_settings(namesrv: str) -> OperatorSettings:
    return OperatorSettings(
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


def new_operator(api: FakeApiServer, namesrv: str, identity: str) -> OperatorApp:
    settings = operator_settings(namesrv)
    lead = lease_leadership(
        NS,
        settings.lease_name,
        identity,
        settings.lease_duration_s,
        settings.lease_renew_deadline_s,
        settings.lease_retry_period_s,
        api_client_factory=api.api_client,
    )
    return OperatorApp(settings, leadership=lead, api_client_factory=api.api_client)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    with FakeApiServer(crds()) as api:
        async with InProcessCluster(tmp_path, nameservers=1) as cluster:
            app = new_operator(api, cluster.namesrv, "operator-0")
            await app.start()
            environment = Env(cluster, api, app)
            try:
                await asyncio.wait_for(app.wait_active(), 10)
                yield environment
            finally:
                await app.stop()
                await environment.admin.close()
