"""The web console as a member of the local cluster (:mod:`apogee.local.cluster`): how it is
started (``python -m apogee_console --listen ... --namesrv ...``, its metrics address in
``APOGEE_CONSOLE_METRICS_LISTEN``), whether it is installed, whether it is healthy (an HTTP GET
of ``/healthz``, over HTTPS when its environment gives it a certificate) and its URL.

The console is an HTTP service, not a gRPC one: the other members' gRPC health check does not
apply to it.
"""

from __future__ import annotations

import importlib.util
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping

MODULE = "apogee_console"
#: its port (HTTP), and its metrics port, or the next free ones
PORT = 8080
METRICS_PORT = 8081
#: the settings prefix of its environment variables
ENV_PREFIX = "CONSOLE"


def available() -> bool:
    """Whether the console (the ``apogee-console`` distribution) is installed here."""
    return importlib.util.find_spec(MODULE) is not None


def argv(address: str, namesrv: str) -> list[str]:
    """The arguments after ``python`` that start it on ``address`` for ``namesrv``."""
    return ["-m", MODULE, "--listen", address, "--namesrv", namesrv]


def https(env: Mapping[str, str]) -> bool:
    """Whether it serves HTTPS with this environment (a certificate of its own)."""
    return bool(env.get(f"APOGEE_{ENV_PREFIX}_TLS_CERT_FILE"))


def url(address: str, env: Mapping[str, str]) -> str:
    """The URL of its pages."""
    return f"{'https' if https(env) else 'http'}://{address}/"


def healthy(address: str, env: Mapping[str, str], timeout: float = 1.0) -> bool:
    """Whether ``GET /healthz`` answers 200. Over HTTPS its certificate is checked against its
    own CA file (``APOGEE_CONSOLE_TLS_CA_FILE``, else the system's), not against a name: the
    check calls the address it listens on, which the certificate need not name."""
    context = None
    if https(env):
        context = ssl.create_default_context(
            cafile=env.get(f"APOGEE_{ENV_PREFIX}_TLS_CA_FILE") or None
        )
        context.check_hostname = False
    try:
        with urllib.request.urlopen(
            f"{url(address, env)}healthz", timeout=timeout, context=context
        ) as resp:
            status: int = resp.status
            return status == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False
