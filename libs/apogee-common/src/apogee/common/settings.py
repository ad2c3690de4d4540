"""Typed settings: defaults < a TOML config file < ``APOGEE_<SERVICE>_<FIELD>`` environment.

Each service declares one frozen dataclass; every field has a default and a ``metadata["doc"]``
(the configuration reference in docs/ is generated from them). :func:`load` builds an instance::

    settings = load(BrokerSettings, "broker", config_file=Path("broker.toml"), env=os.environ)

The config file holds the fields at top level or under a ``[<service>]`` table. Field types
understood: ``str``, ``int``, ``float``, ``bool``, ``Path``, enums (by value), optional values,
and tuples (comma or semicolon separated in the environment). A bad value or an unknown key
raises :class:`~apogee.common.errors.InvalidArgumentError` naming where it came from and the rule.

:class:`SecuritySettings` holds what every service shares about security (TLS on its ports and
its connections, request authentication); each service's settings class inherits it, so its
fields load like the service's own (``APOGEE_BROKER_TLS_CERT_FILE``) and appear in its section
of the configuration reference, and its ``__post_init__`` calls
:meth:`SecuritySettings.check_security`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from apogee.common.errors import InvalidArgumentError

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def check_address(field: str, value: str, allow_port_zero: bool = False) -> None:
    """``value`` must be ``host:port`` (port 1 to 65535, or 0 with ``allow_port_zero``: a
    listen address that takes any free port); the error names ``field``."""
    host, sep, port = value.rpartition(":")
    lowest = 0 if allow_port_zero else 1
    if not sep or not host or not port.isdigit() or not lowest <= int(port) <= 65535:
        raise InvalidArgumentError(
            field=field, rule=f"{value!r} is not host:port (port {lowest} to 65535)"
        )


def check_metrics_listen(value: str, field: str = "metrics_listen") -> None:
    """``value`` is empty (no metrics endpoint) or a ``host:port`` to listen on (port 0: any
    free port)."""
    if value:
        check_address(field, value, allow_port_zero=True)


def metrics_listen_doc(grpc_port: int) -> str:
    """The description of a service's ``metrics_listen`` setting."""
    return (
        "host:port of the HTTP server that serves Prometheus metrics at `/metrics` (see "
        f"docs/metrics.md; beside the gRPC port {grpc_port}). Port 0 picks a free port; "
        "empty: no metrics endpoint. A port in use fails the start."
    )


def parse_nameservers(text: str, field: str = "namesrv") -> list[str]:
    """The ``;``-separated addresses of ``text``, in order, without duplicates, each checked
    by :func:`check_address`."""
    out: list[str] = []
    for part in text.split(";"):
        addr = part.strip()
        if not addr:
            continue
        check_address(field, addr)
        if addr not in out:
            out.append(addr)
    return out


def doc(default: Any, text: str) -> Any:
    """A settings field with its default and description."""
    return dataclasses.field(default=default, metadata={"doc": text})


#: The values of ``tls_client_auth``.
TLS_CLIENT_AUTH_MODES = ("none", "optional", "require")


@dataclasses.dataclass(frozen=True, slots=True)
class SecuritySettings:
    """TLS and authentication settings every service inherits (see the module docstring).
    The files are read when the service starts (a file that is missing, not PEM or a key that
    does not match its certificate fails the start, naming the setting), and TLS files again
    whenever they change."""

    tls_cert_file: str = doc(
        "",
        "PEM certificate (chain) of this service. Set: the service serves TLS only, on its gRPC "
        "port and its metrics port (HTTPS), and uses TLS, presenting this certificate, when it "
        "connects to other Apogee services. Empty: plaintext everywhere. Replaced files (a "
        "renewed certificate, a Kubernetes Secret update) are picked up by new connections "
        "without a restart.",
    )
    tls_key_file: str = doc(
        "", "PEM private key (unencrypted) of `tls_cert_file`; required with it."
    )
    tls_ca_file: str = doc(
        "",
        "PEM certificates of the CA(s) this service trusts: it verifies the services it "
        "connects to with them, and its clients' certificates when `tls_client_auth` is "
        "`optional` or `require`. Empty: the system's root CAs (then client certificates "
        "cannot be asked for).",
    )
    tls_client_auth: str = doc(
        "none",
        "Client certificates (mutual TLS), with `tls_cert_file`: `none` (not asked for), "
        "`optional` (the metrics port verifies one when presented; the gRPC port then does not "
        "ask, as gRPC's Python runtime can only require one or not ask) or `require` (a "
        "connection without a certificate from `tls_ca_file` is refused). `optional` and "
        "`require` need `tls_ca_file`.",
    )
    tls_server_name: str = doc(
        "",
        "Name expected in the certificates of the services this one connects to, instead of "
        "the host of their address (for example when they are reached by IP, or a certificate "
        "names a Service's DNS name). Empty: the host of the address.",
    )
    auth_enabled: bool = doc(
        False,
        "Authenticate every request (access keys, `MQv2-HMAC-SHA1` signatures) and check "
        "per-topic and per-group permissions; off: everything is allowed, for local "
        "development.",
    )
    auth_users_file: str = doc(
        "",
        "TOML file of the users: their access keys, secret keys and permissions; read again "
        "when it changes. Required when `auth_enabled`.",
    )
    auth_max_skew_s: float = doc(
        900.0,
        "Most seconds a signed request's time may differ from this service's clock before it "
        "is refused (a replayed or badly timed request); above 0.",
    )
    auth_credentials_file: str = doc(
        "",
        "TOML file of this service's own access key and secret key (`access_key` and "
        "`secret_key`), with which it signs its calls to other services. Required when "
        "`auth_enabled` for the services that call others (broker, schedule, txn-checker).",
    )

    def check_security(self, calls_services: bool = False) -> None:
        """Check the settings above (not the files); ``calls_services``: this service calls
        other services, so ``auth_credentials_file`` is required when ``auth_enabled``.
        :class:`InvalidArgumentError` names the setting and the rule."""
        if self.tls_client_auth not in TLS_CLIENT_AUTH_MODES:
            raise InvalidArgumentError(
                field="tls_client_auth",
                rule=f"{self.tls_client_auth!r} is not one of {', '.join(TLS_CLIENT_AUTH_MODES)}",
            )
        if self.tls_cert_file and not self.tls_key_file:
            raise InvalidArgumentError(
                field="tls_key_file", rule="must name the key of tls_cert_file"
            )
        if self.tls_key_file and not self.tls_cert_file:
            raise InvalidArgumentError(
                field="tls_cert_file", rule="must name the certificate of tls_key_file"
            )
        if not self.tls_cert_file:
            for name, off in (
                ("tls_ca_file", ""),
                ("tls_server_name", ""),
                ("tls_client_auth", "none"),
            ):
                if getattr(self, name) != off:
                    raise InvalidArgumentError(
                        field=name, rule="has no effect without tls_cert_file (TLS is off)"
                    )
        elif self.tls_client_auth != "none" and not self.tls_ca_file:
            raise InvalidArgumentError(
                field="tls_ca_file",
                rule=f"must name the CA of client certificates when tls_client_auth is "
                f"{self.tls_client_auth}",
            )
        if not (self.auth_max_skew_s > 0 and math.isfinite(self.auth_max_skew_s)):
            raise InvalidArgumentError(
                field="auth_max_skew_s", rule=f"must be above 0, got {self.auth_max_skew_s}"
            )
        if self.auth_enabled:
            if not self.auth_users_file:
                raise InvalidArgumentError(
                    field="auth_users_file", rule="must name the users file when auth_enabled"
                )
            if calls_services and not self.auth_credentials_file:
                raise InvalidArgumentError(
                    field="auth_credentials_file",
                    rule="must name this service's access key file when auth_enabled",
                )


def env_name(prefix: str, field: str) -> str:
    return f"APOGEE_{prefix.upper()}_{field.upper()}"


def load(
    cls: type[T],
    prefix: str,
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> T:
    """Build ``cls`` from its defaults, then ``config_file``, then ``env``, then ``overrides``
    (command-line flags; ``None`` means not given), each winning over the one before."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if config_file is not None:
        try:
            data = tomllib.loads(config_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgumentError(field=str(config_file), rule=f"unreadable: {exc}") from exc
        section = data.get(prefix, data)
        if not isinstance(section, dict):
            raise InvalidArgumentError(field=f"{config_file} [{prefix}]", rule="must be a table")
        for key, raw in section.items():
            if key not in fields:
                if isinstance(raw, dict):
                    continue  # another service's table
                raise InvalidArgumentError(
                    field=f"{config_file}: {key}",
                    rule=f"is not a {prefix} setting (known: {', '.join(sorted(fields))})",
                )
            values[key] = _convert(hints[key], raw, f"{config_file}: {key}")
    if env is not None:
        for name in fields:
            var = env_name(prefix, name)
            if var in env:
                values[name] = _convert(hints[name], env[var], var)
    for name, raw in overrides.items():
        if raw is None:
            continue
        if name not in fields:
            raise TypeError(f"{name} is not a field of {cls.__name__}")
        values[name] = _convert(hints[name], raw, f"--{name.replace('_', '-')}")
    return cls(**values)


def _convert(tp: Any, raw: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None or raw == "":
            return None
        return _convert(args[0], raw, where)
    if origin is tuple:
        item = next(a for a in typing.get_args(tp) if a is not Ellipsis)
        if isinstance(raw, str):
            parts: list[Any] = [p.strip() for p in raw.replace(";", ",").split(",") if p.strip()]
        elif isinstance(raw, list | tuple):
            parts = list(raw)
        else:
            raise InvalidArgumentError(field=where, rule=f"{raw!r} is not a list")
        return tuple(_convert(item, p, where) for p in parts)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(raw.lower() if isinstance(raw, str) else raw)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in tp)
            raise InvalidArgumentError(
                field=where, rule=f"{raw!r} is not one of: {allowed}"
            ) from None
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise InvalidArgumentError(field=where, rule=f"{raw!r} is not a boolean (true/false)")
    if tp is int:
        if isinstance(raw, bool):
            raise InvalidArgumentError(field=where, rule=f"{raw!r} is not an integer")
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise InvalidArgumentError(field=where, rule=f"{raw!r} is not an integer") from None
    if tp is float:
        if isinstance(raw, bool):
            raise InvalidArgumentError(field=where, rule=f"{raw!r} is not a number")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise InvalidArgumentError(field=where, rule=f"{raw!r} is not a number") from None
    if tp is str:
        return str(raw)
    if tp is Path:
        return Path(str(raw))
    raise TypeError(f"settings field type {tp!r} is not supported ({where})")
