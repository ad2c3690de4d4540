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
        "TOML file of the console's own users (`[[users]]` with `name`, `password_sha256` = hex "
        "of sha256(salt + password), `salt` and `role` = `read` or `admin`; "
        "`python -m apogee_console.passwd` prints an entry). Read again when it changes. Set: "
        "login is required.",
    )
    request_timeout_s: float = doc(
        5.0, "Deadline in seconds of every call the console makes to the cluster; 0.1 to 300."
    )
    log_level: str = doc("INFO", "Log level: DEBUG, INFO, WARNING, ERROR or CRITICAL.")

    def __post_init__(self) -> None:
        check_address("listen", self.listen, allow_port_zero=True)
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
        "`APOGEE_CONSOLE_LISTEN=0.0.0.0:8080`); a few also as flags (`--listen`, `--namesrv`).",
    )
