"""The console's settings: defaults < config file < ``APOGEE_CONSOLE_*`` < flags.

A config file holds the fields at top level or under a ``[console]`` table::

    [console]
    listen = "0.0.0.0:8080"
    namesrv = "ns-0.apogee-ns:9876;ns-1.apogee-ns:9876"
    console_users_file = "/etc/apogee/console-users.toml"

Login is required when ``auth_enabled`` is true or ``console_users_file`` is set; otherwise the
console runs "open" (every visitor is an admin; the pages say so).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apogee.common.configdoc import render_class
from apogee.common.errors import InvalidArgumentError
from apogee.common.logs import check_log_level
from apogee.common.settings import (
    SecuritySettings,
    check_address,
    check_metrics_listen,
    doc,
    load,
    parse_nameservers,
)
from apogee_console.core.hosts import check_allowed_hosts


@dataclass(frozen=True, slots=True)
class ConsoleSettings(SecuritySettings):
    listen: str = doc(
        "127.0.0.1:8080",
        "host:port the console's HTTP server listens on (HTTPS when `tls_cert_file` and "
        "`tls_key_file` are set): the pages, the REST API under `/api/v1`, `/healthz` and "
        "`/readyz`. Port 0 picks a free port.",
    )
    namesrv: str = doc(
        "127.0.0.1:9876",
        "Nameservers the brokers are found through, `host:port` separated by `;`.",
    )
    allowed_hosts: str = doc(
        "",
        "Host names the console answers to besides `localhost`, `127.0.0.1`, `[::1]` and the "
        "host of `listen` (unless 0.0.0.0 or ::), separated by commas, a port ignored: "
        "`console.example.com`, `*.example.com` (every name under example.com) or `*` (any "
        "host: turns the check off). A request whose `Host` header (or an action's `Origin`) "
        "names another host is refused (421; 403 for the Origin), which keeps a DNS-rebinding "
        "web page out; `/healthz` and `/readyz` answer any host.",
    )
    metrics_listen: str = doc(
        "127.0.0.1:8081",
        "host:port of the HTTP server that serves the console's own Prometheus metrics at "
        "`/metrics` (requests by route and status, latency, logins, refusals). Port 0 picks a "
        "free port; empty: no metrics endpoint.",
    )
    prometheus_url: str = doc(
        "",
        "Base URL of a Prometheus server (`http://prometheus:9090`) whose HTTP API the charts "
        "read rates, lag and backlog from (`query_range`). Empty: the console samples them "
        "itself every `sample_interval_s` and keeps the last hour in memory.",
    )
    sample_interval_s: float = doc(
        5.0,
        "Seconds between the console's own samples of topic offsets, group lag and schedule "
        "backlog (when `prometheus_url` is empty); 0.5 to 3600.",
    )
    session_ttl_s: float = doc(
        3600.0, "Seconds a login session lasts after it is created; 60 to 604800."
    )
    console_users_file: str = doc(
        "",
        "TOML file of the console's own users (`[[users]]` with `name`, `password` = "
        "`scrypt$n=16384,r=8,p=1$<salt>$<key>` (base64) and `role` = `read` or `admin`; "
        "`python -m apogee_console.passwd` prints an entry; the older `salt` + "
        "`password_sha256` still log in, with a warning to make the entry again: "
        "docs/security.md). Read again when it changes. Set: login is required.",
    )
    request_timeout_s: float = doc(
        5.0, "Deadline in seconds of every call the console makes to the cluster; 0.1 to 300."
    )
    log_level: str = doc("INFO", "Log level: DEBUG, INFO, WARNING, ERROR or CRITICAL.")
    login_user_failures: int = doc(
        5,
        "Failed logins of one user name (or access key) within `login_window_s` that lock it "
        "out: every login as it is then refused with 429 and `Retry-After`, before the password "
        "is checked (the right one too), for `login_lockout_s`; 1 to 1000.",
    )
    login_address_failures: int = doc(
        50,
        "Failed logins from one client address (the peer's; `X-Forwarded-For` is not read) "
        "within `login_window_s` that lock the address out likewise; 1 to 100000.",
    )
    login_window_s: float = doc(
        900.0,
        "Seconds failed logins are counted over, from the first; a quiet window (no failure) "
        "also forgets past lock-outs; 1 to 86400.",
    )
    login_lockout_s: float = doc(
        60.0,
        "Seconds of a first lock-out; each further one before a quiet `login_window_s` "
        "doubles it, up to `login_lockout_max_s`; 1 to 86400.",
    )
    login_lockout_max_s: float = doc(
        900.0,
        "Longest lock-out in seconds: attempts while locked out do not lengthen it, so the "
        "right password works again at most this long after it began; `login_lockout_s` to "
        "86400.",
    )
    sessions_per_user: int = doc(
        20,
        "Live login sessions of one user at most: a further login drops that user's own "
        "oldest session (never another user's); 1 to 10000.",
    )
    max_sessions: int = doc(
        10_000,
        "Live login sessions in all at most: beyond it a login is refused (503 with "
        "`Retry-After`) until one ends, and nobody is logged out; 1 to 1000000.",
    )

    def __post_init__(self) -> None:
        check_address("listen", self.listen, allow_port_zero=True)
        check_allowed_hosts(self.allowed_hosts)
        check_metrics_listen(self.metrics_listen)
        if not parse_nameservers(self.namesrv):
            raise InvalidArgumentError(field="namesrv", rule="must name at least one host:port")
        if self.prometheus_url and not self.prometheus_url.startswith(("http://", "https://")):
            raise InvalidArgumentError(
                field="prometheus_url",
                rule=f"{self.prometheus_url!r} must start with http:// or https://",
            )
        for name, low, high in (
            ("sample_interval_s", 0.5, 3600.0),
            ("session_ttl_s", 60.0, 604_800.0),
            ("request_timeout_s", 0.1, 300.0),
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and low <= value <= high):
                raise InvalidArgumentError(
                    field=name, rule=f"must be from {low:g} to {high:g}, got {value}"
                )
        object.__setattr__(self, "log_level", check_log_level(self.log_level))
        # the console signs its calls with auth_credentials_file when auth_enabled
        self.check_security(calls_services=True)
        self._check_logins()

    def _check_logins(self) -> None:
        for name, low, high in (
            ("login_user_failures", 1, 1000),
            ("login_address_failures", 1, 100_000),
            ("login_window_s", 1.0, 86_400.0),
            ("login_lockout_s", 1.0, 86_400.0),
            ("login_lockout_max_s", self.login_lockout_s, 86_400.0),
            ("sessions_per_user", 1, 10_000),
            ("max_sessions", 1, 1_000_000),
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and low <= value <= high):
                rule = f"must be from {low:g} to {high:g}, got {value}"
                if name == "login_lockout_max_s":
                    rule += " (login_lockout_s at least)"
                raise InvalidArgumentError(field=name, rule=rule)

    @property
    def log_level_number(self) -> int:
        return logging.getLevelNamesMapping()[self.log_level]

    @property
    def login_required(self) -> bool:
        """Whether visitors must log in (else the console runs open: everyone is admin)."""
        return self.auth_enabled or bool(self.console_users_file)

    @property
    def https(self) -> bool:
        return bool(self.tls_cert_file)


def load_settings(
    config_file: Path | None = None, env: Mapping[str, str] | None = None, **overrides: Any
) -> ConsoleSettings:
    """Defaults, then ``config_file``, then ``env`` (the process environment when None), then
    ``overrides`` (command-line flags; None means not given)."""
    return load(
        ConsoleSettings, "console", config_file, os.environ if env is None else env, **overrides
    )


def config_reference() -> str:
    """This service's section of docs/configuration.md."""
    return render_class(
        ConsoleSettings,
        "Console (`apogee_console.settings.ConsoleSettings`)",
        "The web console and REST API (docs/console.md). In a config file, under `[console]`; "
        "in the environment, `APOGEE_CONSOLE_<SETTING>` (for example "
        "`APOGEE_CONSOLE_LISTEN=0.0.0.0:8080`); a few also as flags (`--listen`, `--namesrv`, "
        "`--allowed-hosts`).",
    )
