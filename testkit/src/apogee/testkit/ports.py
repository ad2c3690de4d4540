"""Ports for tests: :func:`free_port` picks one; :data:`DEFAULT_PORTS` are the ones a test must
never bind, and :func:`holding` keeps them taken while tests run.

A test binds only ports it picked free (``127.0.0.1:0``, or :func:`free_port` when the address
must be known before the start), never a service's default, so the suite runs beside a local
cluster (``apogee cluster up``) and beside another run of itself. The root ``conftest.py``
holds every default port for the whole session, so a test that binds one fails at once.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable, Iterator

__all__ = ["DEFAULT_PORTS", "free_port", "holding"]

#: every port a service, the local cluster or its Prometheus binds when not told otherwise
#: (the settings' defaults, checked against them by the test kit's tests)
DEFAULT_PORTS: dict[str, int] = {
    "nameserver": 9876,
    "nameserver metrics": 9880,
    "broker": 10911,
    "broker metrics": 10912,
    "schedule": 9700,
    "schedule metrics": 9710,
    "txn-checker": 9701,
    "txn-checker metrics": 9711,
    "operator": 9702,
    "operator metrics": 9712,
    "console": 8080,
    "console metrics": 8081,
    "prometheus": 9090,
}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` free right now (``0.0.0.0``: free on every address)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _hold(port: int) -> socket.socket | None:
    """A socket bound to ``port`` on every address, else on 127.0.0.1; None when neither is
    free (someone else holds it: a running local cluster, say). Bound without listening, so a
    connection to it is refused as to a port nobody uses, and without ``SO_REUSEADDR`` or
    ``SO_REUSEPORT``, so no other socket can bind it."""
    for host in ("0.0.0.0", "127.0.0.1"):
        s = socket.socket()
        try:
            s.bind((host, port))
        except OSError:
            s.close()
            continue
        return s
    return None


@contextlib.contextmanager
def holding(ports: Iterable[int]) -> Iterator[list[int]]:
    """Hold each of ``ports`` that is free until the block ends; yields the ones held."""
    with contextlib.ExitStack() as stack:
        held = []
        for port in ports:
            s = _hold(port)
            if s is not None:
                stack.enter_context(s)
                held.append(port)
        yield held
