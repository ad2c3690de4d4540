"""The transaction checker's settings: defaults < config file < ``APOGEE_TXN_CHECKER_*`` <
flags.

A config file holds the fields at top level or under a ``[txn_checker]`` table::

    [txn_checker]
    namesrv = "ns-0.apogee-ns:9876;ns-1.apogee-ns:9876"
    lock_file = "/var/run/apogee/txn-checker.lock"
    check_interval_s = 60

What every leader-elected service's settings share (their descriptions, the checks) is
:mod:`apogee.service.leader_settings`'s; in Kubernetes, replicas share a Lease instead of a lock
file (``APOGEE_TXN_CHECKER_LEADERSHIP=lease``; docs/deployment.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from apogee.common.configdoc import render_class
from apogee.common.settings import SecuritySettings, doc, load, metrics_listen_doc
from apogee.service.leader_settings import (
    BROKER_REFRESH_DOC,
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


@dataclass(frozen=True, slots=True)
class TxnCheckerSettings(LeaderServiceSettings, SecuritySettings):
    namesrv: str = doc(
        "127.0.0.1:9876",
        namesrv_doc("the half messages of every broker any of them knows are checked."),
    )
    listen: str = doc("127.0.0.1:9701", listen_doc("apogee.txn_checker.Process"))
    metrics_listen: str = doc("127.0.0.1:9711", metrics_listen_doc(9701))
    leadership: LeadershipKind = doc(LeadershipKind.FILE, LEADERSHIP_DOC)
    lock_file: Path = doc(Path("./txn-checker.lock"), LOCK_FILE_DOC)
    lock_poll_s: float = doc(1.0, LOCK_POLL_DOC)
    lease_namespace: str = doc("", LEASE_NAMESPACE_DOC)
    lease_name: str = doc("apogee-txn-checker", lease_name_doc("txn-checker"))
    lease_identity: str = doc("", LEASE_IDENTITY_DOC)
    lease_duration_s: int = doc(15, LEASE_DURATION_DOC)
    lease_renew_deadline_s: float = doc(10.0, LEASE_RENEW_DEADLINE_DOC)
    lease_retry_period_s: float = doc(2.0, LEASE_RETRY_PERIOD_DOC)
    check_interval_s: float = doc(
        60.0,
        "How often, in seconds, each broker's half messages are scanned (a round); also how "
        "long after a check a transaction still undecided is checked again. At least 1 (tests "
        "use 1).",
    )
    immunity_s: float = doc(
        6.0,
        "How long, in seconds, after its half is stored a transaction is first checked, unless "
        "the message says otherwise (its CHECK_IMMUNITY_TIME_IN_SECONDS property).",
    )
    max_check_times: int = doc(
        15,
        "Checks a transaction gets; when it is still undecided after that many, the broker "
        "moves its half to TRANS_CHECK_MAX_TIME_TOPIC (a WARNING names it), where an operator "
        "can still end it.",
    )
    checks_per_group_per_s: float = doc(
        100.0,
        "Checks sent to one producer group per second at most, over every broker (a token "
        "bucket per group). Halves of a group beyond what it can be sent within one round are "
        "left for the next round.",
    )
    check_burst: int = doc(
        200, "Checks one producer group may be sent at once before the rate above applies."
    )
    jitter_ms: int = doc(
        100,
        "Most random delay, in ms, added to each wait for a group's rate limit and to the "
        "start of each round, so that checks are spread and the brokers' rounds do not tick "
        "together.",
    )
    max_concurrent_checks: int = doc(
        16, "CheckHalf calls in flight to one broker at most (each producer group's in order)."
    )
    half_scan_batch: int = doc(256, "Half messages read by one ScanHalf call (at most 4096).")
    op_scan_batch: int = doc(1024, "Op records read by one ScanOps call (at most 16384).")
    broker_refresh_s: float = doc(5.0, BROKER_REFRESH_DOC)
    rpc_timeout_s: float = doc(5.0, "Deadline in seconds of one call to a broker or nameserver.")
    shutdown_grace_s: float = doc(
        5.0,
        "On SIGTERM, how long in seconds checks in flight and the final progress commit may "
        "take before they are cut.",
    )
    log_level: str = doc("INFO", LOG_LEVEL_DOC)

    #: (field, least, most): the range each of this service's own numeric settings must fall in.
    RANGES: ClassVar[Ranges] = (
        ("check_interval_s", 1.0, 86_400.0),
        ("immunity_s", 0.0, 86_400.0),
        ("max_check_times", 1, 10_000),
        ("checks_per_group_per_s", 0.01, 1_000_000.0),
        ("check_burst", 1, 1_000_000),
        ("jitter_ms", 0, 60_000),
        ("max_concurrent_checks", 1, 1024),
        ("half_scan_batch", 1, 4096),
        ("op_scan_batch", 1, 16_384),
    )

    @property
    def lane_capacity(self) -> int:
        """Halves of one producer group a round holds for checking: what the group's rate
        limit lets through in one round (its burst and one interval's worth); the group's
        further halves are left for the next round."""
        return self.check_burst + int(self.checks_per_group_per_s * self.check_interval_s)


def load_settings(
    config_file: Path | None = None, env: Mapping[str, str] | None = None, **overrides: Any
) -> TxnCheckerSettings:
    """Defaults, then ``config_file``, then ``env`` (the process environment when None), then
    ``overrides`` (command-line flags; None means not given)."""
    return load(
        TxnCheckerSettings,
        "txn_checker",
        config_file,
        os.environ if env is None else env,
        **overrides,
    )


def config_reference() -> str:
    """This service's section of docs/configuration.md."""
    return render_class(
        TxnCheckerSettings,
        "Transaction checker (`apogee_txn_checker.settings.TxnCheckerSettings`)",
        "Checks transactions left undecided: scans each broker's half messages and has the "
        "broker ask a producer of the group what became of them. In a config file, under "
        "`[txn_checker]`; in the environment, `APOGEE_TXN_CHECKER_<SETTING>` (for example "
        "`APOGEE_TXN_CHECKER_CHECK_INTERVAL_S=10`); a few also as flags (`--namesrv`, "
        "`--listen`, `--lock-file`).",
    )
