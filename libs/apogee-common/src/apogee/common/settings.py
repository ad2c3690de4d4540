"""Typed settings: defaults < a TOML config file < ``APOGEE_<SERVICE>_<FIELD>`` environment.

Each service declares one frozen dataclass; every field has a default and a ``metadata["doc"]``
(the configuration reference in docs/ is generated from them). :func:`load` builds an instance::

    settings = load(BrokerSettings, "broker", config_file=Path("broker.toml"), env=os.environ)

The config file holds the fields at top level or under a ``[<service>]`` table. Field types
understood: ``str``, ``int``, ``float``, ``bool``, ``Path``, enums (by value), optional values,
and tuples (comma or semicolon separated in the environment). A bad value or an unknown key
raises :class:`~apogee.common.errors.InvalidArgumentError` naming where it came from and the rule.
"""

from __future__ import annotations

import dataclasses
import enum
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
