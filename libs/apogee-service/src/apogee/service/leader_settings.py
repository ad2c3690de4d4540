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
(in the order the fields are declared), ``log_level`` is one of the log levels (any case in),
and, for settings that are also :class:`~apogee.common.settings.SecuritySettings` (every
service's), the TLS and authentication settings check out as those of a service that calls
others (nameservers, brokers).

Which replica is active is chosen by ``leadership`` (:class:`LeadershipKind`): ``file``, the
lock on ``lock_file`` (the default: one machine, or a shared volume), or ``lease``, a
Kubernetes Lease (:mod:`apogee.service.lease`) named by ``lease_namespace`` and ``lease_name``,
held as ``lease_identity`` for ``lease_duration_s``, renewed every ``lease_retry_period_s``
and given up when not renewed within ``lease_renew_deadline_s``. A service that offers the
Lease declares those fields too (with the descriptions below); the checks: the retry period
shorter than the renew deadline, that shorter than the lease duration, and the names Kubernetes
names. :func:`new_leadership` builds the chosen one.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re
import socket
from pathlib import Path
from typing import ClassVar

from apogee.common.errors import InvalidArgumentError
from apogee.common.logs import check_log_level
from apogee.common.settings import (
    SecuritySettings,
    check_address,
    check_metrics_listen,
    parse_nameservers,
)
from apogee.service.leadership import FileLockLeadership, Leadership

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


class LeadershipKind(enum.Enum):
    #: a file lock (flock) on ``lock_file`` (``lock`` is taken for it too)
    FILE = "file"
    #: a Kubernetes Lease (coordination.k8s.io/v1)
    LEASE = "lease"

    @classmethod
    def _missing_(cls, value: object) -> LeadershipKind | None:
        return cls.FILE if value == "lock" else None


#: The ranges of the Lease settings (the order among them is checked too).
LEASE_RANGES: Ranges = (
    ("lease_duration_s", 1, 3600),
    ("lease_renew_deadline_s", 0.1, 3600.0),
    ("lease_retry_period_s", 0.05, 600.0),
)

LEADERSHIP_DOC = (
    "How the active replica is chosen: `file` (or `lock`), the file lock `lock_file` "
    "(replicas on one machine or a shared volume), or `lease`, a Kubernetes Lease "
    "(coordination.k8s.io/v1; needs RBAC for leases; see docs/deployment.md)."
)
LEASE_NAMESPACE_DOC = (
    "With `leadership = lease`: the Lease's namespace; empty: `$POD_NAMESPACE`, else the "
    "pod's service account's, else `default`."
)
LEASE_IDENTITY_DOC = (
    "With `leadership = lease`: this replica's name in the Lease's `holderIdentity`, unique "
    "among the replicas; empty: `$POD_NAME`, else the host name (in a pod, the pod's name)."
)
LEASE_DURATION_DOC = (
    "With `leadership = lease`: seconds a holder that stops renewing (killed, cut off) keeps "
    "the Lease; the longest a standby waits to take over after a crash."
)
LEASE_RENEW_DEADLINE_DOC = (
    "With `leadership = lease`: when the holder has not renewed the Lease for this many "
    "seconds (the API server does not answer), it stops its work and becomes a standby; "
    "below `lease_duration_s`, by at least what stopping takes (`shutdown_grace_s`)."
)
LEASE_RETRY_PERIOD_DOC = (
    "With `leadership = lease`: how often, in seconds, the holder renews the Lease and a "
    "standby tries to take it; below `lease_renew_deadline_s`."
)

#: A Kubernetes object name (DNS subdomain) and namespace (DNS label).
_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def lease_name_doc(default: str) -> str:
    return (
        f"With `leadership = lease`: the Lease's name (the Helm chart names it after the "
        f"{default} Deployment); replicas of one service in one broker cluster share it."
    )


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
    # declared by the services that offer the Lease (absent: the lock only)
    leadership: LeadershipKind
    lease_namespace: str
    lease_name: str
    lease_identity: str
    lease_duration_s: int
    lease_renew_deadline_s: float
    lease_retry_period_s: float

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
        ranges = {
            name: (least, most)
            for name, least, most in (*SHARED_RANGES, *LEASE_RANGES, *self.RANGES)
        }
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
        if getattr(self, "leadership", None) is not None:
            self._check_lease()
        if isinstance(self, SecuritySettings):
            self.check_security(calls_services=True)

    def _check_lease(self) -> None:
        if not self.lease_retry_period_s < self.lease_renew_deadline_s < self.lease_duration_s:
            raise InvalidArgumentError(
                field="lease_renew_deadline_s",
                rule=(
                    "must lie between lease_retry_period_s and lease_duration_s, got "
                    f"{self.lease_retry_period_s:g} < {self.lease_renew_deadline_s:g} < "
                    f"{self.lease_duration_s:g}"
                ),
            )
        if not (len(self.lease_name) <= 253 and _SUBDOMAIN_RE.fullmatch(self.lease_name)):
            raise InvalidArgumentError(
                field="lease_name",
                rule=f"{self.lease_name!r} is not a Kubernetes name (lower case a-z, 0-9, - and .)",
            )
        if self.lease_namespace and not (
            len(self.lease_namespace) <= 63 and _LABEL_RE.fullmatch(self.lease_namespace)
        ):
            raise InvalidArgumentError(
                field="lease_namespace",
                rule=f"{self.lease_namespace!r} is not a namespace (lower case a-z, 0-9 and -)",
            )
        if len(self.lease_identity) > 253 or not self.lease_identity.isprintable():
            raise InvalidArgumentError(
                field="lease_identity", rule="must be printable, at most 253 characters"
            )

    @property
    def nameservers(self) -> list[str]:
        """The nameserver addresses of ``namesrv``, in order, without duplicates."""
        return parse_nameservers(self.namesrv)

    @property
    def log_level_number(self) -> int:
        return logging.getLevelNamesMapping()[self.log_level]


def new_leadership(settings: LeaderServiceSettings) -> Leadership:
    """The leadership ``settings`` choose: the file lock, or (``leadership = lease``) the
    Kubernetes Lease, with the API server found as :func:`apogee.service.kube.new_api_client`
    says. RuntimeError when the Lease is chosen and the kubernetes package is missing."""
    if getattr(settings, "leadership", LeadershipKind.FILE) is not LeadershipKind.LEASE:
        return FileLockLeadership(settings.lock_file, settings.lock_poll_s)
    from apogee.service.kube import pod_namespace  # noqa: PLC0415
    from apogee.service.lease import lease_leadership  # noqa: PLC0415

    return lease_leadership(
        namespace=settings.lease_namespace or os.environ.get("POD_NAMESPACE") or pod_namespace(),
        name=settings.lease_name,
        identity=settings.lease_identity or os.environ.get("POD_NAME") or socket.gethostname(),
        lease_duration_s=settings.lease_duration_s,
        renew_deadline_s=settings.lease_renew_deadline_s,
        retry_period_s=settings.lease_retry_period_s,
    )
