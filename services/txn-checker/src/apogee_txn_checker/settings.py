"""The transaction checker's settings: defaults < config file < ``APOGEE_TXN_CHECKER_*`` <
flags.

A config file holds the fields at top level or under a ``[txn_checker]`` table::

    [txn_checker]
    namesrv = "ns-0.apogee-ns:9876;ns-1.apogee-ns:9876"
    lock_file = "/var/run/apogee/txn-checker.lock"
    check_interval_s = 60
"""

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
from apogee.common.settings import check_address, doc, load, parse_nameservers

#: (field, least, most): the range each numeric setting must fall in.
_RANGES: tuple[tuple[str, float, float], ...] = (
    ("lock_poll_s", 0.01, 60.0),
    ("check_interval_s", 1.0, 86_400.0),
    ("immunity_s", 0.0, 86_400.0),
    ("max_check_times", 1, 10_000),
    ("checks_per_group_per_s", 0.01, 1_000_000.0),
    ("check_burst", 1, 1_000_000),
    ("jitter_ms", 0, 60_000),
    ("max_concurrent_checks", 1, 1024),
    ("half_scan_batch", 1, 4096),
    ("op_scan_batch", 1, 16_384),
    ("broker_refresh_s", 0.05, 3600.0),
    ("rpc_timeout_s", 0.1, 300.0),
    ("shutdown_grace_s", 0.0, 300.0),
)


@dataclass(frozen=True, slots=True)
class TxnCheckerSettings:
    namesrv: str = doc(
        "127.0.0.1:9876",
        "Nameservers the brokers are found through, `host:port` separated by `;`. Every one is "
        "asked; the half messages of every broker any of them knows are checked.",
    )
    listen: str = doc(
        "0.0.0.0:9701",
        "host:port of the gRPC server, which serves only grpc.health.v1: the overall status is "
        "SERVING while this replica is the active one, NOT_SERVING while it is a standby; "
        "the service `apogee.txn_checker.Process` is SERVING while the process runs (for "
        "liveness probes). Port 0 picks a free port.",
    )
    lock_file: Path = doc(
        Path("./txn-checker.lock"),
        "File whose lock (flock) makes one replica the active one; the others wait as standbys "
        "and take over when it is released (the active replica stops or dies). Replicas "
        "sharing a broker cluster must share this file (the same machine or shared storage).",
    )
    lock_poll_s: float = doc(
        1.0, "How often, in seconds, a standby tries to take the lock; the takeover delay."
    )
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
    broker_refresh_s: float = doc(
        5.0, "How often, in seconds, the broker list is read again from the nameservers."
    )
    rpc_timeout_s: float = doc(5.0, "Deadline in seconds of one call to a broker or nameserver.")
    shutdown_grace_s: float = doc(
        5.0,
        "On SIGTERM, how long in seconds checks in flight and the final progress commit may "
        "take before they are cut.",
    )
    log_level: str = doc("INFO", "Log level: DEBUG, INFO, WARNING, ERROR or CRITICAL.")

    def __post_init__(self) -> None:
        nameservers = parse_nameservers(self.namesrv)
        if not nameservers:
            raise InvalidArgumentError(field="namesrv", rule="must name at least one host:port")
        check_address("listen", self.listen, allow_port_zero=True)
        if not str(self.lock_file).strip() or self.lock_file == Path("."):
            raise InvalidArgumentError(field="lock_file", rule="must be a file path")
        for name, least, most in _RANGES:
            value = getattr(self, name)
            if not least <= value <= most:
                raise InvalidArgumentError(
                    field=name, rule=f"must be between {least:g} and {most:g}, got {value}"
                )
        object.__setattr__(self, "log_level", check_log_level(self.log_level))

    @property
    def nameservers(self) -> list[str]:
        """The nameserver addresses of ``namesrv``, in order, without duplicates."""
        return parse_nameservers(self.namesrv)

    @property
    def log_level_number(self) -> int:
        return logging.getLevelNamesMapping()[self.log_level]

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
