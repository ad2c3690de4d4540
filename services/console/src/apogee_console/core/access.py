"""Who may use the console: login sessions, the console's own users file, access keys.

- :class:`SessionStore`: sessions by a random token (the ``apogee_session`` cookie), each with
  its own CSRF token, its user and role and an expiry; kept in memory (at most
  :data:`MAX_SESSIONS`, the oldest dropped first), time from an injected clock.
- :class:`ConsoleUsers`: the ``console_users_file`` (TOML)::

      [[users]]
      name = "alice"
      salt = "4f1c..."
      password_sha256 = "<hex of sha256(salt + password)>"
      role = "admin"          # or "read"

  read again when the file changes (a change that does not parse keeps the users loaded
  before, logged once); passwords compared with :func:`hmac.compare_digest`.
- :class:`AccessKeys`: the cluster's ``auth_users_file`` (:class:`apogee.common.auth.UsersFile`):
  an access key and its secret key log in; admin ``write`` (or a service identity) is role
  ``admin``, any other user role ``read``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
import tomllib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from apogee.common.auth import UsersFile
from apogee.common.errors import InvalidArgumentError

log = logging.getLogger(__name__)

Role = Literal["read", "admin"]
ROLES: Final = ("read", "admin")
#: Most sessions kept at once; beyond it the oldest is dropped.
MAX_SESSIONS: Final = 10_000
#: The users file is looked at (stat) at most this often.
CHECK_INTERVAL_S: Final = 1.0


def hash_password(salt: str, password: str) -> str:
    """Hex of sha256(salt + password), as the users file keeps it."""
    return hashlib.sha256((salt + password).encode()).hexdigest()


def users_entry(name: str, password: str, role: Role, salt: str | None = None) -> str:
    """A ``[[users]]`` entry of the console's users file."""
    salt = salt if salt is not None else secrets.token_hex(16)
    return (
        "[[users]]\n"
        f'name = "{name}"\n'
        f'salt = "{salt}"\n'
        f'password_sha256 = "{hash_password(salt, password)}"\n'
        f'role = "{role}"\n'
    )


@dataclass(frozen=True, slots=True)
class Session:
    token: str
    csrf: str
    user: str
    role: Role
    #: epoch seconds
    expires_at: float
    #: how the user logged in: "password", "access_key", or "open" (no login required)
    via: str


class SessionStore:
    """Login sessions in memory (see the module docstring)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def create(self, user: str, role: Role, via: str) -> Session:
        self._purge()
        s = Session(
            token=secrets.token_urlsafe(32),
            csrf=secrets.token_urlsafe(32),
            user=user,
            role=role,
            expires_at=self.clock() + self.ttl_s,
            via=via,
        )
        self._sessions[s.token] = s
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return s

    def get(self, token: str | None) -> Session | None:
        """The live session of ``token`` (None when unknown or expired)."""
        if not token:
            return None
        s = self._sessions.get(token)
        if s is None:
            return None
        if s.expires_at <= self.clock():
            del self._sessions[token]
            return None
        return s

    def delete(self, token: str | None) -> bool:
        return bool(token) and self._sessions.pop(token or "", None) is not None

    def _purge(self) -> None:
        now = self.clock()
        for token in [t for t, s in self._sessions.items() if s.expires_at <= now]:
            del self._sessions[token]

    def __len__(self) -> int:
        return len(self._sessions)


@dataclass(frozen=True, slots=True)
class ConsoleUser:
    name: str
    salt: str
    password_sha256: str
    role: Role


def parse_users(text: str, source: str) -> dict[str, ConsoleUser]:
    """The users of a console users file; :class:`InvalidArgumentError` names the place."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgumentError(field=source, rule=f"is not TOML: {exc}") from None
    entries = data.get("users", [])
    if not isinstance(entries, list):
        raise InvalidArgumentError(field=f"{source}: users", rule="must be an array of tables")
    out: dict[str, ConsoleUser] = {}
    for i, e in enumerate(entries):
        place = f"{source}: users[{i}]"
        if not isinstance(e, dict):
            raise InvalidArgumentError(field=place, rule="must be a table")
        unknown = set(e) - {"name", "salt", "password_sha256", "role"}
        if unknown:
            raise InvalidArgumentError(
                field=f"{place}.{sorted(unknown)[0]}", rule="is not a users setting"
            )
        for key in ("name", "salt", "password_sha256"):
            if not isinstance(e.get(key), str) or not e[key]:
                raise InvalidArgumentError(
                    field=f"{place}.{key}", rule="must be a non-empty string"
                )
        digest = e["password_sha256"].lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise InvalidArgumentError(
                field=f"{place}.password_sha256", rule="must be 64 hex digits (a SHA-256)"
            )
        role = e.get("role", "read")
        if role not in ROLES:
            raise InvalidArgumentError(field=f"{place}.role", rule=f"{role!r} is not read or admin")
        if e["name"] in out:
            raise InvalidArgumentError(field=f"{place}.name", rule=f"{e['name']!r} is given twice")
        out[e["name"]] = ConsoleUser(e["name"], e["salt"], digest, role)
    return out


class ConsoleUsers:
    """The console's users file, reloaded when it changes (see the module docstring). The
    first load raises :class:`InvalidArgumentError` (or OSError, named)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        try:
            self._users, self._stamp = self._read()
        except OSError as exc:
            raise InvalidArgumentError(
                field="console_users_file", rule=f"{self.path}: {exc.strerror or exc}"
            ) from None
        self._checked = clock()
        self._failed: object = None
        self.reloads = 0

    def _read(self) -> tuple[dict[str, ConsoleUser], tuple[int, int, int]]:
        st = os.stat(self.path)
        text = self.path.read_text(encoding="utf-8")
        return parse_users(text, str(self.path)), (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> dict[str, ConsoleUser]:
        now = self._clock()
        if now - self._checked >= CHECK_INTERVAL_S:
            with self._lock:
                self._checked = now
                self._reload_locked()
        return self._users

    def _reload_locked(self) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            users, stamp = self._read()
        except (OSError, InvalidArgumentError, UnicodeDecodeError) as exc:
            if self._failed != str(exc):
                self._failed = str(exc)
                log.error(
                    "console users file %s: %s; keeping the %d users loaded before",
                    self.path,
                    exc,
                    len(self._users),
                )
            return
        self._users, self._stamp, self._failed = users, stamp, None
        self.reloads += 1
        log.info("console users file %s reloaded: %d users", self.path, len(users))

    def verify(self, name: str, password: str) -> Role | None:
        """The role of ``name`` when ``password`` is right, else None."""
        user = self.current().get(name)
        # compare something of the same cost whether or not the user exists
        salt, digest = (user.salt, user.password_sha256) if user else ("", "0" * 64)
        ok = hmac.compare_digest(hash_password(salt, password), digest)
        return user.role if user is not None and ok else None


class AccessKeys:
    """Login with an access key of the cluster's users file (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.file = UsersFile(path)

    def verify(self, access_key: str, secret_key: str) -> Role | None:
        user = self.file.current().get(access_key)
        expected = user.secret_key if user is not None else secrets.token_hex(16)
        ok = hmac.compare_digest(expected.encode(), secret_key.encode())
        if user is None or not ok:
            return None
        return "admin" if user.service or user.admin == "write" else "read"
