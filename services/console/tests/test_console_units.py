"""Unit tests of the console's pieces that need no cluster: body previews and trace ids, a
group's view, the users file and sessions, settings, the error mapping, the Prometheus source,
the passwd tool and the configuration reference."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_support import Clock, assert_problem, console_app

from apogee.client import AdminClient
from apogee.client.admin import BrokerInfo, GroupDescription, OfficialClientInfo, QueueLag
from apogee.common.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    TransactionDecidedError,
    UnauthenticatedError,
    UnavailableError,
    UnknownTopicError,
)
from apogee_console.core.access import (
    MAX_SESSIONS,
    SESSIONS_PER_USER,
    ConsoleUsers,
    ScryptHash,
    SessionsFull,
    SessionStore,
    hash_password,
    legacy_sha256,
    parse_users,
    users_entry,
)
from apogee_console.core.cluster import CachedAdminClient
from apogee_console.core.prometheus import PrometheusSource, topic_rate_query
from apogee_console.core.sampling import WINDOW_S, Series
from apogee_console.core.views import PREVIEW_BYTES, body_view, group_view, trace_id
from apogee_console.problems import status_of
from apogee_console.settings import config_reference, load_settings

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_body_preview_kinds_and_cap() -> None:
    assert body_view(b"plain") == {
        "kind": "text", "preview": "plain", "size": 5, "truncated": False,
    }  # fmt: skip
    assert body_view(b'[1, {"a": null}]')["preview"] == '[\n  1,\n  {\n    "a": null\n  }\n]'
    assert body_view(b"{not json")["kind"] == "text"
    assert body_view(b"\xff\x00") == {
        "kind": "binary", "preview": "ff 00", "size": 2, "truncated": False,
    }  # fmt: skip
    assert body_view(b"a\x00b")["kind"] == "binary"  # control characters are not text
    big = "é" * PREVIEW_BYTES  # two bytes each: the cap cuts one in half
    cut = body_view(big.encode())
    assert (cut["kind"], cut["truncated"], cut["size"]) == ("text", True, 2 * PREVIEW_BYTES)
    assert cut["preview"] == "é" * (PREVIEW_BYTES // 2)
    large_json = json.dumps(list(range(PREVIEW_BYTES))).encode()
    assert body_view(large_json)["kind"] == "text"  # cut JSON is shown as text
    assert body_view(bytes(range(256)) * 300)["preview"].count(" ") == PREVIEW_BYTES - 1


def test_trace_id_of_traceparent() -> None:
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert trace_id({"traceparent": tp}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id({}) is None
    assert trace_id({"traceparent": "garbage"}) is None
    assert trace_id({"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}) is None


def test_group_view_of_a_pop_group_has_its_clients_and_messages_in_flight() -> None:
    pop = GroupDescription(
        group="pay",
        members=(),
        queues=(
            QueueLag("broker-a", "Pay", 0, 9, 4, 5, 1.0, None, in_flight=3, invisible=2),
            QueueLag("broker-b", "Pay", 0, 2, 2, 0, 0.0, None),
        ),
        warnings=(),
        consumption="POP",
        clients=(
            OfficialClientInfo("c1@1", "JAVA", "5.0.7", "PUSH_CONSUMER", "10.0.0.7", "broker-a"),
            OfficialClientInfo("c2@1", "GOLANG", "", "", "", "broker-b"),
        ),
    )
    view = group_view(pop)
    assert (view["consumption"], view["in_flight"], view["invisible"]) == ("POP", 3, 2)
    assert view["clients"] == [
        {
            "client_id": "c1@1",
            "language": "JAVA",
            "version": "5.0.7",
            "client_type": "PUSH_CONSUMER",
            "host": "10.0.0.7",
            "broker": "broker-a",
        },
        {
            "client_id": "c2@1",
            "language": "GOLANG",
            "version": None,
            "client_type": None,
            "host": None,
            "broker": "broker-b",
        },
    ]
    assert [(q["broker"], q["in_flight"], q["invisible"]) for q in view["queues"]] == [
        ("broker-a", 3, 2),
        ("broker-b", 0, 0),
    ]
    unknown = group_view(GroupDescription("new", (), (), ()))
    assert (unknown["consumption"], unknown["clients"], unknown["in_flight"]) == (None, [], 0)


def test_users_file_parse_and_verify(tmp_path: Path) -> None:
    entry = users_entry("ann", "s3cret", "admin")
    # scrypt, its parameters and salt recorded: n=16384, r=8 (16 MiB a check), p=1
    stored = parse_users(entry, "f")["ann"].password
    assert stored is not None
    assert (stored.n, stored.r, stored.p, len(stored.salt), len(stored.key)) == (
        16384,
        8,
        1,
        16,
        32,
    )
    line = entry.splitlines()[2]
    assert re.fullmatch(r'password = "scrypt\$n=16384,r=8,p=1\$[\w+/]{22}==\$[\w+/]{43}="', line)
    assert ScryptHash.parse(line.split('"')[1], "password") == stored
    assert "sha256" not in entry
    assert "salt" not in entry
    assert hash_password("s3cret") != hash_password("s3cret")  # a new salt each time
    path = tmp_path / "users.toml"
    path.write_text(entry)
    clock = Clock()
    users = ConsoleUsers(path, clock=clock)
    assert users.verify("ann", "s3cret") == "admin"
    assert users.verify("ann", "wrong") is None
    assert users.verify("nobody", "s3cret") is None
    # reloaded when it changes (looked at once a second at most)
    path.write_text(entry + users_entry("ben", "pw", "read"))
    assert users.verify("ben", "pw") is None
    clock.now += 1.5
    assert users.verify("ben", "pw") == "read"
    # a broken change keeps the users loaded before
    path.write_text("[[users]]\nname = 1\n")
    clock.now += 1.5
    assert users.verify("ben", "pw") == "read"
    assert users.reloads == 1


def test_users_file_of_the_older_form_still_logs_in_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def old(name: str, password: str) -> str:
        salt = "4f1c9a"
        return (
            f'[[users]]\nname = "{name}"\nsalt = "{salt}"\n'
            f'password_sha256 = "{legacy_sha256(salt, password)}"\nrole = "read"\n'
        )

    path = tmp_path / "users.toml"
    path.write_text(old("ann", "s3cret") + users_entry("ben", "pw", "admin"))
    before = path.read_bytes()
    clock = Clock()
    users = ConsoleUsers(path, clock=clock)
    assert users.verify("ann", "s3cret") == "read"
    assert users.verify("ann", "wrong") is None
    assert users.verify("ben", "pw") == "admin"
    path.write_text(old("ann", "s3cret") + old("cid", "x"))
    clock.now += 1.5
    assert users.verify("cid", "x") == "read"
    assert users.verify("ann", "s3cret") == "read"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2  # once per user of the older form, reloads or not
    assert "user 'ann' has the older password form" in warnings[0]
    assert "python -m apogee_console.passwd ann --role read" in warnings[0]
    assert "'cid'" in warnings[1]
    path.write_text(before.decode())
    clock.now += 1.5
    users.verify("ann", "s3cret")
    assert path.read_bytes() == before  # the console never rewrites it


def test_every_password_check_costs_one_scrypt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "users.toml"
    salt = "ab"
    path.write_text(
        users_entry("ann", "s3cret", "admin")
        + f'[[users]]\nname = "old"\nsalt = "{salt}"\n'
        + f'password_sha256 = "{legacy_sha256(salt, "pw")}"\n'
    )
    users = ConsoleUsers(path)
    costs: list[tuple[int, int, int]] = []
    real = hashlib.scrypt

    def counted(password: bytes, **kw: Any) -> bytes:
        costs.append((kw["n"], kw["r"], kw["p"]))
        return real(password, **kw)

    monkeypatch.setattr(hashlib, "scrypt", counted)
    for name, password in (("ann", "s3cret"), ("ann", "no"), ("nobody", "no"), ("old", "pw")):
        costs.clear()
        users.verify(name, password)
        assert costs == [(16384, 8, 1)], name


#: A key of 33 bytes, in base64.
KEY = "A" * 44


def _pw(password: str) -> str:
    """A users file of one user with ``password``."""
    return f"[[users]]\nname = 'a'\npassword = '{password}'\n"


@pytest.mark.parametrize(
    ("text", "field", "rule"),
    [
        ("[[users]]\nname = 'a'\nsalt = 's'\npassword_sha256 = 'xyz'\n", "password_sha256",
         "64 hex digits"),
        ("[[users]]\nname = 'a'\nsalt = 's'\n", "password_sha256", "non-empty string"),
        ("[[users]]\nname = 'a'\nsalt = 's'\npassword_sha256 = '" + "0" * 64 + "'\nrole = 'root'\n",
         "role", "not read or admin"),
        ("[[users]]\nnom = 'a'\n", "nom", "not a users setting"),
        ("users = 3\n", "users", "array of tables"),
        ("not toml [", "f.toml", "not TOML"),
        ("[[users]]\nname = 'a'\n", "users[0].password", "python -m apogee_console.passwd"),
        (_pw("hunter2"), "users[0].password",
         "must be scrypt$n=<N>,r=<R>,p=<P>$<salt, base64>$<key, base64>"),
        (_pw("scrypt$n=1024,r=8,p=1$c2FsdHNhbHQ=$" + KEY),
         "users[0].password", "n must be a power of two from 16384, got 1024"),
        (_pw("scrypt$n=20000,r=8,p=1$c2FsdHNhbHQ=$" + KEY),
         "users[0].password", "power of two"),
        (_pw("scrypt$n=1048576,r=8,p=1$c2FsdHNhbHQ=$" + KEY),
         "users[0].password", "at most 64 MiB"),
        (_pw("scrypt$n=16384,r=8,p=99$c2FsdHNhbHQ=$" + KEY),
         "users[0].password", "p must be from 1 to 16"),
        (_pw("scrypt$n=16384,r=8,p=1$c2FsdHNhbHQ$" + KEY),
         "users[0].password", "base64"),
        (_pw("scrypt$n=16384,r=8,p=1$c2FsdHNhbHQ=$QUFB"),
         "users[0].password", "16 to 64 bytes"),
        ("[[users]]\nname = 'a'\nsalt = 's'\npassword = 'x'\n", "users[0].password_sha256",
         "give password alone"),
    ],
)  # fmt: skip
def test_users_file_refusals_name_the_place(text: str, field: str, rule: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse_users(text, "f.toml")
    assert field in str(err.value)
    assert rule in str(err.value)


def test_missing_users_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="console_users_file"):
        ConsoleUsers(tmp_path / "absent.toml")


def test_sessions_expire_and_are_bounded() -> None:
    clock = Clock()
    store = SessionStore(60, clock)
    s = store.create("ann", "admin", "password")
    assert s.token != s.csrf
    assert store.get(s.token) == s
    assert store.get("forged") is None
    assert store.get(None) is None
    clock.now += 60
    assert store.get(s.token) is None
    first = store.create("a", "read", "password")
    mine = [store.create("b", "read", "password") for _ in range(SESSIONS_PER_USER + 5)]
    assert len(store) == SESSIONS_PER_USER + 1
    assert store.get(first.token) == first  # another user's session stays
    assert [store.get(s.token) for s in mine[:5]] == [None] * 5  # b's own oldest went
    assert store.get(mine[-1].token) == mine[-1]
    assert store.create("b", "read", "access_key")  # an access key b is another user
    last = store.create("c", "read", "password")
    assert store.delete(last.token)
    assert not store.delete(last.token)


def test_a_full_session_store_refuses_rather_than_evicts() -> None:
    clock = Clock()
    store = SessionStore(600, clock, per_user=1, limit=MAX_SESSIONS)
    made = [store.create(f"u{i}", "read", "password") for i in range(MAX_SESSIONS)]
    clock.now += 100
    with pytest.raises(SessionsFull) as full:
        store.create("late", "admin", "password")
    assert (full.value.limit, full.value.retry_after_s) == (MAX_SESSIONS, 500)
    assert all(store.get(s.token) == s for s in made)
    assert store.get(made[7].token) == made[7]
    again = store.create("u7", "read", "password")  # at its own cap: replaces its own
    assert store.get(again.token) == again
    assert store.get(made[7].token) is None
    clock.now += 500  # the oldest expired: room again
    assert store.create("late", "admin", "password").user == "late"


def test_a_read_only_user_logging_in_10005_times_does_not_log_the_admin_out() -> None:
    store = SessionStore(3600, Clock())
    admin = store.create("alice", "admin", "password")
    bobs = [store.create("bob", "read", "password") for _ in range(10_005)]
    assert store.get(admin.token) == admin
    assert store.get(bobs[-1].token) == bobs[-1]


def test_series_keep_the_last_hour() -> None:
    s = Series()
    for t in range(0, int(WINDOW_S) * 2, 10):
        s.add(float(t), 1.0)
    assert len(s.points) == WINDOW_S / 10 + 1
    assert s.since(WINDOW_S * 2 - 15) == [[WINDOW_S * 2 - 10, 1.0]]


def test_settings_defaults_env_and_refusals() -> None:
    s = load_settings(env={})
    assert (s.listen, s.namesrv, s.metrics_listen) == (
        "127.0.0.1:8080", "127.0.0.1:9876", "127.0.0.1:8081",
    )  # fmt: skip
    assert (s.login_required, s.https) == (False, False)
    limits = (s.login_user_failures, s.login_address_failures, s.login_window_s)
    assert limits == (5, 50, 900.0)
    assert (s.login_lockout_s, s.login_lockout_max_s) == (60.0, 900.0)
    assert (s.sessions_per_user, s.max_sessions) == (20, 10_000)
    assert load_settings(env={"APOGEE_CONSOLE_LOGIN_USER_FAILURES": "3"}).login_user_failures == 3
    env = {"APOGEE_CONSOLE_CONSOLE_USERS_FILE": "/x", "APOGEE_CONSOLE_SESSION_TTL_S": "120"}
    s = load_settings(env=env, listen="0.0.0.0:9000")
    assert (s.login_required, s.session_ttl_s, s.listen) == (True, 120.0, "0.0.0.0:9000")
    for overrides, field in (
        ({"prometheus_url": "prom:9090"}, "prometheus_url"),
        ({"sample_interval_s": 0.1}, "sample_interval_s"),
        ({"session_ttl_s": 1}, "session_ttl_s"),
        ({"namesrv": ";"}, "namesrv"),
        ({"listen": "8080"}, "listen"),
        ({"log_level": "loud"}, "log_level"),
        ({"login_user_failures": 0}, "login_user_failures"),
        ({"login_address_failures": 100_001}, "login_address_failures"),
        ({"login_window_s": math.inf}, "login_window_s"),
        ({"login_lockout_s": 0.5}, "login_lockout_s"),
        ({"login_lockout_max_s": 30}, "login_lockout_max_s"),
        ({"sessions_per_user": 0}, "sessions_per_user"),
        ({"max_sessions": 0}, "max_sessions"),
        ({"auth_enabled": True, "auth_users_file": "/u"}, "auth_credentials_file"),
    ):
        with pytest.raises(InvalidArgumentError) as err:
            load_settings(env={}, **overrides)
        assert str(err.value).startswith(field), err.value


def test_error_kinds_map_to_http_statuses() -> None:
    assert status_of(InvalidArgumentError(field="f", rule="r")) == 400
    assert status_of(NotFoundError(what="w", detail="d")) == 404
    assert status_of(UnknownTopicError(topic="t", detail="d")) == 404
    assert status_of(PermissionDeniedError(what="w", rule="r")) == 403
    assert status_of(UnauthenticatedError(what="w", rule="r")) == 401
    assert status_of(TransactionDecidedError(what="w", detail="d")) == 409
    assert status_of(UnavailableError(what="w", detail="d")) == 503
    assert status_of(DeadlineExceededError(what="w", timeout_s=1)) == 503


async def test_prometheus_query_range() -> None:
    asked: list[httpx.QueryParams] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.params)
        body: dict[str, Any] = {
            "status": "success",
            "data": {
                "resultType": "matrix",
                "result": [{"metric": {}, "values": [[100, "1.5"], [115, "NaN"], [130, "2"]]}],
            },
        }
        return httpx.Response(200, json=body)

    clock = Clock()
    clock.now = 1000.0
    source = PrometheusSource(
        "http://prom:9090/", 1.0, clock=clock, transport=httpx.MockTransport(answer)
    )
    try:
        chart = await source.query_range(topic_rate_query('Or"ders'), 10, "Orders")
    finally:
        await source.close()
    assert chart == {
        "source": "prometheus",
        "series": [{"label": "Orders", "points": [[100.0, 1.5], [130.0, 2.0]]}],
    }
    assert asked[0]["query"] == 'sum(rate(apogee_broker_messages_in_total{topic="Or\\"ders"}[1m]))'
    assert (asked[0]["start"], asked[0]["end"], asked[0]["step"]) == ("400.0", "1000.0", "3")


async def test_prometheus_failures_are_unavailable() -> None:
    def fail(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"status": "error", "error": "parse error"})

    source = PrometheusSource("http://prom:9090", 1.0, transport=httpx.MockTransport(fail))
    try:
        with pytest.raises(UnavailableError, match="parse error"):
            await source.query_range("up", 5, None)
    finally:
        await source.close()


def test_passwd_reads_the_password_from_stdin() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "apogee_console.passwd", "carol", "--role", "admin"],
        input="pa ss\n",
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    users = parse_users(done.stdout, "out")
    user = users["carol"]
    assert user.role == "admin"
    assert done.stdout.splitlines()[2].startswith('password = "scrypt$n=16384,r=8,p=1$')
    assert user.password is not None
    assert user.password.matches("pa ss")
    assert not user.password.matches("pa s")
    empty = subprocess.run(
        [sys.executable, "-m", "apogee_console.passwd", "carol"],
        input="\n",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert empty.returncode == 1


def test_configuration_reference_matches_console_settings() -> None:
    assert config_reference() in DOC.read_text(), (
        "docs/configuration.md is out of date: run `uv run python scripts/gen_config_docs.py`"
    )


async def test_charts_come_from_prometheus_when_it_is_set() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        query = request.url.params["query"]
        metric = {"level": "3"} if "by (level)" in query else {}
        body = {
            "status": "success",
            "data": {"resultType": "matrix", "result": [{"metric": metric, "values": [[1, "4"]]}]},
        }
        return httpx.Response(200, json=body)

    async with console_app("127.0.0.1:1", prometheus_url="http://prom:9090") as (app, client):
        console = app.state.console
        assert not console.sampler.rounds  # no sampling of its own
        await console.prometheus.close()
        console.prometheus = PrometheusSource(
            "http://prom:9090", 1.0, transport=httpx.MockTransport(answer)
        )
        rate = (await client.get("/api/v1/metrics/topics/Orders/rate?minutes=5")).json()
        assert rate == {
            "source": "prometheus",
            "series": [{"label": "Orders", "points": [[1.0, 4.0]]}],
        }
        lag = (await client.get("/api/v1/metrics/groups/g/lag")).json()
        assert lag["series"][0]["label"] == "g"
        backlog = (await client.get("/api/v1/metrics/schedule/backlog")).json()
        assert backlog["series"] == [{"label": "3", "points": [[1.0, 4.0]]}]
        assert_problem(await client.put("/api/v1/cluster"), 405, "METHOD_NOT_ALLOWED")


async def test_the_broker_list_is_asked_once_for_callers_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[int] = []
    gate = asyncio.Event()

    async def cluster_info(_self: AdminClient) -> list[BrokerInfo]:
        asked.append(1)
        await gate.wait()
        if len(asked) == 2:
            raise UnavailableError(what="the nameservers", detail="down")
        return [BrokerInfo("c", "b", "127.0.0.1:1", 0, 0, False)]

    monkeypatch.setattr(AdminClient, "cluster_info", cluster_info)
    admin = CachedAdminClient("127.0.0.1:1", ttl_s=60)
    try:
        callers = [asyncio.ensure_future(admin.cluster_info()) for _ in range(5)]
        await asyncio.sleep(0)
        gate.set()
        answers = await asyncio.gather(*callers)
        assert len(asked) == 1
        assert all(a == answers[0] for a in answers)
        assert (await admin.cluster_info())[0].broker_name == "b"  # still fresh
        admin.forget_brokers()
        with pytest.raises(UnavailableError):
            await admin.cluster_info()  # a failure is not kept
        assert (await admin.cluster_info())[0].broker_name == "b"
        assert len(asked) == 3
    finally:
        await admin.close()
