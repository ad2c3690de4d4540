"""The console in front of a cluster with TLS and authentication on: it calls the cluster over
TLS, signed with its own credentials, and visitors log in with an access key of the cluster's
users file (admin "write": role admin; anything else: role read)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from console_support import (
    NAMESERVER_ENV,
    assert_problem,
    console_app,
    csrf_of,
    start_cluster,
    stop_cluster,
)

from apogee.local.cluster import ClusterState
from apogee.testkit.tls import TestCa

pytestmark = [pytest.mark.integration, pytest.mark.slow]

USERS = """
[[users]]
access_key = "apogee-service"
secret_key = "service-secret-0123456789"
service = true

[[users]]
access_key = "ops"
secret_key = "ops-secret-0123456789"
admin = "write"

[[users]]
access_key = "viewer"
secret_key = "viewer-secret-0123456789"
admin = "read"
"""


@dataclass
class Secure:
    state: ClusterState
    root: Path
    ca: TestCa
    users: Path
    creds: Path


def _env(
    prefix: str, root: Path, ca: TestCa, name: str, users: Path, creds: Path
) -> dict[str, str]:
    cert = ca.issue(name, root / "pki", client=True)
    p = f"APOGEE_{prefix}_"
    return {
        f"{p}TLS_CERT_FILE": str(cert.cert_file),
        f"{p}TLS_KEY_FILE": str(cert.key_file),
        f"{p}TLS_CA_FILE": str(ca.cert_file),
        f"{p}AUTH_ENABLED": "true",
        f"{p}AUTH_USERS_FILE": str(users),
        f"{p}AUTH_CREDENTIALS_FILE": str(creds),
    }


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    root = tmp_path_factory.mktemp("secure")
    ca = TestCa.create(root / "pki")
    users = root / "users.toml"
    users.write_text(USERS)
    creds = root / "service.toml"
    creds.write_text('access_key = "apogee-service"\nsecret_key = "service-secret-0123456789"\n')
    creds.chmod(0o600)
    # what local_cluster's own waits read from the environment
    saved = {k: os.environ.get(k) for k in ("APOGEE_TLS_CA_FILE", "APOGEE_CREDENTIALS_FILE")}
    os.environ["APOGEE_TLS_CA_FILE"] = str(ca.cert_file)
    os.environ["APOGEE_CREDENTIALS_FILE"] = str(creds)
    data = root / "cluster"
    try:
        state = start_cluster(
            data,
            nameserver_env={**NAMESERVER_ENV, **_env("NAMESERVER", root, ca, "ns", users, creds)},
            broker_env=_env("BROKER", root, ca, "broker", users, creds),
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield Secure(state, root, ca, users, creds)
    finally:
        stop_cluster(data)


async def test_access_key_login_against_a_tls_and_auth_cluster(secure: Secure) -> None:
    console_cert = secure.ca.issue("console", secure.root / "console")
    settings: dict[str, Any] = {
        "tls_cert_file": str(console_cert.cert_file),
        "tls_key_file": str(console_cert.key_file),
        "tls_ca_file": str(secure.ca.cert_file),
        "auth_enabled": True,
        "auth_users_file": str(secure.users),
        "auth_credentials_file": str(secure.creds),
    }
    async with console_app(secure.state.namesrv, base_url="https://console", **settings) as (
        _app,
        client,
    ):
        assert (await client.get("/readyz")).status_code == 200
        assert_problem(await client.get("/api/v1/cluster"), 401, "UNAUTHENTICATED")
        wrong = await client.post(
            "/api/v1/session", json={"access_key": "ops", "secret_key": "viewer-secret-0123456789"}
        )
        assert_problem(wrong, 401, "UNAUTHENTICATED")
        viewer = await client.post(
            "/api/v1/session",
            json={"access_key": "viewer", "secret_key": "viewer-secret-0123456789"},
        )
        assert viewer.status_code == 200, viewer.text
        assert (viewer.json()["user"], viewer.json()["role"]) == ("viewer", "read")
        assert "Secure" in viewer.headers["set-cookie"]  # served over HTTPS
        cluster = (await client.get("/api/v1/cluster")).json()
        assert cluster["auth"] is True
        assert [b["ok"] for b in cluster["brokers"]] == [True, True]
        h = await csrf_of(client)
        assert_problem(
            await client.post("/api/v1/topics", json={"name": "Secured"}, headers=h),
            403,
            "PERMISSION_DENIED",
        )
        await client.delete("/api/v1/session", headers=h)

        ops = await client.post(
            "/api/v1/session", json={"access_key": "ops", "secret_key": "ops-secret-0123456789"}
        )
        assert (ops.json()["user"], ops.json()["role"], ops.json()["via"]) == (
            "ops", "admin", "access_key",
        )  # fmt: skip
        h = await csrf_of(client)
        made = await client.post("/api/v1/topics", json={"name": "Secured", "queues": 1}, headers=h)
        assert made.status_code == 201, made.text
        sent = await client.post(
            "/api/v1/messages", json={"topic": "Secured", "body": "over TLS"}, headers=h
        )
        assert sent.status_code == 201, sent.text
        got = (await client.get(f"/api/v1/messages/{sent.json()['id']}")).json()
        assert got["body"]["preview"] == "over TLS"


async def test_without_the_consoles_credentials_the_cluster_refuses(secure: Secure) -> None:
    async with console_app(
        secure.state.namesrv,
        tls_cert_file=str(secure.ca.issue("c2", secure.root / "c2").cert_file),
        tls_key_file=str(secure.root / "c2" / "c2.key"),
        tls_ca_file=str(secure.ca.cert_file),
    ) as (_app, client):
        # open console (no login), but its calls are unsigned: the cluster's sentence comes back
        body = assert_problem(await client.get("/api/v1/topics"), 401, "UNAUTHENTICATED")
        assert body["detail"]
