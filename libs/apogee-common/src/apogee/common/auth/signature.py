"""The request signature RocketMQ 5 clients send, built and parsed.

A signed call carries two metadata entries::

    x-mq-date-time: 20261126T134500Z
    authorization:  MQv2-HMAC-SHA1 Credential=<AK>, SignedHeaders=x-mq-date-time, Signature=<hex>

``<hex>`` is the lowercase hex of HMAC-SHA1(key = the secret key in UTF-8, message = the
date-time string in UTF-8). The date-time is UTC, ``%Y%m%dT%H%M%SZ``.

The parsers are strict and total: any input either parses or raises
:class:`~apogee.common.errors.UnauthenticatedError` whose ``rule`` says what is wrong (and whose
``details["reason"]`` is ``malformed`` or ``bad_date``); they never raise anything else, and
they look at no more than :data:`MAX_AUTHORIZATION_LENGTH` characters.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from apogee.common.errors import InvalidArgumentError, UnauthenticatedError

ALGORITHM: Final = "MQv2-HMAC-SHA1"
AUTHORIZATION_KEY: Final = "authorization"
DATE_TIME_KEY: Final = "x-mq-date-time"
DATE_TIME_FORMAT: Final = "%Y%m%dT%H%M%SZ"

#: The longest ``authorization`` value looked at; longer ones are refused before any parsing.
MAX_AUTHORIZATION_LENGTH: Final = 2048
MAX_ACCESS_KEY_LENGTH: Final = 128
ACCESS_KEY_RE: Final = re.compile(r"[A-Za-z0-9_.@-]{1,128}")
_HEX_RE: Final = re.compile(r"[0-9a-fA-F]{40}")
_DATE_RE: Final = re.compile(r"[0-9]{8}T[0-9]{6}Z")

_CREDENTIAL: Final = "Credential"
_SIGNED_HEADERS: Final = "SignedHeaders"
_SIGNATURE: Final = "Signature"
_PARTS: Final = (_CREDENTIAL, _SIGNED_HEADERS, _SIGNATURE)
_WHAT: Final = "authorization header"


@dataclass(frozen=True, slots=True)
class Authorization:
    """A parsed ``authorization`` value. ``signature`` is lowercase hex; ``signed_headers``
    lowercase names."""

    access_key: str
    signed_headers: tuple[str, ...]
    signature: str


def quoted(value: str, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters (with ``...``) so messages stay short."""
    if len(value) > limit:
        return repr(value[:limit]) + "..."
    return repr(value)


def access_key_rule(access_key: str) -> str | None:
    """Why ``access_key`` is not a valid access key, or None if it is."""
    if not access_key:
        return "must not be empty"
    if len(access_key) > MAX_ACCESS_KEY_LENGTH:
        return f"is {len(access_key)} characters; at most {MAX_ACCESS_KEY_LENGTH} are allowed"
    if not ACCESS_KEY_RE.fullmatch(access_key):
        return f"has a character outside [A-Za-z0-9_.@-]: {quoted(access_key)}"
    return None


def sign(secret_key: str, date_time: str) -> str:
    """The lowercase hex HMAC-SHA1 of ``date_time`` keyed by ``secret_key`` (both UTF-8)."""
    return hmac.new(secret_key.encode(), date_time.encode(), hashlib.sha1).hexdigest()


def format_date_time(when: datetime) -> str:
    """``when`` (timezone-aware) as the UTC ``x-mq-date-time`` string."""
    if when.tzinfo is None or when.utcoffset() is None:
        raise InvalidArgumentError(field="now", rule="must be a timezone-aware datetime")
    return when.astimezone(UTC).strftime(DATE_TIME_FORMAT)


def authorization_value(access_key: str, signature: str) -> str:
    """The ``authorization`` value as the official clients write it."""
    return (
        f"{ALGORITHM} {_CREDENTIAL}={access_key}, {_SIGNED_HEADERS}={DATE_TIME_KEY}, "
        f"{_SIGNATURE}={signature}"
    )


def signed_metadata(
    access_key: str, secret_key: str, now: datetime | None = None
) -> tuple[tuple[str, str], tuple[str, str]]:
    """The two metadata entries that sign a call made at ``now`` (default: the current time)."""
    date_time = format_date_time(now if now is not None else datetime.now(UTC))
    return (
        (DATE_TIME_KEY, date_time),
        (AUTHORIZATION_KEY, authorization_value(access_key, sign(secret_key, date_time))),
    )


def _malformed(rule: str) -> UnauthenticatedError:
    return UnauthenticatedError(what=_WHAT, rule=rule, reason="malformed")


def parse_authorization(value: str) -> Authorization:
    """Parse an ``authorization`` value; raise :class:`UnauthenticatedError` naming the rule.

    The three parts may come in any order, separated by commas with optional spaces. A
    ``Credential`` of ``AK/scope`` stands for ``AK`` (some clients append a scope).
    """
    if not isinstance(value, str):
        raise _malformed("must be text")
    if len(value) > MAX_AUTHORIZATION_LENGTH:
        raise _malformed(
            f"is {len(value):,} characters; at most {MAX_AUTHORIZATION_LENGTH:,} are allowed"
        )
    algorithm, sep, rest = value.partition(" ")
    if algorithm != ALGORITHM or not sep:
        raise _malformed(f"must start with {ALGORITHM} and a space, got {quoted(value, 24)}")
    parts: dict[str, str] = {}
    for raw in rest.split(","):
        part = raw.strip(" ")
        if not part:
            raise _malformed("has an empty part (two commas, or a comma at an end)")
        key, eq, part_value = part.partition("=")
        if not eq:
            raise _malformed(f"part {quoted(part)} must be NAME=VALUE")
        if key not in _PARTS:
            raise _malformed(f"has an unknown part {quoted(key)}; expected {', '.join(_PARTS)}")
        if key in parts:
            raise _malformed(f"{key} is given twice")
        parts[key] = part_value
    for key in _PARTS:
        if key not in parts:
            raise _malformed(f"{key} is missing")

    access_key = parts[_CREDENTIAL].partition("/")[0]
    rule = access_key_rule(access_key)
    if rule is not None:
        raise _malformed(f"the access key in Credential {rule}")

    headers = tuple(h.strip(" ").lower() for h in parts[_SIGNED_HEADERS].split(";"))
    if any(not h for h in headers):
        raise _malformed("SignedHeaders has an empty name")
    if DATE_TIME_KEY not in headers:
        raise _malformed(f"SignedHeaders must include {DATE_TIME_KEY}")

    signature = parts[_SIGNATURE]
    if not _HEX_RE.fullmatch(signature):
        raise _malformed(f"Signature must be 40 hex digits, got {quoted(signature, 48)}")
    return Authorization(access_key, headers, signature.lower())


def parse_date_time(value: str) -> datetime:
    """The UTC time an ``x-mq-date-time`` value stands for; raise naming the rule."""
    if not isinstance(value, str) or not _DATE_RE.fullmatch(value):
        shown = quoted(value) if isinstance(value, str) else "a value that is not text"
        raise UnauthenticatedError(
            what=DATE_TIME_KEY,
            rule=f"must be the UTC time as YYYYMMDDTHHMMSSZ, got {shown}",
            reason="bad_date",
        )
    try:
        return datetime.strptime(value, DATE_TIME_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        raise UnauthenticatedError(
            what=DATE_TIME_KEY, rule=f"{value!r} is not a valid date and time", reason="bad_date"
        ) from None
