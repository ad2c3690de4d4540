"""Logins under a hostile client, through the app's HTTP path in-process (no cluster: the
console's nameserver is an address nothing answers on): wrong passwords and access keys lock the
name out, a spray of names locks the address out, both for a bounded time the injected clock
skips; a read-only user's logins never log another user out; the session cap refuses rather
than evicts. Then the login limits and the password checks alone: back-off and its cap, what a
success forgets, attempts in flight, bounded memory, bounded threads."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_support import Clock, assert_problem, console_app

from apogee.testkit.waiting import eventually
from apogee_console.core.access import users_entry
from apogee_console.core.logins import (
    MAX_KEYS,
    Busy,
    Lockout,
    LoginLimits,
    PasswordChecks,
    Refusal,
)

pytestmark = pytest.mark.unit

#: Nothing listens there: these tests need no cluster.
NOWHERE = "127.0.0.1:1"
LOGIN = "/api/v1/session"
ALICE = {"user": "alice", "password": "alice-password"}
BOB = {"user": "bob", "password": "bob-password"}


@pytest.fixture(scope="module")
def users_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("users") / "console-users.toml"
    path.write_text(
        users_entry("alice", "alice-password", "admin")
        + users_entry("bob", "bob-password", "read")
        + users_entry("carol", "carol-password", "read")
    )
    return path


def logins(app: Any, result: str) -> float:
    value = app.state.console.metrics.registry.get_sample_value(
        "apogee_console_logins_total", {"result": result}
    )
    return value or 0.0


def from_address(app: Any, host: str) -> httpx.AsyncClient:
    """A client of ``app`` whose requests come from ``host``."""
    transport = httpx.ASGITransport(app=app, client=(host, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://console")


async def test_a_thousand_wrong_passwords_lock_the_user_out_for_a_bounded_time(
    users_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="apogee.audit")
    clock = Clock()
    async with console_app(NOWHERE, clock=clock, console_users_file=str(users_file)) as (
        app,
        client,
    ):
        statuses = [
            (await client.post(LOGIN, json={"user": "alice", "password": f"guess-{i}"})).status_code
            for i in range(1000)
        ]
        assert statuses[:5] == [401] * 5
        assert set(statuses[5:]) == {429}
        # locked: the right password is refused too, without being checked
        locked = await client.post(LOGIN, json=ALICE)
        body = assert_problem(locked, 429, "TOO_MANY_LOGINS")
        wait = int(locked.headers["Retry-After"])
        assert wait == body["retry_after"] == 60  # login_lockout_s, at most login_lockout_max_s
        assert "too many failed logins of user 'alice'" in body["detail"]
        assert "try again in 60 s" in body["detail"]
        # another user from the same address is not locked out
        assert (await client.post(LOGIN, json=BOB)).status_code == 200
        clock.now += wait - 1
        assert (await client.post(LOGIN, json=ALICE)).status_code == 429
        clock.now += 1
        ok = await client.post(LOGIN, json=ALICE)
        assert ok.status_code == 200, ok.text
        assert ok.json()["user"] == "alice"
        assert (logins(app, "refused"), logins(app, "locked"), logins(app, "ok")) == (5, 997, 2)
        registry = app.state.console.metrics.registry
        lockouts = registry.get_sample_value(
            "apogee_console_login_lockouts_total", {"side": "user"}
        )
        assert lockouts == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "apogee.audit"]
    locked_lines = [m for m in lines if "user=alice" in m and "outcome=locked" in m]
    assert len(locked_lines) == 997
    assert "from 127.0.0.1" in locked_lines[0]
    assert any("user=alice" in m and "locked out for 60 s" in m for m in lines)


async def test_a_spray_of_names_locks_the_address_out_not_the_users(users_file: Path) -> None:
    clock = Clock()
    async with console_app(
        NOWHERE, clock=clock, console_users_file=str(users_file), login_address_failures=10
    ) as (app, client):
        statuses = [
            (await client.post(LOGIN, json={"user": f"user-{i}", "password": "x"})).status_code
            for i in range(1000)
        ]
        assert statuses[:10] == [401] * 10  # each name once: only the address's limit
        assert set(statuses[10:]) == {429}
        locked = await client.post(LOGIN, json=ALICE)
        body = assert_problem(locked, 429, "TOO_MANY_LOGINS")
        assert "too many failed logins from address 127.0.0.1" in body["detail"]
        wait = int(locked.headers["Retry-After"])
        assert wait == 60
        async with from_address(app, "192.0.2.7") as elsewhere:
            assert (await elsewhere.post(LOGIN, json=ALICE)).status_code == 200
        clock.now += wait
        assert (await client.post(LOGIN, json=ALICE)).status_code == 200


async def test_wrong_secret_keys_lock_the_access_key_out(tmp_path: Path) -> None:
    users = tmp_path / "users.toml"
    users.write_text(
        '[[users]]\naccess_key = "ops"\nsecret_key = "ops-secret-0123456789"\nadmin = "write"\n'
    )
    creds = tmp_path / "credentials.toml"
    creds.write_text('access_key = "ops"\nsecret_key = "ops-secret-0123456789"\n')
    clock = Clock()
    right = {"access_key": "ops", "secret_key": "ops-secret-0123456789"}
    async with console_app(
        NOWHERE,
        clock=clock,
        auth_enabled=True,
        auth_users_file=str(users),
        auth_credentials_file=str(creds),
    ) as (_app, client):
        for _ in range(5):
            wrong = await client.post(LOGIN, json={"access_key": "ops", "secret_key": "guess"})
            assert wrong.status_code == 401
        locked = await client.post(LOGIN, json=right)
        assert_problem(locked, 429, "TOO_MANY_LOGINS")
        clock.now += int(locked.headers["Retry-After"])
        assert (await client.post(LOGIN, json=right)).status_code == 200


async def test_a_read_only_user_logging_in_again_and_again_keeps_the_admin_logged_in(
    users_file: Path,
) -> None:
    async with console_app(
        NOWHERE, console_users_file=str(users_file), sessions_per_user=2, max_sessions=3
    ) as (app, admin):
        assert (await admin.post(LOGIN, json=ALICE)).status_code == 200
        async with from_address(app, "127.0.0.1") as bob:
            first = await bob.post(LOGIN, json=BOB)
            for _ in range(4):
                assert (await bob.post(LOGIN, json=BOB)).status_code == 200
            # bob's own oldest session went, not alice's
            assert len(app.state.console.sessions) == 3
        async with from_address(app, "127.0.0.1") as stale:
            token = first.cookies["apogee_session"]
            gone = await stale.get(LOGIN, headers={"Cookie": f"apogee_session={token}"})
            assert_problem(gone, 401, "UNAUTHENTICATED")
        assert (await admin.get("/api/v1/session")).json()["user"] == "alice"
        # the cap is reached: a third user is refused, nobody is logged out
        async with from_address(app, "127.0.0.1") as carol:
            full = await carol.post(LOGIN, json={"user": "carol", "password": "carol-password"})
            body = assert_problem(full, 503, "UNAVAILABLE")
            assert "max_sessions" in body["detail"]
            assert 1 <= int(full.headers["Retry-After"]) <= 3600
        assert (await admin.get("/api/v1/session")).json()["user"] == "alice"
        assert logins(app, "full") == 1


def default_limits(clock: Clock, **changes: Any) -> LoginLimits:
    """The limits of the settings' defaults."""
    values: dict[str, Any] = {
        "user_failures": 5,
        "address_failures": 50,
        "window_s": 900.0,
        "lockout_s": 60.0,
        "lockout_max_s": 900.0,
        **changes,
    }
    return LoginLimits(clock=clock, **values)


def attempt(limits: LoginLimits, user: str, address: str, ok: bool) -> Refusal | list[Lockout]:
    refusal = limits.begin(user, address)
    return refusal if refusal is not None else limits.end(user, address, ok)


def test_lockouts_double_up_to_their_cap_and_a_quiet_window_forgets_them() -> None:
    clock = Clock()
    limits = default_limits(clock)
    lengths = []
    for round_ in range(7):
        address = f"192.0.2.{round_}"
        outcomes = [attempt(limits, "u", address, ok=False) for _ in range(5)]
        assert outcomes[:4] == [[]] * 4
        lockouts = outcomes[4]
        assert isinstance(lockouts, list)
        assert [lo.side for lo in lockouts] == ["user"]
        lengths.append(lockouts[0].seconds)
        refusal = limits.begin("u", address)
        assert refusal == Refusal("user", int(lengths[-1]), locked=True)
        clock.now += lengths[-1] - 0.5
        assert limits.begin("u", address) == Refusal("user", 1, locked=True)  # not lengthened
        clock.now += 0.5
    assert lengths == [60, 120, 240, 480, 900, 900, 900]
    clock.now += 900  # a quiet window
    outcomes = [attempt(limits, "u", "192.0.2.9", ok=False) for _ in range(5)]
    assert outcomes[4] == [Lockout("user", 60)]


def test_a_success_forgets_the_users_failures_not_the_addresss() -> None:
    clock = Clock()
    limits = default_limits(clock)
    for _ in range(4):
        assert attempt(limits, "u", "a", ok=False) == []
    assert attempt(limits, "u", "a", ok=True) == []
    for _ in range(4):
        assert attempt(limits, "u", "a", ok=False) == []
    assert attempt(limits, "u", "a", ok=False) == [Lockout("user", 60)]
    for i in range(40):  # 9 failures above: 49 from "a"
        assert attempt(limits, f"n{i}", "a", ok=False) == []
    assert attempt(limits, "v", "a", ok=True) == []
    assert attempt(limits, "w", "a", ok=False) == [Lockout("address", 60)]
    assert limits.begin("v", "a") == Refusal("address", 60, locked=True)
    clock.now += 901  # failures older than the window are forgotten
    assert attempt(limits, "w", "b", ok=False) == []


def test_attempts_in_flight_count_against_the_limit() -> None:
    limits = default_limits(Clock())
    for _ in range(5):
        assert limits.begin("u", "a") is None
    assert limits.begin("u", "a") == Refusal("user", 1, locked=False)
    assert limits.end("u", "a", None) == []  # not checked: nothing counted
    assert limits.begin("u", "a") is None


def test_spraying_names_and_addresses_keeps_the_memory_bounded() -> None:
    limits = default_limits(Clock())
    for i in range(3 * MAX_KEYS):
        attempt(limits, f"name-{i}", f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", ok=False)
    assert len(limits.users) == len(limits.addresses) == MAX_KEYS
    assert attempt(limits, "ok", "10.9.9.9", ok=True) == []


async def test_password_checks_run_off_the_loop_on_bounded_threads() -> None:
    checks = PasswordChecks(running=2, waiting=3)
    gate = threading.Event()
    lock = threading.Lock()
    now = [0]
    peak = [0]

    def check() -> int:
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        gate.wait(10)
        with lock:
            now[0] -= 1
        return threading.get_ident()

    try:
        tasks = [asyncio.ensure_future(checks.run(check)) for _ in range(5)]
        await eventually(lambda: now[0] == 2 and checks.pending == 5, what="2 checks running")
        with pytest.raises(Busy):
            await checks.run(check)
        gate.set()
        threads = set(await asyncio.gather(*tasks))
        assert threading.get_ident() not in threads
        assert (peak[0], len(threads) <= 2, checks.pending) == (2, True, 0)
        assert await checks.run(lambda: 7) == 7
    finally:
        gate.set()
        checks.close()
