"""Checking who signed a call: the users file as it changes, and the authenticator.

:class:`UsersFile` holds the parsed users and notices when the file changes (it is a Kubernetes
Secret, swapped by a symlink, or a file an operator edits). :class:`Authenticator` turns a
call's metadata into the :class:`~apogee.common.auth.users.User` who signed it, or raises
:class:`~apogee.common.errors.UnauthenticatedError` with a sentence the caller can act on and
``details["reason"]`` for metrics:

==============  ==========================================================
reason          when
==============  ==========================================================
missing         no ``authorization`` entry: the client signs nothing
malformed       the ``authorization`` value does not parse
unknown_key     no user has the access key
bad_date        ``x-mq-date-time`` is missing or not a UTC time
bad_signature   the signature is not the one the user's secret key makes
clock_skew      the signing time is further from the server's than allowed
==============  ==========================================================

Verified (authorization, date-time) pairs are remembered briefly, keyed on the users' generation,
so a client sending many calls within one second costs one HMAC, and a reload forgets them all.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Final, Protocol

from apogee.common.auth.signature import (
    AUTHORIZATION_KEY,
    DATE_TIME_KEY,
    MAX_AUTHORIZATION_LENGTH,
    parse_authorization,
    parse_date_time,
    sign,
)
from apogee.common.auth.users import User, Users, decode_text
from apogee.common.errors import ApogeeError, UnauthenticatedError

log = logging.getLogger(__name__)

#: Most verified (authorization, date-time) pairs remembered.
CACHE_SIZE: Final = 4096
REASONS: Final = (
    "missing",
    "malformed",
    "unknown_key",
    "bad_date",
    "bad_signature",
    "clock_skew",
)

_Stamp = tuple[int, int, int, int]


def _stamp(st: os.stat_result) -> _Stamp:
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


class UsersSource(Protocol):
    """Where an :class:`Authenticator` gets the users: a :class:`UsersFile`, or
    :class:`FixedUsers`."""

    def current(self) -> Users: ...


class FixedUsers:
    """Users that never change (tests, and embedding without a file)."""

    def __init__(self, users: Users) -> None:
        self.users = users

    def current(self) -> Users:
        return self.users


class UsersFile:
    """The users of the file at ``path``, reloaded when it changes.

    :meth:`current` stats the file (following symlinks) at most once per ``check_interval_s``
    of ``clock`` and reloads it when its mtime, size or inode changed. A change that does not
    parse keeps the users loaded before and is logged once. The first load raises.
    """

    def __init__(
        self,
        path: str | Path,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.check_interval_s = check_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._users, self._stamp = self._read()
        self._checked = clock()
        self._last_failure: tuple[str, object] | None = None
        #: reloads that succeeded, and checks that failed (for metrics and tests)
        self.reloads = 0
        self.failures = 0

    def _read(self) -> tuple[Users, _Stamp]:
        with self.path.open("rb") as f:
            stamp = _stamp(os.fstat(f.fileno()))
            data = f.read()
        return Users.parse(decode_text(data, str(self.path)), str(self.path)), stamp

    def current(self) -> Users:
        """The users as of the latest successful load."""
        now = self._clock()
        if now - self._checked < self.check_interval_s:
            return self._users
        with self._lock:
            if now - self._checked >= self.check_interval_s:
                self._checked = now
                self._check_locked()
        return self._users

    def _check_locked(self) -> None:
        try:
            stamp = _stamp(os.stat(self.path))
        except OSError as exc:
            self._failed(("stat", exc.errno), f"cannot be read: {exc.strerror or exc}")
            return
        if stamp == self._stamp:
            if self._last_failure is not None and self._last_failure[0] != "parse":
                self._last_failure = None  # readable again: a later failure is news
            return
        try:
            users, stamp = self._read()
        except OSError as exc:
            self._failed(("read", exc.errno), f"cannot be read: {exc.strerror or exc}")
            return
        except ApogeeError as exc:
            # remember the broken file's stamp: it is not parsed again until it changes
            self._stamp = stamp
            self._failed(("parse", stamp), str(exc))
            return
        self._users, self._stamp = users, stamp
        self.reloads += 1
        self._last_failure = None
        log.info("users file %s reloaded: %d users", self.path, len(users))

    def _failed(self, what: tuple[str, object], sentence: str) -> None:
        self.failures += 1
        if self._last_failure != what:
            self._last_failure = what
            log.error(
                "users file %s: %s; keeping the %d users loaded before",
                self.path,
                sentence,
                len(self._users),
            )


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _refuse(reason: str, what: str, rule: str) -> UnauthenticatedError:
    return UnauthenticatedError(what=what, rule=rule, reason=reason)


class Authenticator:
    """Who signed a call, from its metadata (see the module docstring for the refusals)."""

    def __init__(
        self,
        users: UsersSource,
        max_skew_s: float = 900.0,
        now: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.users = users
        self.max_skew_s = max_skew_s
        self._now = now
        self._generation = 0
        # (authorization, date-time) -> (user, signing time); only verified pairs
        self._verified: dict[tuple[str, str], tuple[User, datetime]] = {}

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> User:
        """The user who signed the call whose metadata this is; raise if none did."""
        authorization: str | bytes | None = None
        date_time: str | bytes | None = None
        for key, value in metadata:
            if key == AUTHORIZATION_KEY:
                if authorization is not None:
                    raise _refuse("malformed", "authorization header", "is sent more than once")
                authorization = value
            elif key == DATE_TIME_KEY:
                if date_time is not None:
                    raise _refuse("bad_date", DATE_TIME_KEY, "is sent more than once")
                date_time = value
        if authorization is None:
            raise _refuse(
                "missing",
                "the request is not signed",
                "set an access key and secret key in the client",
            )
        auth_text = _text(authorization, "malformed", "authorization header")
        date_text = None if date_time is None else _text(date_time, "bad_date", DATE_TIME_KEY)

        users = self.users.current()
        if users.generation != self._generation:
            self._verified.clear()
            self._generation = users.generation
        if date_text is not None:
            hit = self._verified.get((auth_text, date_text))
            if hit is not None:
                self._check_skew(date_text, hit[1])
                return hit[0]

        auth = parse_authorization(auth_text)
        user = users.get(auth.access_key)
        if user is None:
            raise _refuse(
                "unknown_key",
                f"access key {auth.access_key!r}",
                "is not known to this server: check the client's access key, or add it to "
                "the users file",
            )
        if date_text is None:
            raise _refuse(
                "bad_date", DATE_TIME_KEY, "is missing: a signed request carries its signing time"
            )
        signed_at = parse_date_time(date_text)
        if not hmac.compare_digest(sign(user.secret_key, date_text), auth.signature):
            raise _refuse(
                "bad_signature",
                f"the signature does not match access key {auth.access_key!r}",
                "check its secret key",
            )
        self._check_skew(date_text, signed_at)
        if len(self._verified) >= CACHE_SIZE:
            try:  # the oldest goes (dicts keep insertion order)
                del self._verified[next(iter(self._verified))]
            except (KeyError, RuntimeError, StopIteration):  # another thread got there first
                self._verified.clear()
        self._verified[(auth_text, date_text)] = (user, signed_at)
        return user

    def _check_skew(self, date_text: str, signed_at: datetime) -> None:
        skew = (self._now() - signed_at).total_seconds()
        if abs(skew) > self.max_skew_s:
            direction = "behind" if skew > 0 else "ahead of"
            raise _refuse(
                "clock_skew",
                f"{DATE_TIME_KEY} {date_text} is {abs(skew):,.0f} s from the server's clock",
                f"the limit is {self.max_skew_s:,.0f} s; the client's clock is {direction} "
                "the server's",
            )


def _text(value: str | bytes, reason: str, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes) and len(value) <= MAX_AUTHORIZATION_LENGTH:
        try:
            return value.decode("ascii")
        except UnicodeDecodeError:
            pass
    raise _refuse(reason, what, "must be ASCII text")
