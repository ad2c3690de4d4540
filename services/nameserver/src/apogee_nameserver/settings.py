"""The nameserver's settings: defaults < config file < ``APOGEE_NAMESERVER_*`` < flags."""

from __future__ import annotations

import logging
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
    check_metrics_listen,
    doc,
    load,
    metrics_listen_doc,
)


@dataclass(frozen=True, slots=True)
class NameServerSettings(SecuritySettings):
    listen: str = doc(
        "127.0.0.1:9876",
        "host:port the gRPC server (NameServer and grpc.health.v1) listens on; port 0 picks "
        "a free port. The default serves this machine only: set `0.0.0.0:9876` to serve "
        "others (the container images and the Helm chart do).",
    )
    broker_expiry_s: float = doc(
        120.0,
        "A broker that has not registered (its heartbeat) for longer than this many seconds is "
        "dropped from routes. Keep it well above the brokers' heartbeat interval (30 s).",
    )
    scan_interval_s: float = doc(
        5.0,
        "How often, in seconds, silent brokers are looked for and dropped (routes leave them "
        "out as soon as they expire, whatever this interval).",
    )
    shutdown_grace_s: float = doc(
        5.0,
        "On SIGTERM, calls in flight get this many seconds to finish before the server stops.",
    )
    metrics_listen: str = doc("127.0.0.1:9880", metrics_listen_doc(9876))
    log_level: str = doc("INFO", "Log level: DEBUG, INFO, WARNING, ERROR or CRITICAL.")

    def __post_init__(self) -> None:
        _check_listen(self.listen)
        check_metrics_listen(self.metrics_listen)
        for name in ("broker_expiry_s", "scan_interval_s"):
            value = getattr(self, name)
            if not value > 0:
                raise InvalidArgumentError(field=name, rule=f"must be greater than 0, got {value}")
        if not self.shutdown_grace_s >= 0:
            raise InvalidArgumentError(
                field="shutdown_grace_s", rule=f"must be 0 or more, got {self.shutdown_grace_s}"
            )
        object.__setattr__(self, "log_level", check_log_level(self.log_level))
        self.check_security(calls_services=False)

    @property
    def log_level_number(self) -> int:
        return logging.getLevelNamesMapping()[self.log_level]


def load_settings(
    config_file: Path | None = None, env: Mapping[str, str] | None = None, **overrides: Any
) -> NameServerSettings:
    """Defaults, then ``config_file``, then ``env`` (the process environment when None), then
    ``overrides`` (command-line flags; None means not given)."""
    return load(
        NameServerSettings,
        "nameserver",
        config_file,
        os.environ if env is None else env,
        **overrides,
    )


def _check_listen(listen: str) -> None:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgumentError(
            field="listen", rule=f"{listen!r} must be host:port, with a port from 0 to 65535"
        )


def config_reference() -> str:
    """This service's section of docs/configuration.md."""
    return render_class(
        NameServerSettings,
        "Nameserver (`apogee_nameserver.settings.NameServerSettings`)",
        "The route registry brokers register with. In a config file, under `[nameserver]`; "
        "in the environment, `APOGEE_NAMESERVER_<SETTING>` (for example "
        "`APOGEE_NAMESERVER_BROKER_EXPIRY_S=60`).",
    )
