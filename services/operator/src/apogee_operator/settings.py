"""The operator's settings: defaults < config file < ``APOGEE_OPERATOR_*`` < flags.

A config file holds the fields at top level or under an ``[operator]`` table::

    [operator]
    namesrv = "ns-0.apogee-ns:9876;ns-1.apogee-ns:9876"
    resync_s = 60

The fields and checks it shares with the other leader-elected services (nameservers, health
address, the lock or Lease that makes one replica active, deadlines, log level) are
:mod:`apogee.service.leader_settings`'s; the operator runs in Kubernetes, so its replicas share a
Lease by default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from apogee.common.configdoc import render_class
from apogee.common.errors import InvalidArgumentError
from apogee.common.settings import SecuritySettings, doc, load, metrics_listen_doc
from apogee.service.leader_settings import (
    LEADERSHIP_DOC,
    LEASE_DURATION_DOC,
    LEASE_IDENTITY_DOC,
    LEASE_NAMESPACE_DOC,
    LEASE_RENEW_DEADLINE_DOC,
    LEASE_RETRY_PERIOD_DOC,
    LOCK_FILE_DOC,
    LOCK_POLL_DOC,
    LOG_LEVEL_DOC,
    LeaderServiceSettings,
    LeadershipKind,
    Ranges,
    lease_name_doc,
    listen_doc,
    namesrv_doc,
)

#: A namespace name (DNS label).
_NAMESPACE_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")


@dataclass(frozen=True, slots=True)
class OperatorSettings(LeaderServiceSettings, SecuritySettings):
    namesrv: str = doc(
        "127.0.0.1:9876",
        namesrv_doc("topics and groups are put on the brokers any of them knows."),
    )
    listen: str = doc("127.0.0.1:9702", listen_doc("apogee.operator.Process"))
    metrics_listen: str = doc("127.0.0.1:9712", metrics_listen_doc(9702))
    watch_namespace: str = doc(
        "",
        "Namespace whose Topic and ConsumerGroup resources are reconciled; empty: "
        "`$POD_NAMESPACE`, else the pod's service account's (what a namespaced Role allows); "
        "`*`: every namespace (needs a ClusterRole).",
    )
    resync_s: float = doc(
        60.0,
        "How often, in seconds, every resource is reconciled again although it did not "
        "change, so that what was changed behind its back on the brokers (a topic deleted, "
        "its queues changed, a broker that joined) is put right.",
    )
    retry_s: float = doc(
        2.0,
        "After a failed reconcile (brokers unavailable, a write conflict), the first retry "
        "comes after this many seconds, doubling up to `resync_s`.",
    )
    watch_timeout_s: float = doc(
        300.0,
        "Each watch of the resources asks the API server to end it after this many seconds; "
        "it is started again from where it ended.",
    )
    kube_timeout_s: float = doc(10.0, "Deadline in seconds of one call to the API server.")
    rpc_timeout_s: float = doc(5.0, "Deadline in seconds of one call to a broker or nameserver.")
    leadership: LeadershipKind = doc(LeadershipKind.LEASE, LEADERSHIP_DOC)
    lock_file: Path = doc(Path("./operator.lock"), LOCK_FILE_DOC)
    lock_poll_s: float = doc(1.0, LOCK_POLL_DOC)
    lease_namespace: str = doc("", LEASE_NAMESPACE_DOC)
    lease_name: str = doc("apogee-operator", lease_name_doc("operator"))
    lease_identity: str = doc("", LEASE_IDENTITY_DOC)
    lease_duration_s: int = doc(15, LEASE_DURATION_DOC)
    lease_renew_deadline_s: float = doc(10.0, LEASE_RENEW_DEADLINE_DOC)
    lease_retry_period_s: float = doc(2.0, LEASE_RETRY_PERIOD_DOC)
    shutdown_grace_s: float = doc(
        5.0, "On SIGTERM, how long in seconds a reconcile in flight may take before it is cut."
    )
    log_level: str = doc("INFO", LOG_LEVEL_DOC)

    #: (field, least, most): the range each of this service's own numeric settings must fall in.
    RANGES: ClassVar[Ranges] = (
        ("resync_s", 0.1, 86_400.0),
        ("retry_s", 0.01, 3600.0),
        ("watch_timeout_s", 1.0, 3600.0),
        ("kube_timeout_s", 0.1, 300.0),
    )

    def __post_init__(self) -> None:
        LeaderServiceSettings.__post_init__(self)
        ns = self.watch_namespace
        if ns not in ("", "*") and not (len(ns) <= 63 and set(ns) <= _NAMESPACE_CHARS):
            raise InvalidArgumentError(
                field="watch_namespace",
                rule=f"{ns!r} is not a namespace (lower case a-z, 0-9 and -), '' or '*'",
            )


def load_settings(
    config_file: Path | None = None, env: Mapping[str, str] | None = None, **overrides: Any
) -> OperatorSettings:
    """Defaults, then ``config_file``, then ``env`` (the process environment when None), then
    ``overrides`` (command-line flags; None means not given)."""
    return load(
        OperatorSettings, "operator", config_file, os.environ if env is None else env, **overrides
    )


def config_reference() -> str:
    """This service's section of docs/configuration.md."""
    return render_class(
        OperatorSettings,
        "Operator (`apogee_operator.settings.OperatorSettings`)",
        "Reconciles the apogee.io/v1alpha1 Topic and ConsumerGroup resources with the brokers "
        "(see docs/deployment.md). In a config file, under `[operator]`; in the environment, "
        "`APOGEE_OPERATOR_<SETTING>` (for example `APOGEE_OPERATOR_RESYNC_S=30`); a few also "
        "as flags (`--namesrv`, `--listen`, `--lock-file`).",
    )
