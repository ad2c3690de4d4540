"""Login with the console's own users file against a real local cluster: sessions and their
cookie, roles, CSRF, expiry (an injected clock), logout, audit lines and metrics."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from console_support import Clock, assert_problem, console_app, csrf_of

from apogee.local.cluster import ClusterState
from apogee_console.core.access import users_entry

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def users_file(tmp_path: Path) -> Path:
    path = tmp_path / "console-users.toml"
    path.write_text(
        users_entry("alice", "alice-password", "admin") + users_entry("bob", "bob-password", "read")
    )
    return path


async def test_login_cookie_and_whoami(cluster: ClusterState, users_file: Path) -> None:
    async with console_app(cluster.namesrv, console_users_file=str(users_file)) as (app, client):
        assert_problem(await client.get("/api/v1/topics"), 401, "UNAUTHENTICATED")
        assert_problem(await client.get("/api/v1/session"), 401, "UNAUTHENTICATED")
        # health, readiness and the pages stay open
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code == 200
        assert (await client.get("/ui/login")).status_code == 200
        wrong = await client.post("/api/v1/session", json={"user": "alice", "password": "not-it"})
        body = assert_problem(wrong, 401, "UNAUTHENTICATED")
        assert body["detail"] == "login refused: unknown user or wrong password"
        nobody = await client.post("/api/v1/session", json={"user": "eve", "password": "x"})
        assert_problem(nobody, 401, "UNAUTHENTICATED")
        half = await client.post("/api/v1/session", json={"user": "alice"})
        assert assert_problem(half, 400, "INVALID_ARGUMENT")["field"] == "password"
        keyless = await client.post("/api/v1/session", json={"access_key": "a", "secret_key": "b"})
        assert_problem(keyless, 401, "UNAUTHENTICATED")  # the cluster's auth is off

        ok = await client.post(
            "/api/v1/session", json={"user": "alice", "password": "alice-password"}
        )
        assert ok.status_code == 200, ok.text
        me = ok.json()
        assert (me["user"], me["role"], me["auth"], me["via"]) == (
            "alice", "admin", True, "password",
        )  # fmt: skip
        cookie = ok.headers["set-cookie"]
        assert cookie.startswith("apogee_session=")
        for flag in ("HttpOnly", "SameSite=strict", "Path=/", "Max-Age=3600"):
            assert flag in cookie
        assert "Secure" not in cookie  # plain HTTP here
        again = (await client.get("/api/v1/session")).json()
        assert again == me  # the same csrf, no new one
        assert (await client.get("/api/v1/topics")).status_code == 200
        registry = app.state.console.metrics.registry
        assert registry.get_sample_value("apogee_console_logins_total", {"result": "ok"}) == 1
        assert registry.get_sample_value("apogee_console_logins_total", {"result": "refused"}) == 3

        out = await client.delete("/api/v1/session", headers={"X-CSRF-Token": me["csrf"]})
        assert out.json() == {"logged_out": True}
        assert_problem(await client.get("/api/v1/topics"), 401, "UNAUTHENTICATED")


async def test_roles_csrf_and_audit(
    cluster: ClusterState, users_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="apogee.audit")
    async with console_app(cluster.namesrv, console_users_file=str(users_file)) as (_app, client):
        await client.post("/api/v1/session", json={"user": "bob", "password": "bob-password"})
        h = await csrf_of(client)
        assert (await client.get("/api/v1/cluster")).status_code == 200
        refused = assert_problem(
            await client.post("/api/v1/topics", json={"name": "ByBob"}, headers=h),
            403,
            "PERMISSION_DENIED",
        )
        assert (
            refused["detail"] == "user 'bob' has role read; role admin is needed to create a topic"
        )
        assert_problem(
            await client.post("/api/v1/topics", json={"name": "ByBob"}), 403, "CSRF"
        )  # no header: CSRF is checked first
        await client.delete("/api/v1/session", headers=h)

        await client.post("/api/v1/session", json={"user": "alice", "password": "alice-password"})
        assert_problem(
            await client.post("/api/v1/topics", json={"name": "ByAlice"}, headers=h), 403, "CSRF"
        )  # bob's token is not alice's
        h = await csrf_of(client)
        made = await client.post("/api/v1/topics", json={"name": "ByAlice"}, headers=h)
        assert made.status_code == 201, made.text
        system = await client.post("/api/v1/topics", json={"name": "TBW102"}, headers=h)
        assert_problem(system, 403, "PERMISSION_DENIED")
    lines = [r.getMessage() for r in caplog.records if r.name == "apogee.audit"]
    assert any(
        "user=bob role=read" in m and "action=create a topic" in m and "refused" in m for m in lines
    )
    assert any(
        "user=alice" in m and "action=create topic target=ByAlice outcome=ok" in m for m in lines
    )
    assert any(
        "user=alice" in m and "target=TBW102 outcome=failed PERMISSION_DENIED" in m for m in lines
    )
    assert any("user=alice" in m and "action=log in" in m for m in lines)


async def test_a_session_expires(cluster: ClusterState, users_file: Path) -> None:
    clock = Clock()
    async with console_app(
        cluster.namesrv, clock=clock, console_users_file=str(users_file), session_ttl_s=60
    ) as (app, client):
        me = (
            await client.post("/api/v1/session", json={"user": "bob", "password": "bob-password"})
        ).json()
        assert me["expires_at"] == pytest.approx(clock.now + 60)
        clock.now += 59
        assert (await client.get("/api/v1/groups")).status_code == 200
        clock.now += 2
        expired = assert_problem(await client.get("/api/v1/groups"), 401, "UNAUTHENTICATED")
        assert "expired" in expired["detail"]
        registry = app.state.console.metrics.registry
        assert (
            registry.get_sample_value("apogee_console_refusals_total", {"reason": "expired"}) == 1
        )
