"""Verification: the users file as it changes, and the authenticator's refusals and cache."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from binascii import hexlify
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apogee.common.auth import (
    Authenticator,
    FixedUsers,
    Users,
    UsersFile,
    sign,
    signed_metadata,
)
from apogee.common.auth import verify as verify_module
from apogee.common.errors import InvalidArgumentError, UnauthenticatedError

pytestmark = pytest.mark.unit

SECRET = "orders secret that must not leak"
USERS = f"""
[[users]]
access_key = "orders-app"
secret_key = "{SECRET}"
[users.topics]
"Orders" = "PUB|SUB"

[[users]]
access_key = "ops"
secret_key = "ops secret"
admin = "read"
"""
ONLY_OPS = '[[users]]\naccess_key = "ops"\nsecret_key = "ops secret"\nadmin = "write"\n'
NOW = datetime(2026, 11, 26, 13, 45, 0, tzinfo=UTC)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def write(path: Path, text: str, mtime: int) -> None:
    path.write_text(text)
    os.utime(path, (mtime, mtime))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def users_path(tmp_path: Path) -> Path:
    path = tmp_path / "users.toml"
    write(path, USERS, 1_700_000_000)
    return path


@pytest.fixture
def users_file(users_path: Path, clock: FakeClock) -> UsersFile:
    return UsersFile(users_path, check_interval_s=1.0, clock=clock)


@pytest.fixture
def auth(users_file: UsersFile) -> Authenticator:
    return Authenticator(users_file, max_skew_s=900.0, now=lambda: NOW)


def refused(
    auth: Authenticator, metadata: Sequence[tuple[str, str | bytes]]
) -> UnauthenticatedError:
    with pytest.raises(UnauthenticatedError) as info:
        auth.authenticate(metadata)
    assert info.value.code == "UNAUTHENTICATED"
    assert not info.value.retriable
    assert SECRET not in str(info.value)
    return info.value


# -- UsersFile -------------------------------------------------------------------------------


def test_reloads_when_the_file_changes_checking_once_per_interval(
    users_file: UsersFile, users_path: Path, clock: FakeClock
) -> None:
    first = users_file.current()
    assert first.get("orders-app") is not None
    write(users_path, ONLY_OPS, 1_700_000_100)
    clock.t += 0.5
    assert users_file.current() is first  # not looked at yet
    clock.t += 0.6
    second = users_file.current()
    assert second is not first
    assert second.get("orders-app") is None
    assert second.generation != first.generation
    assert users_file.reloads == 1
    clock.t += 5
    assert users_file.current() is second  # unchanged: not parsed again
    assert users_file.reloads == 1


def test_a_change_of_size_alone_is_noticed(
    users_file: UsersFile, users_path: Path, clock: FakeClock
) -> None:
    first = users_file.current()
    write(users_path, USERS + "\n", 1_700_000_000)  # same mtime
    clock.t += 2
    assert users_file.current() is not first


def test_a_swapped_symlink_is_followed(tmp_path: Path, clock: FakeClock) -> None:
    # a Kubernetes Secret: users.toml -> ..data/users.toml, ..data -> a timestamped directory
    old, new = tmp_path / "v1", tmp_path / "v2"
    old.mkdir()
    new.mkdir()
    write(old / "users.toml", USERS, 1_700_000_000)
    write(new / "users.toml", USERS, 1_700_000_000)  # same size and mtime: another inode
    (tmp_path / "..data").symlink_to(old)
    (tmp_path / "users.toml").symlink_to(tmp_path / "..data" / "users.toml")
    users_file = UsersFile(tmp_path / "users.toml", clock=clock)
    first = users_file.current()
    tmp = tmp_path / "..data_tmp"
    tmp.symlink_to(new)
    tmp.replace(tmp_path / "..data")
    clock.t += 2
    assert users_file.current() is not first


def test_a_broken_file_keeps_the_old_users_and_logs_once(
    users_file: UsersFile, users_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    first = users_file.current()
    write(users_path, USERS.replace('"PUB|SUB"', '"PUBLISH"'), 1_700_000_100)
    with caplog.at_level(logging.ERROR, logger=verify_module.__name__):
        for _ in range(5):
            clock.t += 2
            assert users_file.current() is first
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    message = errors[0].getMessage()
    assert str(users_path) in message
    assert "users[0].topics" in message
    assert "keeping the 2 users loaded before" in message
    assert SECRET not in message
    # another broken change is logged again; a good one is loaded
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger=verify_module.__name__):
        write(users_path, "not toml at all " + SECRET, 1_700_000_200)
        clock.t += 2
        assert users_file.current() is first
    assert len(caplog.records) == 1
    assert SECRET not in caplog.records[0].getMessage()
    write(users_path, ONLY_OPS, 1_700_000_300)
    clock.t += 2
    assert users_file.current() is not first
    assert users_file.failures == 2


def test_a_vanished_file_keeps_the_old_users(
    users_file: UsersFile, users_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    first = users_file.current()
    users_path.unlink()
    with caplog.at_level(logging.ERROR, logger=verify_module.__name__):
        for _ in range(3):
            clock.t += 2
            assert users_file.current() is first
    assert len(caplog.records) == 1
    assert "cannot be read" in caplog.records[0].getMessage()
    # back, then gone again: the second disappearance is logged too
    write(users_path, USERS, 1_700_000_000)
    clock.t += 2
    back = users_file.current()
    assert back.get("orders-app") is not None
    users_path.unlink()
    with caplog.at_level(logging.ERROR, logger=verify_module.__name__):
        clock.t += 2
        assert users_file.current() is back
    assert len(caplog.records) == 2


def test_the_first_load_failing_raises(tmp_path: Path) -> None:
    path = tmp_path / "users.toml"
    write(path, '[[users]]\naccess_key = "a"\n', 1_700_000_000)
    with pytest.raises(InvalidArgumentError, match=r"users\[0\]\.secret_key: is missing"):
        UsersFile(path)
    with pytest.raises(FileNotFoundError):
        UsersFile(tmp_path / "missing.toml")


# -- Authenticator -----------------------------------------------------------------------------


def test_a_signed_call_is_its_user(auth: Authenticator) -> None:
    user = auth.authenticate(signed_metadata("orders-app", SECRET, NOW))
    assert user.access_key == "orders-app"
    assert user.may("topic", "Orders", "PUB")


def test_the_official_python_clients_metadata_verifies(auth: Authenticator) -> None:
    date = NOW.strftime("%Y%m%dT%H%M%SZ")
    digest = hexlify(hmac.new(SECRET.encode(), date.encode(), hashlib.sha1).digest()).decode()
    header = (
        "MQv2-HMAC-SHA1 Credential="
        + "orders-app"
        + ", SignedHeaders=x-mq-date-time, Signature="
        + digest
    )
    metadata: list[tuple[str, str | bytes]] = [
        ("x-mq-client-id", "host@1"),
        ("x-mq-date-time", date),
        ("authorization", header),
        ("x-mq-language", "PYTHON"),
    ]
    assert auth.authenticate(metadata).access_key == "orders-app"


def test_bytes_values_are_accepted(auth: Authenticator) -> None:
    (dk, dv), (ak, av) = signed_metadata("ops", "ops secret", NOW)
    assert auth.authenticate([(dk, dv.encode()), (ak, av.encode())]).access_key == "ops"


def test_unsigned(auth: Authenticator) -> None:
    err = refused(auth, [("x-mq-date-time", "20261126T134500Z")])
    assert str(err) == ("the request is not signed: set an access key and secret key in the client")
    assert err.details["reason"] == "missing"


def test_malformed(auth: Authenticator) -> None:
    err = refused(auth, [("authorization", "Basic b3BzOm9wcw==")])
    assert err.details["reason"] == "malformed"
    assert str(err).startswith("authorization header: must start with MQv2-HMAC-SHA1")
    _, a = signed_metadata("ops", "ops secret", NOW)
    assert refused(auth, [a, a]).details["reason"] == "malformed"
    assert refused(auth, [("authorization", b"\xff")]).details["reason"] == "malformed"


def test_unknown_access_key_is_named(auth: Authenticator) -> None:
    err = refused(auth, list(signed_metadata("intruder", "guess", NOW)))
    assert err.details["reason"] == "unknown_key"
    assert str(err).startswith("access key 'intruder': is not known to this server")


def test_wrong_secret(auth: Authenticator) -> None:
    err = refused(auth, list(signed_metadata("orders-app", "wrong", NOW)))
    assert str(err) == "the signature does not match access key 'orders-app': check its secret key"
    assert err.details["reason"] == "bad_signature"


def test_signature_over_another_date_is_refused(auth: Authenticator) -> None:
    _, auth_entry = signed_metadata("orders-app", SECRET, NOW)
    other = (NOW + timedelta(seconds=1)).strftime("%Y%m%dT%H%M%SZ")
    err = refused(auth, [("x-mq-date-time", other), auth_entry])
    assert err.details["reason"] == "bad_signature"


def test_missing_or_bad_date(auth: Authenticator) -> None:
    _, a = signed_metadata("orders-app", SECRET, NOW)
    err = refused(auth, [a])
    assert err.details["reason"] == "bad_date"
    assert str(err).startswith("x-mq-date-time: is missing")
    err = refused(auth, [a, ("x-mq-date-time", "2026-11-26T13:45:00Z")])
    assert err.details["reason"] == "bad_date"
    assert "YYYYMMDDTHHMMSSZ" in str(err)
    d, _ = signed_metadata("orders-app", SECRET, NOW)
    assert refused(auth, [a, d, d]).details["reason"] == "bad_date"


@pytest.mark.parametrize(
    ("offset_s", "direction"), [(-1200, "behind"), (1200, "ahead of")], ids=["behind", "ahead"]
)
def test_clock_skew_both_ways(auth: Authenticator, offset_s: int, direction: str) -> None:
    signed_at = NOW + timedelta(seconds=offset_s)
    err = refused(auth, list(signed_metadata("orders-app", SECRET, signed_at)))
    assert err.details["reason"] == "clock_skew"
    stamp = signed_at.strftime("%Y%m%dT%H%M%SZ")
    assert str(err) == (
        f"x-mq-date-time {stamp} is 1,200 s from the server's clock: the limit is 900 s; "
        f"the client's clock is {direction} the server's"
    )


def test_skew_within_the_limit_is_accepted(auth: Authenticator) -> None:
    for offset_s in (-900, -899, 0, 899, 900):
        signed_at = NOW + timedelta(seconds=offset_s)
        auth.authenticate(signed_metadata("orders-app", SECRET, signed_at))


def test_a_cached_pair_still_ages_out(users_file: UsersFile) -> None:
    now = [NOW]
    auth = Authenticator(users_file, max_skew_s=900.0, now=lambda: now[0])
    metadata = list(signed_metadata("orders-app", SECRET, NOW))
    auth.authenticate(metadata)
    now[0] = NOW + timedelta(seconds=901)
    assert refused(auth, metadata).details["reason"] == "clock_skew"


def test_a_cached_pair_is_refused_once_the_user_is_removed(
    auth: Authenticator, users_path: Path, clock: FakeClock
) -> None:
    metadata = list(signed_metadata("orders-app", SECRET, NOW))
    assert auth.authenticate(metadata).access_key == "orders-app"
    assert auth.authenticate(metadata).access_key == "orders-app"  # from the cache
    write(users_path, ONLY_OPS, 1_700_000_100)
    clock.t += 2
    assert refused(auth, metadata).details["reason"] == "unknown_key"


def test_a_cached_pair_sees_a_changed_secret(
    auth: Authenticator, users_path: Path, clock: FakeClock
) -> None:
    metadata = list(signed_metadata("orders-app", SECRET, NOW))
    auth.authenticate(metadata)
    write(users_path, USERS.replace(SECRET, "rotated"), 1_700_000_100)
    clock.t += 2
    assert refused(auth, metadata).details["reason"] == "bad_signature"
    assert auth.authenticate(signed_metadata("orders-app", "rotated", NOW))


def test_the_cache_stays_bounded(auth: Authenticator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_module, "CACHE_SIZE", 8)
    for s in range(20):
        auth.authenticate(signed_metadata("ops", "ops secret", NOW + timedelta(seconds=s)))
    assert len(auth._verified) <= 8


def test_a_cached_call_costs_no_hmac(auth: Authenticator, monkeypatch: pytest.MonkeyPatch) -> None:
    metadata = list(signed_metadata("orders-app", SECRET, NOW))
    auth.authenticate(metadata)
    calls: list[tuple[str, str]] = []

    def counting_sign(secret_key: str, date_time: str) -> str:
        calls.append((secret_key, date_time))
        return sign(secret_key, date_time)

    monkeypatch.setattr(verify_module, "sign", counting_sign)
    for _ in range(10):
        auth.authenticate(metadata)
    assert calls == []


_HEADER = st.sampled_from(["authorization", "x-mq-date-time", "x-mq-client-id", "Authorization"])
_VALUE = st.one_of(
    st.text(max_size=120),
    st.binary(max_size=60),
    st.sampled_from(
        [
            "20261126T134500Z",
            "20261126T133000Z",
            "MQv2-HMAC-SHA1 Credential=ops, SignedHeaders=x-mq-date-time, Signature=" + "a" * 40,
            signed_metadata("orders-app", SECRET, NOW)[1][1],
        ]
    ),
)


@settings(max_examples=300, deadline=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_HEADER | st.text(max_size=20), _VALUE), max_size=6))
def test_fuzz_authenticate_on_any_metadata(metadata: list[tuple[str, str | bytes]]) -> None:
    auth = Authenticator(FixedUsers(_FUZZ_USERS), now=lambda: NOW)
    try:
        outcome = auth.authenticate(metadata).access_key
    except UnauthenticatedError as err:
        outcome = err.details["reason"]
    assert outcome in ("orders-app", "ops", *verify_module.REASONS)


_FUZZ_USERS = Users.parse(USERS, "fuzz")
