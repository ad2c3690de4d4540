"""Who may use the console: login sessions, the console's own users file, access keys.

- :class:`SessionStore`: sessions by a random token (the ``apogee_session`` cookie), each with
  its own CSRF token, its user and role and an expiry; kept in memory, time from an injected
  clock. At most ``per_user`` live sessions of one user (a further login drops that user's own
  oldest) and ``limit`` in all: beyond it :class:`SessionsFull`, never another user's session
  dropped.
- :class:`ConsoleUsers`: the ``console_users_file`` (TOML)::

      [[users]]
      name = "alice"
      password = "scrypt$n=16384,r=8,p=1$<salt, base64>$<key, base64>"
      role = "admin"          # or "read"

  ``password`` (:class:`ScryptHash`) records scrypt's cost parameters ``n``, ``r``, ``p``, the
  random salt and the key derived from the password (:func:`users_entry` and
  ``python -m apogee_console.passwd`` make it). The older form, ``salt`` and
  ``password_sha256`` = hex of sha256(salt + password), still logs in, with a warning per such
  user (once) to make its entry again; the console never rewrites the file. Every check costs
  one scrypt of the file's parameters, whether the user exists, has the older form, or not.
  The file is read again when it changes (a change that does not parse keeps the users loaded
  before, logged once); keys compared with :func:`hmac.compare_digest`.
- :class:`AccessKeys`: the cluster's ``auth_users_file`` (:class:`apogee.common.auth.UsersFile`):
  an access key and its secret key log in; admin ``write`` (or a service identity) is role
  ``admin``, any other user role ``read``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
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
#: Most live sessions kept at once (beyond: :class:`SessionsFull`).
MAX_SESSIONS: Final = 10_000
#: Most live sessions of one user (beyond: that user's oldest is dropped).
SESSIONS_PER_USER: Final = 20
#: The users file is looked at (stat) at most this often.
CHECK_INTERVAL_S: Final = 1.0

#: scrypt's parameters of new entries: about 50 ms of CPU and 16 MiB (128·n·r bytes) a check.
SCRYPT_N: Final = 16384
SCRYPT_R: Final = 8
SCRYPT_P: Final = 1
SALT_BYTES: Final = 16
KEY_BYTES: Final = 32
#: The most memory one check may take (128·n·r bytes); larger parameters are refused.
MAX_SCRYPT_MEMORY: Final = 64 * 1024 * 1024
PASSWORD_FORMAT: Final = "scrypt$n=<N>,r=<R>,p=<P>$<salt, base64>$<key, base64>"
_PASSWORD_RE: Final = re.compile(
    r"scrypt\$n=(?P<n>[0-9]{1,8}),r=(?P<r>[0-9]{1,3}),p=(?P<p>[0-9]{1,3})"
    r"\$(?P<salt>[A-Za-z0-9+/=]+)\$(?P<key>[A-Za-z0-9+/=]+)"
)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@dataclass(frozen=True, slots=True)
class ScryptHash:
    """A password as the users file keeps it (see the module docstring)."""

    n: int
    r: int
    p: int
    salt: bytes
    key: bytes

    def __str__(self) -> str:
        return f"scrypt$n={self.n},r={self.r},p={self.p}${_b64(self.salt)}${_b64(self.key)}"

    def derive(self, password: str) -> bytes:
        """scrypt of ``password`` with these parameters and salt (the CPU time and memory
        of a check: run it off the event loop)."""
        return hashlib.scrypt(
            password.encode(),
            salt=self.salt,
            n=self.n,
            r=self.r,
            p=self.p,
            dklen=len(self.key),
            # OpenSSL's own count of what it needs (128·r·(n + 2 + p)), and some room
            maxmem=128 * self.r * (self.n + 2 + self.p) + 1024 * 1024,
        )

    def matches(self, password: str) -> bool:
        return hmac.compare_digest(self.derive(password), self.key)

    @classmethod
    def new(
        cls, password: str, *, n: int = SCRYPT_N, r: int = SCRYPT_R, p: int = SCRYPT_P
    ) -> ScryptHash:
        """The hash of ``password`` with a new random salt."""
        salt = secrets.token_bytes(SALT_BYTES)
        unkeyed = cls(n, r, p, salt, bytes(KEY_BYTES))
        return cls(n, r, p, salt, unkeyed.derive(password))

    @classmethod
    def parse(cls, text: str, field: str) -> ScryptHash:
        """The hash written as ``text``; :class:`InvalidArgumentError` names ``field`` and the
        rule it breaks."""
        m = _PASSWORD_RE.fullmatch(text)
        if m is None:
            raise InvalidArgumentError(
                field=field,
                rule=f"must be {PASSWORD_FORMAT}: python -m apogee_console.passwd prints it",
            )
        n, r, p = int(m["n"]), int(m["r"]), int(m["p"])
        if n < SCRYPT_N or n & (n - 1):
            raise InvalidArgumentError(
                field=field, rule=f"n must be a power of two from {SCRYPT_N}, got {n}"
            )
        if r < 1 or 128 * n * r > MAX_SCRYPT_MEMORY:
            raise InvalidArgumentError(
                field=field,
                rule=f"r must be 1 or more and 128·n·r (the memory of a check) at most "
                f"{MAX_SCRYPT_MEMORY // 2**20} MiB, got n={n}, r={r}",
            )
        if not 1 <= p <= 16:
            raise InvalidArgumentError(field=field, rule=f"p must be from 1 to 16, got {p}")
        try:
            salt = base64.b64decode(m["salt"], validate=True)
            key = base64.b64decode(m["key"], validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgumentError(
                field=field, rule="the salt and the key must be base64 (with its = padding)"
            ) from None
        if len(salt) < 8:
            raise InvalidArgumentError(field=field, rule="the salt must be 8 bytes or more")
        if not 16 <= len(key) <= 64:
            raise InvalidArgumentError(field=field, rule="the key must be 16 to 64 bytes")
        return cls(n, r, p, salt, key)


def hash_password(password: str) -> str:
    """``password`` as the users file keeps it (scrypt, a new random salt)."""
    return str(ScryptHash.new(password))


def legacy_sha256(salt: str, password: str) -> str:
    """Hex of sha256(salt + password): ``password_sha256`` of the users file's older form."""
    return hashlib.sha256((salt + password).encode()).hexdigest()


def users_entry(name: str, password: str, role: Role) -> str:
    """A ``[[users]]`` entry of the console's users file."""
    return f'[[users]]\nname = "{name}"\npassword = "{hash_password(password)}"\nrole = "{role}"\n'


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


class SessionsFull(Exception):
    """No room for one more session (:attr:`SessionStore.limit` live ones)."""

    def __init__(self, limit: int, retry_after_s: float) -> None:
        super().__init__(f"{limit} sessions are live")
        self.limit = limit
        #: seconds until the oldest session expires
        self.retry_after_s = retry_after_s


class SessionStore:
    """Login sessions in memory (see the module docstring). A user is its name and how it
    logged in (a console user and an access key of the same name are two users)."""

    def __init__(
        self,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
        *,
        per_user: int = SESSIONS_PER_USER,
        limit: int = MAX_SESSIONS,
    ) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.per_user = per_user
        self.limit = limit
        #: oldest first (all have the same lifetime: the first to expire too)
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._by_user: dict[tuple[str, str], OrderedDict[str, None]] = {}

    def create(self, user: str, role: Role, via: str) -> Session:
        """A new session of ``user``: its own oldest dropped when it has ``per_user`` already;
        :class:`SessionsFull` when ``limit`` sessions are live."""
        now = self.clock()
        self._purge(now)
        mine = self._by_user.get((via, user))
        if mine is not None and len(mine) >= self.per_user:
            while len(mine) >= self.per_user:
                self._drop(next(iter(mine)))
        elif len(self._sessions) >= self.limit:
            oldest = next(iter(self._sessions.values()))
            raise SessionsFull(self.limit, max(1.0, oldest.expires_at - now))
        s = Session(
            token=secrets.token_urlsafe(32),
            csrf=secrets.token_urlsafe(32),
            user=user,
            role=role,
            expires_at=now + self.ttl_s,
            via=via,
        )
        self._sessions[s.token] = s
        self._by_user.setdefault((via, user), OrderedDict())[s.token] = None
        return s

    def get(self, token: str | None) -> Session | None:
        """The live session of ``token`` (None when unknown or expired)."""
        if not token:
            return None
        s = self._sessions.get(token)
        if s is None:
            return None
        if s.expires_at <= self.clock():
            self._drop(token)
            return None
        return s

    def delete(self, token: str | None) -> bool:
        return bool(token) and self._drop(token or "")

    def _drop(self, token: str) -> bool:
        s = self._sessions.pop(token, None)
        if s is None:
            return False
        mine = self._by_user.get((s.via, s.user))
        if mine is not None:
            mine.pop(token, None)
            if not mine:
                del self._by_user[(s.via, s.user)]
        return True

    def _purge(self, now: float) -> None:
        """Drop the expired sessions at the front (the oldest)."""
        while self._sessions:
            token, s = next(iter(self._sessions.items()))
            if s.expires_at > now:
                return
            self._drop(token)

    def __len__(self) -> int:
        return len(self._sessions)


@dataclass(frozen=True, slots=True)
class ConsoleUser:
    name: str
    role: Role
    #: None for an entry of the older form (``salt`` and ``password_sha256``)
    password: ScryptHash | None = None
    salt: str = ""
    password_sha256: str = ""

    @property
    def legacy(self) -> bool:
        """An entry of the older form (one salted SHA-256), to be made again."""
        return self.password is None


_LEGACY_KEYS: Final = ("salt", "password_sha256")


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
        unknown = set(e) - {"name", "password", *_LEGACY_KEYS, "role"}
        if unknown:
            raise InvalidArgumentError(
                field=f"{place}.{sorted(unknown)[0]}", rule="is not a users setting"
            )
        legacy = any(k in e for k in _LEGACY_KEYS)
        if legacy and "password" in e:
            raise InvalidArgumentError(
                field=f"{place}.password_sha256",
                rule="give password alone: salt and password_sha256 are its older form",
            )
        for key in ("name", *(_LEGACY_KEYS if legacy else ("password",))):
            if not isinstance(e.get(key), str) or not e[key]:
                raise InvalidArgumentError(
                    field=f"{place}.{key}",
                    rule="must be a non-empty string (python -m apogee_console.passwd NAME "
                    "prints an entry)",
                )
        role = e.get("role", "read")
        if role not in ROLES:
            raise InvalidArgumentError(field=f"{place}.role", rule=f"{role!r} is not read or admin")
        if e["name"] in out:
            raise InvalidArgumentError(field=f"{place}.name", rule=f"{e['name']!r} is given twice")
        if legacy:
            digest = e["password_sha256"].lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise InvalidArgumentError(
                    field=f"{place}.password_sha256", rule="must be 64 hex digits (a SHA-256)"
                )
            user = ConsoleUser(e["name"], role, salt=e["salt"], password_sha256=digest)
        else:
            user = ConsoleUser(
                e["name"], role, ScryptHash.parse(e["password"], f"{place}.password")
            )
        out[e["name"]] = user
    return out


def _decoy(users: dict[str, ConsoleUser]) -> ScryptHash:
    """A hash no password matches, of the parameters of the file's first scrypt entry (the
    defaults without one): what a check of an unknown or older-form user costs."""
    like = next((u.password for u in users.values() if u.password is not None), None)
    n, r, p, key = (
        (like.n, like.r, like.p, len(like.key))
        if like
        else (SCRYPT_N, SCRYPT_R, SCRYPT_P, KEY_BYTES)
    )
    return ScryptHash(n, r, p, secrets.token_bytes(SALT_BYTES), secrets.token_bytes(key))


class ConsoleUsers:
    """The console's users file, reloaded when it changes (see the module docstring). The
    first load raises :class:`InvalidArgumentError` (or OSError, named). :meth:`verify` may be
    called from any thread."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        #: users of the older form warned about
        self._warned: set[str] = set()
        try:
            users, self._stamp = self._read()
        except OSError as exc:
            raise InvalidArgumentError(
                field="console_users_file", rule=f"{self.path}: {exc.strerror or exc}"
            ) from None
        self._use(users)
        self._checked = clock()
        self._failed: object = None
        self.reloads = 0

    def _read(self) -> tuple[dict[str, ConsoleUser], tuple[int, int, int]]:
        st = os.stat(self.path)
        text = self.path.read_text(encoding="utf-8")
        return parse_users(text, str(self.path)), (st.st_mtime_ns, st.st_size, st.st_ino)

    def _use(self, users: dict[str, ConsoleUser]) -> None:
        for u in users.values():
            if u.legacy and u.name not in self._warned:
                self._warned.add(u.name)
                log.warning(
                    "console users file %s: user %r has the older password form (salt and "
                    "password_sha256, one salted SHA-256: fast to crack); it still logs in, "
                    "but replace its entry with what `python -m apogee_console.passwd %s "
                    "--role %s` prints (scrypt)",
                    self.path,
                    u.name,
                    u.name,
                    u.role,
                )
        self._users, self._decoy = users, _decoy(users)

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
        self._use(users)
        self._stamp, self._failed = stamp, None
        self.reloads += 1
        log.info("console users file %s reloaded: %d users", self.path, len(users))

    def verify(self, name: str, password: str) -> Role | None:
        """The role of ``name`` when ``password`` is right, else None. Blocks for one scrypt
        (about 50 ms) whatever the user: run it off the event loop."""
        user = self.current().get(name)
        if user is not None and user.password is not None:
            ok = user.password.matches(password)
        else:
            # an unknown user, or one of the older form, costs one scrypt all the same
            self._decoy.matches(password)
            ok = user is not None and hmac.compare_digest(
                legacy_sha256(user.salt, password), user.password_sha256
            )
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
