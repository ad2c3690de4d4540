"""Users and what they may do, read from a TOML file.

::

    [[users]]
    access_key = "orders-app"
    secret_key = "a long random string"
    admin = "none"        # none | read | write
    service = false       # true: an Apogee service identity
    [users.topics]
    "Orders" = "PUB|SUB"
    "Orders.*" = "SUB"
    "*" = "DENY"
    [users.groups]
    "billing-*" = "SUB"

Rights are ``PUB``, ``SUB``, ``PUB|SUB`` and ``DENY``; groups take only ``SUB`` and ``DENY``.
Keys are names or wildcard patterns (``*`` any run of characters, ``?`` one character; every
other character, ``[`` included, stands for itself; case-sensitive). The most specific match
decides a name: an exact name beats every pattern; among patterns the one with more literal
characters wins; patterns tied for the most literal characters combine, DENY over the union of
the rest. A name that nothing matches is refused.

``admin = "read"`` lets a user list, describe and look up; ``"write"`` also lets it create and
delete topics, reset offsets, redrive dead letters and resolve transactions. A ``service`` user
is the cluster's own identity (brokers registering with nameservers; the schedule service and
the transaction checker calling brokers): it has every right, and is the only one that may
register brokers.

Every problem in the file is an :class:`~apogee.common.errors.InvalidArgumentError` whose
``field`` is the place, e.g. ``users[2].topics."Orders*"`` (``users`` counted from 0), and whose
``details["source"]`` names the file. Secrets appear in no message and no ``repr``.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from apogee.common.auth.signature import access_key_rule, quoted
from apogee.common.errors import InvalidArgumentError, PermissionDeniedError

Kind = Literal["topic", "group"]
Right = Literal["PUB", "SUB"]
AdminLevel = Literal["none", "read", "write"]

PUB: Final = 1
SUB: Final = 2
DENY: Final = 4
_RIGHT_BITS: Final = {"PUB": PUB, "SUB": SUB}
ADMIN_LEVELS: Final[tuple[AdminLevel, ...]] = ("none", "read", "write")
_USER_KEYS: Final = ("access_key", "secret_key", "admin", "service", "topics", "groups")
#: Most names whose pattern decision one user remembers.
_DECISION_CACHE: Final = 1024
_generations = itertools.count(1)
_QUOTED_CHAR: Final = re.compile(r"^((?:Illegal|Found invalid) character) .*?(?= \(at line)", re.S)


def _place(prefix: str, key: str) -> str:
    return f"{prefix}.{json.dumps(key[:120], ensure_ascii=False)}"


def parse_rights(text: str, kind: Kind) -> int:
    """The bits a rights string stands for; ValueError with the rule if it is not one."""
    allowed = "PUB, SUB, DENY or PUB|SUB" if kind == "topic" else "SUB or DENY"
    words = [w.strip() for w in text.split("|")]
    bits = 0
    for word in words:
        bit = {"PUB": PUB, "SUB": SUB, "DENY": DENY}.get(word)
        if bit is None or bits & bit:
            bits = -1
            break
        bits |= bit
    if bits <= 0 or (bits & DENY and bits != DENY) or (kind == "group" and bits & PUB):
        raise ValueError(f"must be {allowed}, got {quoted(text)}")
    return bits


class Rules:
    """The rights one user has on the names of one kind, and how a name is decided."""

    __slots__ = ("_cache", "_exact", "_patterns", "text")

    def __init__(self, rules: Mapping[str, int]) -> None:
        self.text = dict(rules)
        self._exact: dict[str, int] = {}
        by_literals: dict[int, list[tuple[re.Pattern[str], int]]] = {}
        for pattern, bits in rules.items():
            if "*" in pattern or "?" in pattern:
                literal = len(pattern) - pattern.count("*") - pattern.count("?")
                # ``[`` escaped: only * and ? are wildcards here
                regex = re.compile(fnmatch.translate(pattern.replace("[", "[[]")))
                by_literals.setdefault(literal, []).append((regex, bits))
            else:
                self._exact[pattern] = bits
        self._patterns = tuple(tuple(by_literals[n]) for n in sorted(by_literals, reverse=True))
        self._cache: dict[str, int] = {}

    def decide(self, name: str) -> int:
        """The rights ``name`` has (0: none, by DENY or because nothing matches)."""
        bits = self._exact.get(name)
        if bits is not None:
            return 0 if bits & DENY else bits
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        decided = 0
        for tier in self._patterns:
            matched = [b for regex, b in tier if regex.match(name)]
            if matched:
                decided = 0 if any(b & DENY for b in matched) else _union(matched)
                break
        if len(self._cache) >= _DECISION_CACHE:
            self._cache.clear()
        self._cache[name] = decided
        return decided


def _union(bits: list[int]) -> int:
    out = 0
    for b in bits:
        out |= b
    return out


@dataclass(frozen=True, slots=True)
class User:
    """One user of the users file. ``secret_key`` is kept out of ``repr``."""

    access_key: str
    secret_key: str = field(repr=False)
    admin: AdminLevel = "none"
    service: bool = False
    topics: Rules = field(default_factory=lambda: Rules({}), repr=False, compare=False)
    groups: Rules = field(default_factory=lambda: Rules({}), repr=False, compare=False)

    def may(self, kind: Kind, name: str, right: Right) -> bool:
        """Whether this user has ``right`` on the topic or group ``name``."""
        if self.service:
            return True
        rules = self.topics if kind == "topic" else self.groups
        return bool(rules.decide(name) & _RIGHT_BITS[right])

    def may_admin(self, write: bool) -> bool:
        """Whether this user may use admin calls that read (``write=False``) or change."""
        if self.service or self.admin == "write":
            return True
        return self.admin == "read" and not write


def check(user: User, kind: Kind, name: str, right: Right) -> None:
    """Raise :class:`PermissionDeniedError` unless ``user`` has ``right`` on ``name``."""
    if not user.may(kind, name, right):
        raise PermissionDeniedError(
            what=f"user {user.access_key!r}", rule=f"has no {right} right on {kind} {name!r}"
        )


def check_admin(user: User, write: bool, action: str) -> None:
    """Raise unless ``user`` may make an admin call; ``action`` says what the call does
    (``"create topics"``) and ends the message: "... (needed to create topics)"."""
    if not user.may_admin(write):
        level = "write" if write else "read"
        raise PermissionDeniedError(
            what=f"user {user.access_key!r}",
            rule=f"has no admin {level} right (needed to {action})",
        )


def check_service(user: User, action: str) -> None:
    """Raise unless ``user`` is a service identity (``action``: e.g. ``"register a broker"``)."""
    if not user.service:
        raise PermissionDeniedError(
            what=f"user {user.access_key!r}",
            rule=f"is not an Apogee service identity (needed to {action})",
        )


class Users:
    """The users of one file, by access key. ``generation`` is unique to each parse, so caches
    keyed on it forget everything when the file is reloaded."""

    __slots__ = ("_by_key", "generation", "source")

    def __init__(self, users: Mapping[str, User], source: str) -> None:
        self._by_key = dict(users)
        self.source = source
        self.generation = next(_generations)

    def get(self, access_key: str) -> User | None:
        return self._by_key.get(access_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[User]:
        return iter(self._by_key.values())

    def __contains__(self, access_key: object) -> bool:
        return access_key in self._by_key

    def __repr__(self) -> str:
        return f"Users(source={self.source!r}, access_keys={sorted(self._by_key)!r})"

    @classmethod
    def load(cls, path: str | Path) -> Users:
        """Read and parse the users file at ``path``."""
        return cls.parse(read_text(path), str(path))

    @classmethod
    def parse(cls, text: str, source: str) -> Users:
        """Parse the text of a users file; ``source`` names it in errors."""
        doc = load_toml(text, source)
        for key in doc:
            if key != "users":
                raise _invalid(
                    source, json.dumps(key[:120]), "is not a known key; the file holds [[users]]"
                )
        entries = doc.get("users", [])
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise _invalid(source, "users", "must be an array of tables ([[users]])")
        users: dict[str, User] = {}
        first: dict[str, int] = {}
        for i, entry in enumerate(entries):
            user = _parse_user(entry, f"users[{i}]", source)
            if user.access_key in first:
                raise _invalid(
                    source,
                    f"users[{i}].access_key",
                    f"repeats {user.access_key!r}, already used by users[{first[user.access_key]}]",
                )
            first[user.access_key] = i
            users[user.access_key] = user
        return cls(users, source)


def _invalid(source: str, place: str, rule: str) -> InvalidArgumentError:
    return InvalidArgumentError(field=place, rule=rule, source=source)


def read_text(path: str | Path) -> str:
    """The UTF-8 text of ``path``; InvalidArgumentError naming it if it cannot be read."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise _invalid(str(path), str(path), f"cannot be read: {exc.strerror or exc}") from None
    return decode_text(data, str(path))


def decode_text(data: bytes, source: str) -> str:
    """``data`` as UTF-8; InvalidArgumentError naming ``source`` if it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(source, source, f"is not UTF-8 (byte {exc.start})") from None


def load_toml(text: str, source: str) -> dict[str, Any]:
    """``text`` as TOML; InvalidArgumentError naming ``source`` if it is not."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's sentences name a line and column and at most a key; two of them quote the
        # one character at fault, which could be part of a secret: that character is dropped
        sentence = _QUOTED_CHAR.sub(r"\1", str(exc))
        raise _invalid(source, source, f"is not valid TOML: {sentence}") from None
    except RecursionError:
        raise _invalid(source, source, "is not valid TOML: it nests too deeply") from None


def _parse_user(entry: dict[str, Any], place: str, source: str) -> User:
    for key in entry:
        if key not in _USER_KEYS:
            raise _invalid(
                source,
                _place(place, key),
                f"is not a known key; expected one of {', '.join(_USER_KEYS)}",
            )
    access_key = entry.get("access_key")
    if access_key is None:
        raise _invalid(source, f"{place}.access_key", "is missing")
    if not isinstance(access_key, str):
        raise _invalid(source, f"{place}.access_key", "must be a string")
    rule = access_key_rule(access_key)
    if rule is not None:
        raise _invalid(source, f"{place}.access_key", rule)
    secret_key = entry.get("secret_key")
    if secret_key is None:
        raise _invalid(source, f"{place}.secret_key", "is missing")
    if not isinstance(secret_key, str):
        raise _invalid(source, f"{place}.secret_key", "must be a string")
    if not secret_key:
        raise _invalid(source, f"{place}.secret_key", "must not be empty")
    admin = entry.get("admin", "none")
    if admin not in ADMIN_LEVELS:
        shown = quoted(admin) if isinstance(admin, str) else f"a {type(admin).__name__}"
        raise _invalid(source, f"{place}.admin", f"must be none, read or write, got {shown}")
    service = entry.get("service", False)
    if not isinstance(service, bool):
        raise _invalid(source, f"{place}.service", "must be true or false")
    return User(
        access_key=access_key,
        secret_key=secret_key,
        admin=admin,
        service=service,
        topics=_parse_rules(entry.get("topics", {}), "topic", f"{place}.topics", source),
        groups=_parse_rules(entry.get("groups", {}), "group", f"{place}.groups", source),
    )


def _parse_rules(table: object, kind: Kind, place: str, source: str) -> Rules:
    if not isinstance(table, dict):
        raise _invalid(source, place, 'must be a table of name = "RIGHTS"')
    rules: dict[str, int] = {}
    for pattern, text in table.items():
        where = _place(place, pattern)
        if not pattern:
            raise _invalid(source, where, "a name or pattern must not be empty")
        if not isinstance(text, str):
            raise _invalid(source, where, 'must be a string such as "SUB"')
        try:
            rules[pattern] = parse_rights(text, kind)
        except ValueError as exc:
            raise _invalid(source, where, str(exc)) from None
    return Rules(rules)


@dataclass(frozen=True, slots=True)
class Credentials:
    """The access key and secret key a client or service signs with; ``repr`` hides the
    secret. The file is TOML: ``access_key = "..."`` and ``secret_key = "..."``."""

    access_key: str
    secret_key: str = field(repr=False)

    @classmethod
    def load(cls, path: str | Path) -> Credentials:
        return cls.parse(read_text(path), str(path))

    @classmethod
    def parse(cls, text: str, source: str) -> Credentials:
        doc = load_toml(text, source)
        for key in doc:
            if key not in ("access_key", "secret_key"):
                raise _invalid(
                    source,
                    json.dumps(key[:120]),
                    "is not a known key; expected access_key and secret_key",
                )
        access_key, secret_key = doc.get("access_key"), doc.get("secret_key")
        if not isinstance(access_key, str):
            raise _invalid(source, "access_key", "must be a string")
        rule = access_key_rule(access_key)
        if rule is not None:
            raise _invalid(source, "access_key", rule)
        if not isinstance(secret_key, str) or not secret_key:
            raise _invalid(source, "secret_key", "must be a non-empty string")
        return cls(access_key, secret_key)
