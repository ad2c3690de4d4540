"""The users file: rights, wildcard precedence, admin levels, service users, validation."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apogee.common.auth import (
    Credentials,
    User,
    Users,
    check,
    check_admin,
    check_service,
)
from apogee.common.errors import InvalidArgumentError, PermissionDeniedError

pytestmark = pytest.mark.unit

SECRET = "s3cr3t-do-not-print"

EXAMPLE = f"""
[[users]]
access_key = "orders-app"
secret_key = "{SECRET}"
admin = "none"
service = false
[users.topics]
"Orders" = "PUB|SUB"
"Orders.*" = "SUB"
"*" = "DENY"
[users.groups]
"billing-*" = "SUB"

[[users]]
access_key = "ops"
secret_key = "ops secret"
admin = "read"

[[users]]
access_key = "root@ops"
secret_key = "root secret"
admin = "write"

[[users]]
access_key = "broker-a"
secret_key = "cluster secret"
service = true
"""


def user_with(topics: str = "", groups: str = "", **extra: str) -> User:
    lines = [f"{k} = {v}" for k, v in extra.items()]
    text = (
        '[[users]]\naccess_key = "u"\nsecret_key = "s"\n'
        + "\n".join(lines)
        + f"\n[users.topics]\n{topics}\n[users.groups]\n{groups}\n"
    )
    user = Users.parse(text, "test").get("u")
    assert user is not None
    return user


@pytest.fixture
def users() -> Users:
    return Users.parse(EXAMPLE, "users.toml")


def test_the_example_parses(users: Users) -> None:
    assert len(users) == 4
    assert "orders-app" in users
    app = users.get("orders-app")
    assert app is not None
    assert app.admin == "none"
    assert not app.service
    assert app.secret_key == SECRET
    assert users.get("nobody") is None
    assert {u.access_key for u in users} == {"orders-app", "ops", "root@ops", "broker-a"}


def test_exact_name_beats_every_wildcard(users: Users) -> None:
    app = users.get("orders-app")
    assert app is not None
    assert app.may("topic", "Orders", "PUB")
    assert app.may("topic", "Orders", "SUB")
    assert app.may("topic", "Orders.eu", "SUB")
    assert not app.may("topic", "Orders.eu", "PUB")
    assert not app.may("topic", "Payments", "SUB")  # "*" = DENY
    assert app.may("group", "billing-eu", "SUB")
    assert not app.may("group", "billing-eu", "PUB")
    assert not app.may("group", "shipping", "SUB")  # no match: refused


def test_more_literal_characters_win() -> None:
    user = user_with(topics='"Ord*" = "DENY"\n"Orders-*" = "PUB"\n"O?ders-eu*" = "SUB"')
    assert user.may("topic", "Orders-eu-1", "SUB")  # 9 literals beat 7
    assert not user.may("topic", "Orders-eu-1", "PUB")
    assert user.may("topic", "Orders-us", "PUB")  # 7 literals beat 3
    assert not user.may("topic", "Ordnance", "PUB")  # only "Ord*": DENY
    assert not user.may("topic", "Other", "SUB")  # nothing matches


def test_a_tie_unions_rights_unless_one_denies() -> None:
    user = user_with(topics='"a*" = "PUB"\n"*a" = "SUB"\n"b*" = "PUB"\n"*b" = "DENY"')
    assert user.may("topic", "aXa", "PUB")
    assert user.may("topic", "aXa", "SUB")
    assert not user.may("topic", "bXb", "PUB")
    assert not user.may("topic", "bXb", "SUB")
    assert user.may("topic", "bXc", "PUB")


def test_exact_deny_beats_a_wildcard_grant() -> None:
    user = user_with(topics='"*" = "PUB|SUB"\n"Secret" = "DENY"')
    assert user.may("topic", "Anything", "PUB")
    assert not user.may("topic", "Secret", "SUB")


def test_patterns_are_case_sensitive_and_brackets_literal() -> None:
    user = user_with(topics='"orders*" = "SUB"\n"[ab]?" = "PUB"')
    assert user.may("topic", "orders-1", "SUB")
    assert not user.may("topic", "Orders-1", "SUB")
    assert user.may("topic", "[ab]x", "PUB")
    assert not user.may("topic", "ax", "PUB")


def test_question_mark_is_one_character() -> None:
    user = user_with(topics='"T?" = "SUB"')
    assert user.may("topic", "T1", "SUB")
    assert not user.may("topic", "T", "SUB")
    assert not user.may("topic", "T12", "SUB")


def test_decisions_stay_right_past_the_cache_bound() -> None:
    user = user_with(topics='"a*" = "SUB"')
    for i in range(3000):
        assert user.may("topic", f"a{i}", "SUB")
        assert not user.may("topic", f"b{i}", "SUB")


def test_admin_levels(users: Users) -> None:
    app, ops, root = users.get("orders-app"), users.get("ops"), users.get("root@ops")
    assert app is not None
    assert ops is not None
    assert root is not None
    assert not app.may_admin(write=False)
    assert not app.may_admin(write=True)
    assert ops.may_admin(write=False)
    assert not ops.may_admin(write=True)
    assert root.may_admin(write=False)
    assert root.may_admin(write=True)
    assert not root.may("topic", "Orders", "SUB")  # admin is not data access


def test_a_service_user_has_every_right_and_alone_registers_brokers(users: Users) -> None:
    broker, root = users.get("broker-a"), users.get("root@ops")
    assert broker is not None
    assert root is not None
    assert broker.may("topic", "Anything", "PUB")
    assert broker.may("group", "any", "SUB")
    assert broker.may_admin(write=True)
    check_service(broker, "register a broker")
    with pytest.raises(PermissionDeniedError) as info:
        check_service(root, "register a broker")
    assert str(info.value) == (
        "user 'root@ops': is not an Apogee service identity (needed to register a broker)"
    )


def test_check_helpers_raise_permission_denied(users: Users) -> None:
    app, ops = users.get("orders-app"), users.get("ops")
    assert app is not None
    assert ops is not None
    check(app, "topic", "Orders", "PUB")
    with pytest.raises(PermissionDeniedError) as info:
        check(app, "topic", "Orders.eu", "PUB")
    assert str(info.value) == "user 'orders-app': has no PUB right on topic 'Orders.eu'"
    assert info.value.details == {
        "what": "user 'orders-app'",
        "rule": "has no PUB right on topic 'Orders.eu'",
    }
    assert info.value.code == "PERMISSION_DENIED"
    with pytest.raises(PermissionDeniedError, match="has no SUB right on group 'shipping'"):
        check(app, "group", "shipping", "SUB")
    check_admin(ops, write=False, action="describe topics")
    with pytest.raises(PermissionDeniedError) as info:
        check_admin(ops, write=True, action="create topics")
    assert str(info.value) == "user 'ops': has no admin write right (needed to create topics)"
    with pytest.raises(PermissionDeniedError, match="has no admin read right"):
        check_admin(app, write=False, action="list topics")


def test_secrets_stay_out_of_repr(users: Users) -> None:
    assert SECRET not in repr(users)
    assert SECRET not in repr(users.get("orders-app"))
    assert SECRET not in repr(list(users))
    creds = Credentials.parse(f'access_key = "a"\nsecret_key = "{SECRET}"\n', "c.toml")
    assert SECRET not in repr(creds)
    assert creds.secret_key == SECRET


def test_defaults() -> None:
    user = Users.parse('[[users]]\naccess_key = "u"\nsecret_key = "s"\n', "t").get("u")
    assert user == User("u", "s", "none", False)
    assert not user.may("topic", "T", "SUB")
    assert len(Users.parse("", "empty")) == 0


def _user(body: str, index: int = 0) -> str:
    before = "".join(
        f'[[users]]\naccess_key = "first{n}"\nsecret_key = "x"\n' for n in range(index)
    )
    return before + f'[[users]]\naccess_key = "u{index}"\nsecret_key = "{SECRET}"\n{body}\n'


@pytest.mark.parametrize(
    ("text", "field", "rule"),
    [
        (
            _user('[users.topics]\n"Orders*" = "PUBLISH"', 2),
            'users[2].topics."Orders*"',
            "must be PUB, SUB, DENY or PUB|SUB, got 'PUBLISH'",
        ),
        (
            _user('[users.topics]\n"T" = "PUB|DENY"'),
            'users[0].topics."T"',
            "must be PUB, SUB, DENY or PUB|SUB, got 'PUB|DENY'",
        ),
        (
            _user('[users.topics]\n"T" = "SUB|SUB"'),
            'users[0].topics."T"',
            "must be PUB, SUB, DENY or PUB|SUB, got 'SUB|SUB'",
        ),
        (_user('[users.topics]\n"T" = ""'), 'users[0].topics."T"', "got ''"),
        (
            _user('[users.topics]\n"T" = 1'),
            'users[0].topics."T"',
            'must be a string such as "SUB"',
        ),
        (
            _user('[users.topics]\n"" = "SUB"'),
            'users[0].topics.""',
            "a name or pattern must not be empty",
        ),
        (
            _user('[users.groups]\n"billing-*" = "PUB|SUB"'),
            'users[0].groups."billing-*"',
            "must be SUB or DENY, got 'PUB|SUB'",
        ),
        (_user('[users.groups]\n"g" = "PUB"'), 'users[0].groups."g"', "must be SUB or DENY"),
        (_user('topics = "SUB"'), "users[0].topics", 'must be a table of name = "RIGHTS"'),
        (
            _user('admin = "root"', 1),
            "users[1].admin",
            "must be none, read or write, got 'root'",
        ),
        (_user("admin = true"), "users[0].admin", "must be none, read or write, got a bool"),
        (_user('service = "yes"'), "users[0].service", "must be true or false"),
        (
            _user('secret = "x"'),
            'users[0]."secret"',
            "is not a known key; expected one of access_key, secret_key, admin, service, "
            "topics, groups",
        ),
        ('[[users]]\nsecret_key = "x"\n', "users[0].access_key", "is missing"),
        ('[[users]]\naccess_key = 1\nsecret_key = "x"\n', "users[0].access_key", "must be a"),
        ('[[users]]\naccess_key = ""\nsecret_key = "x"\n', "users[0].access_key", "must not be"),
        (
            '[[users]]\naccess_key = "a b"\nsecret_key = "x"\n',
            "users[0].access_key",
            "has a character outside [A-Za-z0-9_.@-]: 'a b'",
        ),
        ('[[users]]\naccess_key = "a"\n', "users[0].secret_key", "is missing"),
        ('[[users]]\naccess_key = "a"\nsecret_key = ""\n', "users[0].secret_key", "must not be"),
        ('[[users]]\naccess_key = "a"\nsecret_key = 7\n', "users[0].secret_key", "must be a"),
        (
            _user("").replace('"u0"', '"first"') + _user("", 0).replace('"u0"', '"first"'),
            "users[1].access_key",
            "repeats 'first', already used by users[0]",
        ),
        ('user = "x"\n', '"user"', "is not a known key; the file holds [[users]]"),
        ('users = "x"\n', "users", "must be an array of tables ([[users]])"),
        ("users = [1]\n", "users", "must be an array of tables ([[users]])"),
        (f'[[users]]\naccess_key = "a"\nsecret_key = "{SECRET}\n', "users.toml", "is not valid"),
        ("a = " + "[" * 5000, "users.toml", "is not valid TOML: it nests too deeply"),
        (
            '[[users]]\naccess_key = "a"\nsecret_key = "se\x7fcret"\n',
            "users.toml",
            "is not valid TOML: Illegal character (at line 3, column 17)",  # not which one
        ),
    ],
)
def test_every_validation_error_names_the_field_and_rule(text: str, field: str, rule: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        Users.parse(text, "users.toml")
    assert info.value.details["field"] == field
    assert rule in info.value.details["rule"]
    assert info.value.details["source"] == "users.toml"
    assert SECRET not in str(info.value)


def test_load_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "users.toml"
    path.write_text(EXAMPLE)
    assert len(Users.load(path)) == 4
    path.write_bytes(b"\xff")
    with pytest.raises(InvalidArgumentError, match="is not UTF-8"):
        Users.load(path)
    with pytest.raises(InvalidArgumentError, match="cannot be read"):
        Users.load(tmp_path / "missing.toml")


def test_credentials_file(tmp_path: Path) -> None:
    path = tmp_path / "creds.toml"
    path.write_text(f'access_key = "broker-a"\nsecret_key = "{SECRET}"\n')
    creds = Credentials.load(path)
    assert (creds.access_key, creds.secret_key) == ("broker-a", SECRET)
    assert repr(creds) == "Credentials(access_key='broker-a')"
    for text, field in [
        ('access_key = "a"\n', "secret_key"),
        ('access_key = "a"\nsecret_key = ""\n', "secret_key"),
        (f'secret_key = "{SECRET}"\n', "access_key"),
        (f'access_key = "a/b"\nsecret_key = "{SECRET}"\n', "access_key"),
        (f'access_key = "a"\nsecret_key = "{SECRET}"\nregion = "x"\n', '"region"'),
    ]:
        with pytest.raises(InvalidArgumentError) as info:
            Credentials.parse(text, "creds.toml")
        assert info.value.details["field"] == field
        assert SECRET not in str(info.value)


FUZZ = settings(max_examples=300, deadline=300, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.text(max_size=400))
def test_fuzz_users_parse_on_any_text(text: str) -> None:
    with contextlib.suppress(InvalidArgumentError):
        Users.parse(text, "fuzz")


_KEYS = st.sampled_from(["access_key", "secret_key", "admin", "service", "topics", "groups", "x"])
_VALUES = st.one_of(
    st.sampled_from(['"u"', '""', '"a b"', "1", "true", '"read"', '"write"', "{}", "[]"]),
    st.sampled_from(['{"T*" = "SUB"}', '{"T" = "PUB|SUB"}', '{"g" = "PUB"}', '{"" = "DENY"}']),
    st.sampled_from(['{"*" = "DENY"}', '{"?" = 3}', '{"T" = "SUB | PUB"}']),
)


@FUZZ
@given(st.lists(st.dictionaries(_KEYS, _VALUES, max_size=7), max_size=4))
def test_fuzz_users_parse_on_near_valid_files(entries: list[dict[str, str]]) -> None:
    text = "".join(
        "[[users]]\n" + "".join(f"{k} = {v}\n" for k, v in entry.items()) for entry in entries
    )
    try:
        users = Users.parse(text, "fuzz")
    except InvalidArgumentError:
        return
    for user in users:
        user.may("topic", "T", "SUB")
        user.may("group", "T", "SUB")
