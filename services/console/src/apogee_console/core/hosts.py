"""The host names the console answers to: :class:`AllowedHosts`, from the ``allowed_hosts``
setting.

A browser sends the host of the page's address in the ``Host`` header, and the page's origin in
``Origin`` on an action. A DNS-rebinding page (a name of the attacker's, made to resolve to
127.0.0.1 or another address of the console) sends its own name there, so a console that
answers only the names it is reached by keeps such a page from reading it or acting on it.

Allowed are ``localhost``, ``127.0.0.1`` and ``[::1]`` always, the host of ``listen`` when it
is a specific address (not ``0.0.0.0`` or ``::``), and the entries of ``allowed_hosts``,
separated by commas:

- ``console.example.com``, ``10.0.0.5``, ``[fd00::5]`` (or ``fd00::5``): that host, on any
  port (a port given is ignored);
- ``*.example.com``: every name under ``example.com`` (not ``example.com`` itself);
- ``*``: any host, which turns the check off.

Names compare without regard to case or a trailing dot; IPv6 addresses in their short form.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Final
from urllib.parse import urlsplit

from apogee.common.errors import InvalidArgumentError

FIELD: Final = "allowed_hosts"
#: Always allowed: the console is reached by these on its own machine (and through
#: ``kubectl port-forward``).
LOOPBACK: Final = ("localhost", "127.0.0.1", "[::1]")
#: Listen hosts that are not a name of the console (every address of the machine).
WILDCARD_ADDRESSES: Final = ("0.0.0.0", "::", "")
_LABEL: Final = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
_PORT: Final = re.compile(r"[0-9]{1,5}")


def _ip(text: str) -> str | None:
    """``text`` as an IP address in the form the Host header carries it (IPv6 in brackets,
    short), or None when it is not one."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    return f"[{address.compressed}]" if address.version == 6 else address.compressed


def _name(text: str) -> str | None:
    """``text`` as a DNS name (lower case, no trailing dot), or None when it is not one."""
    name = text.lower().removesuffix(".")
    if not name or len(name) > 253:
        return None
    if all(_LABEL.fullmatch(label) for label in name.split(".")):
        return name
    return None


def host_of(value: str) -> str | None:
    """The host of a ``Host`` header (``name``, ``name:port``, ``[v6]``, ``[v6]:port``) in
    the form :class:`AllowedHosts` compares, or None when it names no host."""
    value = value.strip()
    if value.startswith("["):
        inside, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not (rest[0] == ":" and _PORT.fullmatch(rest[1:]))):
            return None
        return _ip(inside) if ":" in inside else None
    host, colon, port = value.partition(":")
    if colon and not _PORT.fullmatch(port):
        return None
    return _ip(host) or _name(host)


def _entry(text: str) -> str | None:
    """A setting's entry as it compares: a host (a bare IPv6 address allowed), or ``*.``
    and a name, or ``*``."""
    if text == "*":
        return text
    if text.startswith("*."):
        name = _name(text[2:])
        return f"*.{name}" if name else None
    if text.count(":") > 1 and not text.startswith("["):
        return _ip(text)
    return host_of(text)


def check_allowed_hosts(value: str) -> list[str]:
    """The entries of an ``allowed_hosts`` value; :class:`InvalidArgumentError` names the
    first that is not a host, ``*.`` and a name, or ``*``."""
    entries: list[str] = []
    for raw in value.split(","):
        text = raw.strip()
        if not text:
            continue
        entry = _entry(text)
        if entry is None:
            raise InvalidArgumentError(
                field=FIELD,
                rule=f"{text!r} is not a host name, an IP address, *.<domain> or *; separate "
                "entries with commas (for example localhost,console.example.com,*.example.org)",
            )
        entries.append(entry)
    return entries


class AllowedHosts:
    """The hosts a request's ``Host`` (and an action's ``Origin``) may name."""

    def __init__(self, entries: Iterable[str]) -> None:
        names = set(LOOPBACK)
        suffixes: set[str] = set()
        self.any = False
        for entry in entries:
            if entry == "*":
                self.any = True
            elif entry.startswith("*."):
                suffixes.add(entry[1:])
            else:
                names.add(entry)
        self.names = frozenset(names)
        self.suffixes = tuple(sorted(suffixes))

    @classmethod
    def of(cls, value: str, listen: str = "") -> AllowedHosts:
        """The hosts of an ``allowed_hosts`` value, with the host of ``listen`` when it is a
        specific address."""
        entries = check_allowed_hosts(value)
        host = listen.rpartition(":")[0]
        if host.strip("[]") not in WILDCARD_ADDRESSES:
            own = _entry(host)
            if own is not None:
                entries.append(own)
        return cls(entries)

    def allows(self, host: str | None) -> bool:
        """Whether ``host`` (from :func:`host_of`; None: none or not a host) is allowed."""
        if self.any:
            return True
        if host is None:
            return False
        return host in self.names or any(
            host.endswith(s) and len(host) > len(s) for s in self.suffixes
        )

    def allows_origin(self, origin: str) -> bool:
        """Whether an ``Origin`` header (``scheme://host[:port]``) names an allowed host over
        http or https; ``null`` (a sandboxed page, a file) never does, unless any host is."""
        if self.any:
            return True
        try:
            parts = urlsplit(origin.strip())
        except ValueError:
            return False
        if parts.scheme not in ("http", "https"):
            return False
        return self.allows(host_of(parts.netloc))
