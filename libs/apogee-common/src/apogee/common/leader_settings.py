"""What the settings of a leader-elected service that works on every broker share.

Schedule and the transaction checker each declare one frozen settings dataclass (their own
names, defaults and ``APOGEE_<SERVICE>_*`` prefix) that subclasses :class:`LeaderServiceSettings`
and declares the fields it reads (``namesrv``, ``listen``, ``metrics_listen``, ``lock_file``,
``lock_poll_s``, ``broker_refresh_s``, ``rpc_timeout_s``, ``shutdown_grace_s``, ``log_level``)
in the order the service documents them, with its own fields among them, described with the
wording below where the services say the same (``doc(Path("./schedule.lock"),
LOCK_FILE_DOC)``). Its ``RANGES`` holds the ranges of its own numeric fields.

The checks after construction are shared: ``namesrv`` names at least one ``host:port``,
``listen`` is ``host:port`` (port 0 picks a free one), ``metrics_listen`` is that or empty,
``lock_file`` is a file path, every
numeric setting of :data:`SHARED_RANGES` and of the class's own ``RANGES`` falls in its range
(in the order the fields are declared), and ``log_level`` is one of the log levels (any case in).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import ClassVar

from apogee.common.errors import InvalidArgumentError
from apogee.common.logs import check_log_level
from apogee.common.settings import check_address, check_metrics_listen, parse_nameservers

#: (field, least, most) ranges of numeric settings.
Ranges = tuple[tuple[str, float, float], ...]

#: The ranges of the numeric settings every such service has.
SHARED_RANGES: Ranges = (
    ("lock_poll_s", 0.01, 60.0),
    ("broker_refresh_s", 0.05, 3600.0),
    ("rpc_timeout_s", 0.1, 300.0),
    ("shutdown_grace_s", 0.0, 300.0),
)

LOCK_FILE_DOC = (
    "File whose lock (flock) makes one replica the active one; the others wait as standbys "
    "and take over when it is released (the active replica stops or dies). Replicas "
    "sharing a broker cluster must share this file (the same machine or shared storage)."
)
LOCK_POLL_DOC = "How often, in seconds, a standby tries to take the lock; the takeover delay."
BROKER_REFRESH_DOC = "How often, in seconds, the broker list is read again from the nameservers."
LOG_LEVEL_DOC = "Log level: DEBUG, INFO, WARNING, ERROR or CRITICAL."


def namesrv_doc(served: str) -> str:
    """The description of ``namesrv``, ending with what the service does with the brokers."""
    return (
        "Nameservers the brokers are found through, `host:port` separated by `;`. Every one is "
        f"asked; {served}"
    )


def listen_doc(process_health: str) -> str:
    """The description of ``listen``, naming the service's liveness health service."""
    return (
        "host:port of the gRPC server, which serves only grpc.health.v1: the overall status is "
        "SERVING while this replica is the active one, NOT_SERVING while it is a standby; "
        f"the service `{process_health}` is SERVING while the process runs (for liveness "
        "probes). Port 0 picks a free port."
    )


class LeaderServiceSettings:
    """Base of a leader-elected service's settings dataclass: the shared checks (see the
    module docstring) and what is derived from the shared fields."""

    __slots__ = ()

    namesrv: str
    listen: str
    metrics_listen: str
    lock_file: Path
    lock_poll_s: float
    broker_refresh_s: float
    rpc_timeout_s: float
    shutdown_grace_s: float
    log_level: str

    #: (field, least, most): the range each of the service's own numeric settings must fall in.
    RANGES: ClassVar[Ranges] = ()

    def __post_init__(self) -> None:
        nameservers = parse_nameservers(self.namesrv)
        if not nameservers:
            raise InvalidArgumentError(field="namesrv", rule="must name at least one host:port")
        check_address("listen", self.listen, allow_port_zero=True)
        check_metrics_listen(self.metrics_listen)
        if not str(self.lock_file).strip() or self.lock_file == Path("."):
            raise InvalidArgumentError(field="lock_file", rule="must be a file path")
        ranges = {name: (least, most) for name, least, most in (*SHARED_RANGES, *self.RANGES)}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]  # a dataclass's base
            if field.name not in ranges:
                continue
            least, most = ranges[field.name]
            value = getattr(self, field.name)
            if not least <= value <= most:
                raise InvalidArgumentError(
                    field=field.name, rule=f"must be between {least:g} and {most:g}, got {value}"
                )
        object.__setattr__(self, "log_level", check_log_level(self.log_level))

    @property
    def nameservers(self) -> list[str]:
        """The nameserver addresses of ``namesrv``, in order, without duplicates."""
        return parse_nameservers(self.namesrv)

    @property
    def log_level_number(self) -> int:
        return logging.getLevelNamesMapping()[self.log_level]
