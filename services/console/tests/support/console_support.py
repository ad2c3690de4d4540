"""What the console's tests share (conftest.py puts this folder on the path; mypy finds it
through its mypy_path): a local cluster of real processes (one per test module, on free ports,
in a temporary folder, always stopped), and the app driven in-process through httpx's ASGI
transport with its lifespan run (sampler started, connections closed after)."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI

from apogee.client import AdminClient
from apogee.local import cluster as local_cluster
from apogee.local.cluster import ClusterState
from apogee.rpc.security import ClientSecurity
from apogee.testkit.cluster import eventually
from apogee_console.app import create_app
from apogee_console.settings import load_settings

T = TypeVar("T")

#: Brokers of the tests: a heartbeat every second, small store files, a short grace on SIGTERM.
BROKER_ENV: Mapping[str, str] = {
    "APOGEE_BROKER_HEARTBEAT_INTERVAL_S": "1",
    "APOGEE_BROKER_REGISTER_TIMEOUT_S": "1",
    "APOGEE_BROKER_COMMITLOG_FILE_SIZE": str(4 * 1024 * 1024),
    "APOGEE_BROKER_MAX_MESSAGE_SIZE": str(1024 * 1024),
    "APOGEE_BROKER_CONSUME_QUEUE_ENTRIES_PER_FILE": "1024",
    "APOGEE_BROKER_INDEX_SLOTS": "4999",
    "APOGEE_BROKER_INDEX_ENTRIES_PER_FILE": "65536",
    "APOGEE_BROKER_SHUTDOWN_GRACE_S": "2",
    "APOGEE_BROKER_AUTO_CREATE_TOPICS": "false",
}
NAMESERVER_ENV: Mapping[str, str] = {
    "APOGEE_NAMESERVER_BROKER_EXPIRY_S": "5",
    "APOGEE_NAMESERVER_SCAN_INTERVAL_S": "0.5",
    "APOGEE_NAMESERVER_SHUTDOWN_GRACE_S": "1",
}


def in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own (``local_cluster`` runs its own event loops)."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, name="console-test-cluster")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


def start_cluster(data: Path, **options: Any) -> ClusterState:
    return in_thread(
        lambda: local_cluster.up(
            data,
            brokers=options.pop("brokers", 2),
            nameservers=1,
            timeout=90.0,
            nameserver_env={**NAMESERVER_ENV, **options.pop("nameserver_env", {})},
            broker_env={**BROKER_ENV, **options.pop("broker_env", {})},
            schedule=False,
            txn_checker=False,
            console=False,
            **options,
        )
    )


def stop_cluster(data: Path) -> None:
    in_thread(lambda: local_cluster.down(data, 20.0))


class Clock:
    """Epoch seconds the test moves by hand."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def console_app(
    namesrv: str,
    *,
    clock: Callable[[], float] = time.time,
    security: ClientSecurity | None = None,
    base_url: str = "http://console",
    **settings: Any,
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The console app on ``namesrv`` (no metrics port, sampling once an hour, reached by the
    name ``console`` unless told)."""
    values: dict[str, Any] = {
        "metrics_listen": "",
        "sample_interval_s": 3600.0,
        "allowed_hosts": "console",
        **settings,
    }
    app = create_app(
        load_settings(env={}, namesrv=namesrv, **values), clock=clock, security=security
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=base_url) as client:
            yield app, client


async def csrf_of(client: httpx.AsyncClient) -> dict[str, str]:
    """The headers an action needs: the session's CSRF token."""
    resp = await client.get("/api/v1/session")
    assert resp.status_code == 200, resp.text
    return {"X-CSRF-Token": resp.json()["csrf"]}


def assert_problem(resp: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = resp.json()
    assert body["status"] == status
    assert body["kind"] == kind == body["title"]
    assert body["type"] == f"https://apogee.dev/problems/{kind.lower()}"
    return body


async def create_topic(
    namesrv: str, name: str, queues: int = 2, security: ClientSecurity | None = None
) -> None:
    """Create ``name`` on every broker; return once the nameserver routes it to all of them."""
    async with AdminClient(namesrv, security=security) as admin:
        updates = await admin.create_or_update_topic(name, queues=queues)

        async def routed() -> bool:
            return len((await admin.describe_topic(name)).brokers) == len(updates)

        await eventually(routed, 20, f"the route of {name}")


#: Consumers of the tests: quick rebalances and commits, from the earliest message.
FAST_CONSUMER: dict[str, Any] = {
    "rebalance_interval": 1.0,
    "offset_persist_interval": 0.2,
    "long_poll_timeout": 2.0,
    "consume_from": "earliest",
}
