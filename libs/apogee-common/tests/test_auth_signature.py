"""The request signature: known answers, the official client's form, strict parsing, fuzzing."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from binascii import hexlify
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apogee.common.auth import (
    Authorization,
    parse_authorization,
    parse_date_time,
    sign,
    signed_metadata,
)
from apogee.common.auth.signature import MAX_AUTHORIZATION_LENGTH, authorization_value
from apogee.common.errors import InvalidArgumentError, UnauthenticatedError

pytestmark = pytest.mark.unit

AK = "orders-app"
SK = "a long random string"
WHEN = datetime(2026, 11, 26, 13, 45, 0, tzinfo=UTC)
DATE = "20261126T134500Z"
SIG = "0" * 40
VALID = f"MQv2-HMAC-SHA1 Credential={AK}, SignedHeaders=x-mq-date-time, Signature={SIG}"


def test_sign_is_hmac_sha1_of_the_date_keyed_by_the_secret() -> None:
    expected = hmac.new(SK.encode("utf-8"), DATE.encode("utf-8"), hashlib.sha1).hexdigest()
    assert sign(SK, DATE) == expected
    assert len(expected) == 40
    assert expected == expected.lower()


def test_signed_metadata_has_the_date_and_the_authorization() -> None:
    date_entry, auth_entry = signed_metadata(AK, SK, WHEN)
    assert date_entry == ("x-mq-date-time", DATE)
    expected = hmac.new(SK.encode(), DATE.encode(), hashlib.sha1).hexdigest()
    assert auth_entry == (
        "authorization",
        f"MQv2-HMAC-SHA1 Credential={AK}, SignedHeaders=x-mq-date-time, Signature={expected}",
    )


def test_signed_metadata_turns_other_zones_to_utc_and_refuses_naive_times() -> None:
    plus_two = WHEN.astimezone(timezone(timedelta(hours=2)))
    assert signed_metadata(AK, SK, plus_two)[0] == ("x-mq-date-time", DATE)
    with pytest.raises(InvalidArgumentError, match="timezone-aware"):
        signed_metadata(AK, SK, datetime(2026, 11, 26, 13, 45))


def test_signed_metadata_defaults_to_now() -> None:
    (_, date), _ = signed_metadata(AK, SK)
    assert abs((parse_date_time(date) - datetime.now(UTC)).total_seconds()) < 5


def test_the_official_python_clients_header_parses() -> None:
    # what rocketmq-python-client builds, written out by hand
    date = WHEN.strftime("%Y%m%dT%H%M%SZ")
    digest = hexlify(hmac.new(SK.encode(), date.encode(), hashlib.sha1).digest()).decode()
    header = (
        "MQv2-HMAC-SHA1 Credential=" + AK + ", SignedHeaders=x-mq-date-time, Signature=" + digest
    )
    auth = parse_authorization(header)
    assert auth == Authorization(AK, ("x-mq-date-time",), digest)
    assert hmac.compare_digest(sign(SK, date), auth.signature)
    assert parse_date_time(date) == WHEN


def test_parts_in_any_order_spaces_optional_scope_dropped_hex_lowercased() -> None:
    value = (
        f"MQv2-HMAC-SHA1 Signature={'AB' * 20},SignedHeaders=X-MQ-Date-Time;host,"
        f"  Credential={AK}/cn-hangzhou/rocketmq"
    )
    assert parse_authorization(value) == Authorization(AK, ("x-mq-date-time", "host"), "ab" * 20)


def test_authorization_value_round_trips() -> None:
    assert parse_authorization(authorization_value("a.b@c_d-1", SIG)).access_key == "a.b@c_d-1"


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("", "must start with MQv2-HMAC-SHA1"),
        ("Bearer xyz", "must start with MQv2-HMAC-SHA1"),
        (VALID.replace("MQv2-HMAC-SHA1 ", "MQv2-HMAC-SHA1"), "must start with MQv2-HMAC-SHA1"),
        (VALID.replace("MQv2", "mqv2"), "must start with MQv2-HMAC-SHA1"),
        (VALID.replace(f"Credential={AK}, ", ""), "Credential is missing"),
        (VALID.replace("SignedHeaders=x-mq-date-time, ", ""), "SignedHeaders is missing"),
        (VALID.replace(f", Signature={SIG}", ""), "Signature is missing"),
        (VALID + f", Signature={SIG}", "Signature is given twice"),
        (VALID + ",", "has an empty part"),
        (VALID + ", Region", "part 'Region' must be NAME=VALUE"),
        (VALID + ", Region=x", "unknown part 'Region'"),
        (VALID.replace(SIG, "0" * 39), "Signature must be 40 hex digits"),
        (VALID.replace(SIG, "0" * 41), "Signature must be 40 hex digits"),
        (VALID.replace(SIG, "g" * 40), "Signature must be 40 hex digits"),
        (VALID.replace(SIG, "\u0660" * 40), "Signature must be 40 hex digits"),  # Arabic-Indic 0
        (VALID.replace(AK, ""), "the access key in Credential must not be empty"),
        (VALID.replace(AK, "/scope"), "the access key in Credential must not be empty"),
        (VALID.replace(AK, "a b"), "the access key in Credential has a character outside"),
        (VALID.replace(AK, "k" * 129), "is 129 characters; at most 128"),
        (VALID.replace("x-mq-date-time", "host"), "SignedHeaders must include x-mq-date-time"),
        (VALID.replace("x-mq-date-time", "host;;x-mq-date-time"), "SignedHeaders has an empty"),
        (VALID + " " * MAX_AUTHORIZATION_LENGTH, "at most 2,048 are allowed"),
    ],
)
def test_malformed_headers_are_refused_naming_the_rule(value: str, rule: str) -> None:
    with pytest.raises(UnauthenticatedError, match=r"^authorization header: ") as info:
        parse_authorization(value)
    assert rule in info.value.details["rule"]
    assert info.value.details["reason"] == "malformed"
    assert info.value.code == "UNAUTHENTICATED"
    assert not info.value.retriable


def test_a_long_bad_value_is_quoted_short() -> None:
    with pytest.raises(UnauthenticatedError) as info:
        parse_authorization(VALID.replace(AK, "x y" * 40))
    assert len(str(info.value)) < 200


def test_a_very_long_header_is_refused_before_parsing() -> None:
    huge = "MQv2-HMAC-SHA1 " + "," * 10_000_000
    with pytest.raises(UnauthenticatedError, match="10,000,015 characters"):
        parse_authorization(huge)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "20261126T134500",
        "20261126 134500Z",
        "2026-11-26T13:45:00Z",
        "20261326T134500Z",
        "20261126T246000Z",
        "20261126T134560Z",
        "20260230T000000Z",
        "\uff12\uff10\uff12\uff161126T134500Z",  # full-width digits
        "20261126T134500Z\n",
        "x" * 100_000,
    ],
)
def test_bad_dates_are_refused(value: str) -> None:
    with pytest.raises(UnauthenticatedError, match=r"^x-mq-date-time: ") as info:
        parse_date_time(value)
    assert info.value.details["reason"] == "bad_date"
    assert len(str(info.value)) < 200


def test_dates_parse_as_aware_utc() -> None:
    assert parse_date_time(DATE) == WHEN
    assert parse_date_time(DATE).tzinfo is UTC
    assert parse_date_time("20240229T235959Z") == datetime(2024, 2, 29, 23, 59, 59, tzinfo=UTC)


FUZZ = settings(max_examples=400, deadline=200, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.text(max_size=300))
def test_fuzz_parse_authorization_on_any_text(value: str) -> None:
    with contextlib.suppress(UnauthenticatedError):
        parse_authorization(value)


def _mutations() -> st.SearchStrategy[str]:
    """Near-valid headers: a valid one with a slice replaced, dropped or repeated."""

    @st.composite
    def mutate(draw: st.DrawFn) -> str:
        value = VALID
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(value)))
            j = draw(st.integers(i, min(len(value), i + 12)))
            op = draw(st.sampled_from(["replace", "drop", "repeat"]))
            if op == "replace":
                alphabet = st.sampled_from(list(" ,;=/-xX0aA\t\x00é" + "MQv2-HMAC-SHA1"))
                value = value[:i] + draw(st.text(alphabet, max_size=6)) + value[j:]
            elif op == "drop":
                value = value[:i] + value[j:]
            else:
                value = value[:i] + value[i:j] * 2 + value[j:]
        return value

    return mutate()


@FUZZ
@given(_mutations())
def test_fuzz_parse_authorization_on_near_valid_headers(value: str) -> None:
    try:
        auth = parse_authorization(value)
    except UnauthenticatedError:
        return
    assert "x-mq-date-time" in auth.signed_headers
    assert len(auth.signature) == 40


@FUZZ
@given(st.one_of(st.text(max_size=40), st.from_regex(r"[0-9]{8}T[0-9]{6}Z", fullmatch=True)))
def test_fuzz_parse_date_time(value: str) -> None:
    try:
        when = parse_date_time(value)
    except UnauthenticatedError:
        return
    # not strftime: glibc writes year 1 as "1", not "0001"
    assert f"{when:%m%dT%H%M%SZ}" == value[4:]
    assert when.year == int(value[:4])
    assert when.tzinfo is UTC
