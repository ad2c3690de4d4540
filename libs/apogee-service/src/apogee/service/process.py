"""A service's process, the same way in every service: argv → settings → run.

Each service's ``__main__`` builds its flags with :func:`service_parser` and hands them, with its
settings loader and its app, to :func:`run_service`::

    def main(argv: Sequence[str] | None = None) -> int:
        parser = service_parser("apogee-nameserver", "Apogee nameserver: ...", add_flags)
        return run_service(parser, load_settings, NameServerApp, "nameserver", argv)

Settings come from defaults, ``--config FILE`` (TOML), the service's ``APOGEE_<SERVICE>_*``
environment and the flags, each winning over the one before; logs go to standard output, one
line per record (:func:`apogee.common.logs.configure_logging`); a service that traces has its
spans exported when the ``OTEL_*`` environment asks for it (:func:`apogee.common.tracing.configure`,
set up once logging is; docs/tracing.md); the app runs until SIGTERM or SIGINT
(:func:`apogee.rpc.server.serve_process`). Exit status: 0 after a graceful stop, 2 for bad
settings (the error on standard error, after the program's name), 1 when the service cannot
start (a port taken, a file it cannot open; logged).

A leader-elected service's flags are :func:`apogee.service.leader_app.leader_parser`'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from apogee.common.errors import InvalidArgumentError
from apogee.common.logs import configure_logging
from apogee.rpc.server import serve_process


class ServiceSettings(Protocol):
    @property
    def log_level_number(self) -> int: ...


class ServiceApp(Protocol):
    def start(self) -> Awaitable[object]: ...

    def stop(self) -> Awaitable[None]: ...


T = TypeVar("T", bound=ServiceSettings)


def service_parser(
    prog: str, description: str, add_flags: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    """The command line of a service: ``--config``, the flags ``add_flags`` adds, then
    ``--log-level``. Each flag's destination names a setting (``--lock-file``: ``lock_file``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", type=Path, metavar="PATH", help="a TOML file of settings")
    add_flags(parser)
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return parser


def run_service(
    parser: argparse.ArgumentParser,
    load_settings: Callable[..., T],
    new_app: Callable[[T], ServiceApp],
    what: str,
    argv: Sequence[str] | None = None,
    *,
    tracing_name: str = "",
) -> int:
    """Parse ``argv`` (the process's when None), load the settings with
    ``load_settings(config_file, **flags)`` (a flag not given is None), configure logging, run
    ``new_app(settings)`` until SIGTERM or SIGINT; returns the exit status (see the module
    docstring). ``what`` names the service in the log line of a failed start;
    ``tracing_name``: the service traces, under this name (``apogee-schedule``; needs
    apogee-common's ``tracing`` extra)."""
    flags: dict[str, Any] = vars(parser.parse_args(argv))
    config = flags.pop("config")
    try:
        settings = load_settings(config, **flags)
    except InvalidArgumentError as err:
        print(f"{parser.prog}: {err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level_number)
    if tracing_name:
        # only the services that trace install OpenTelemetry
        from apogee.common import tracing  # noqa: PLC0415

        tracing.configure(tracing_name)  # once logging is set up: it logs what it did
    app = new_app(settings)
    return serve_process(what, app.start, app.stop)
