"""The broker's settings: defaults < TOML config file < ``APOGEE_BROKER_*`` environment < flags.

A config file holds the fields at top level or under a ``[broker]`` table::

    [broker]
    broker_name = "broker-b"
    listen = "0.0.0.0:10911"
    advertised_address = "apogee-broker-1.apogee-broker.apogee.svc:10911"
    namesrv = "ns-0.apogee-ns:9876;ns-1.apogee-ns:9876"
    flush_mode = "sync"
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from apogee.common.configdoc import render_class
from apogee.common.errors import InvalidArgumentError
from apogee.common.settings import (
    SecuritySettings,
    check_address,
    check_metrics_listen,
    doc,
    load,
    metrics_listen_doc,
    parse_nameservers,
)
from apogee.store import FlushMode, StoreConfig
from apogee_broker.core.schedule.layout import (
    DEFAULT_DELAY_LEVELS,
    ScheduleLayout,
    parse_delay_levels,
)

MiB = 1 << 20
GiB = 1 << 30
#: pull_max_bytes stays well under the 64 MiB a gRPC message may have.
PULL_BYTES_LIMIT = 48 * MiB

#: Listen hosts that mean "this machine": the advertised address then uses 127.0.0.1.
_LOCAL_HOSTS = frozenset({"", "0.0.0.0", "127.0.0.1", "localhost", "::", "[::]", "::1", "[::1]"})
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: How a replica group decides its leader (none: a lone broker).
REPLICATION_MODES = ("none", "etcd", "lease", "file")


@dataclass(frozen=True)
class BrokerSettings(SecuritySettings):
    """Everything a broker process can be told; every field has a production default."""

    cluster: str = doc("DefaultCluster", "Cluster this broker belongs to, as registered.")
    broker_name: str = doc("broker-a", "Name of this broker in routes; unique within the cluster.")
    listen: str = doc(
        "127.0.0.1:10911",
        "host:port the gRPC server binds (port 0 picks a free port). The default serves this "
        "machine only: set `0.0.0.0:10911` to serve others (the container images and the Helm "
        "chart do).",
    )
    advertised_address: str = doc(
        "",
        "host:port put in routes: an address clients can reach. Empty: `127.0.0.1:<bound "
        "port>` when listening on 0.0.0.0 or 127.0.0.1, else the listen host and the bound "
        "port. In Kubernetes set it to the pod's DNS name behind the headless Service (e.g. "
        "`apogee-broker-0.apogee-broker.<ns>.svc.cluster.local:10911`), never a bare pod IP.",
    )
    namesrv: str = doc(
        "127.0.0.1:9876",
        "Nameservers to register with, `host:port` separated by `;`. Empty: register nowhere.",
    )
    data_dir: Path = doc(
        Path("./data/broker-a"), "Directory of the store and the metadata files (topics.json)."
    )
    flush_mode: FlushMode = doc(
        FlushMode.ASYNC,
        "`sync`: a send is acknowledged once fsynced (group commit); `async`: once written to "
        "the page cache (survives a process crash, not a power loss).",
    )
    auto_create_topics: bool = doc(
        False,
        "Create an unknown topic on its first send, copying TBW102 (RocketMQ's "
        "autoCreateTopicEnable). Off in production: create topics explicitly.",
    )
    default_topic_queues: int = doc(
        8, "Queue count of TBW102 and so of auto-created topics (read and write)."
    )
    heartbeat_interval_s: float = doc(
        30.0, "How often the broker registers again with every nameserver (its heartbeat)."
    )
    register_timeout_s: float = doc(3.0, "Deadline of one registration call to one nameserver.")
    max_message_size: int = doc(4 * MiB, "Largest message body accepted, in bytes.")
    commitlog_file_size: int = doc(
        GiB, "Size of each CommitLog file in bytes. Fixed for the life of a store."
    )
    consume_queue_entries_per_file: int = doc(
        300_000, "Entries (20 bytes each) per ConsumeQueue file. Fixed for the life of a store."
    )
    consume_queue_open_files: int = doc(
        0,
        "Most ConsumeQueue files open at once; the least recently used closes when another "
        "must open. 0: a quarter of the process's open-file limit, between 64 and 4096.",
    )
    consume_queue_idle_close_s: float = doc(
        60.0, "A ConsumeQueue file neither read nor written for this long is closed."
    )
    index_slots: int = doc(5_000_000, "Hash slots per IndexFile.")
    index_entries_per_file: int = doc(
        20_000_000, "Entries per IndexFile; a full file is followed by a new one."
    )
    max_messages_per_request: int = doc(1024, "Most messages one SendMessages call may carry.")
    retention_hours: float = doc(
        72.0,
        "CommitLog files last written longer ago are deleted (with their queue and index "
        "entries); consumers behind them continue at the earliest message kept.",
    )
    retention_check_interval_s: float = doc(10.0, "How often retention looks for old files.")
    disk_high_water_ratio: float = doc(
        0.75, "Above this share of the disk in use, the oldest files go whatever their age."
    )
    long_poll_max_ms: int = doc(
        15_000,
        "Longest a pull that finds nothing new is held waiting for a message (RocketMQ's "
        "long polling); a pull's own hold_ms and its call deadline cap it further.",
    )
    pull_max_messages: int = doc(
        1024, "Most messages one pull answers; a pull asking for 0 gets 32."
    )
    pull_max_bytes: int = doc(
        4 * MiB,
        "Most record bytes one pull answers (at least one message is always answered, even a "
        "larger one).",
    )
    delivery_coalesce_ms: float = doc(
        1.0,
        "A consumer's delivery stream that answered less than this long ago waits out the rest "
        "before its next answer, which then carries whatever arrived meanwhile on any of its "
        "queues (one write instead of one per arrival); an idle stream answers at once. 0: off.",
    )
    consumer_expiry_ms: int = doc(
        120_000,
        "A consumer that has sent no heartbeat for this long is dropped from its group (one "
        "whose session stream ends is dropped at once).",
    )
    offset_persist_interval_s: float = doc(
        5.0,
        "How often committed consumer offsets are written to consumerOffset.json (and at "
        "stop); a crash loses at most this much progress, which consumers then re-read.",
    )
    producer_expiry_s: float = doc(
        30.0,
        "A transactional producer whose session sent no heartbeat for this long (or for three "
        "of the heartbeat intervals it declared, when that is longer) is forgotten, and checks "
        "of its group go to the others; one whose session stream ends is forgotten at once. "
        "Also how long a new session may take to say hello.",
    )
    lock_expiry_ms: int = doc(
        60_000,
        "A queue lock (orderly consumption) not renewed for this long is released, so a "
        "crashed holder cannot block its queue.",
    )
    delay_levels: str = doc(
        DEFAULT_DELAY_LEVELS,
        "The delay table: delay level N waits the Nth duration (units ms, s, m, h, d; at most "
        "32 levels). Retries use it too: retry n waits level `first_retry_delay_level` + n - 1.",
    )
    dedup_window_s: float = doc(
        600.0,
        "How long a message sent with an `APOGEE_DEDUP_ID` property (as idempotent producers "
        "and the Spark sink send them) is remembered: another of the same topic with the same "
        "id within it is not stored again. Messages without that property are never looked "
        "at; 0 turns it off. Read back from the CommitLog at start-up (after a crash too): "
        "about 0.5 s per 100,000 ids in the window (docs/storage.md).",
    )
    dedup_max_ids: int = doc(
        1_000_000, "Most dedup ids remembered at once (memory); the oldest go first."
    )
    timer_max_delay_s: float = doc(
        7 * 86_400.0,
        "Furthest ahead a timer message may be due (`deliver_at_ms`); later ones are refused "
        "with this cap in the error.",
    )
    timer_slot_ms: int = doc(
        60_000,
        "Width of one slot of the timer wheel (see docs/schedule.md). Fixed once the broker "
        "has data: it refuses to start with another value.",
    )
    timer_slots: int = doc(
        1440,
        "Slots of the timer wheel; timer messages further ahead than (timer_slots - 4) * "
        "timer_slot_ms are stored again when their slot comes up. Fixed once the broker has "
        "data. Keep the wheel's span well under retention_hours.",
    )
    max_reconsume_times: int = doc(
        16,
        "Retries of a failed message before it goes to the group's dead-letter topic, for "
        "consumers that do not say (RocketMQ's maxReconsumeTimes).",
    )
    first_retry_delay_level: int = doc(
        3, "Delay level of a group's first retry, for consumers that do not say (then +1 each)."
    )
    shutdown_grace_s: float = doc(
        10.0, "On SIGTERM, how long calls in flight may take to finish before they are cut."
    )
    metrics_listen: str = doc("127.0.0.1:10912", metrics_listen_doc(10911))
    metrics_max_topics: int = doc(
        1000,
        "Most topics with a label of their own in the metrics: the first ones seen keep "
        "theirs for the life of the process, later ones are counted under `other`.",
    )
    metrics_max_groups: int = doc(
        1000,
        "Most consumer groups with a label of their own in the metrics (as metrics_max_topics).",
    )
    log_level: str = doc("INFO", "Logging level: DEBUG, INFO, WARNING or ERROR.")
    replication: str = doc(
        "none",
        "How this broker's replica group decides its leader (docs/replication.md): `none`, a "
        "lone broker holding the only copy; `etcd`, the group's record in etcd "
        "(`etcd_endpoints`); `lease`, the record in a Kubernetes Lease `<lease_prefix>-"
        "<broker_name>` (in a cluster: the Helm chart's groups); `file`, the record in "
        "`replica_group_dir` on a file system all "
        "replicas share (one machine: `apogee cluster up --replicas`). Every replica of a "
        "group has the same `broker_name` and its own `data_dir`.",
    )
    replicas: int = doc(
        3,
        "How many replicas the group has (this one included): a group with fewer in sync is "
        "under-replicated (metrics, alerts, `apogee broker describe`).",
    )
    etcd_endpoints: str = doc(
        "",
        "etcd client endpoints, `host:port` separated by `,` (replication = etcd).",
    )
    lease_namespace: str = doc(
        "",
        "The namespace of the group's Lease (replication = lease); empty: `$POD_NAMESPACE`, "
        "else the pod's service account's, else `default`. The API server is found from the "
        "pod's service account, or outside a pod from `$KUBECONFIG`.",
    )
    lease_prefix: str = doc(
        "apogee-replicas",
        "The group's Lease is named `<lease_prefix>-<broker_name>` (replication = lease).",
    )
    replica_group_dir: Path = doc(
        Path(""),
        "Directory holding the group's record and leader lock (replication = file); the same "
        "for every replica of the group.",
    )
    replica_lease_s: float = doc(
        2.0,
        "How long a leader that stops renewing keeps its claim (in etcd or the Lease): a "
        "follower campaigns "
        "this long after the leader dies. The epoch, not this lease, fences an old leader.",
    )
    acks: str = doc(
        "all",
        "`all`: a send is acknowledged once every member of the in-sync set has it (and "
        "refused, retriably, while the set is smaller than `min_insync_replicas`); `leader`: "
        "once the leader stored it, which loses what followers had not copied when the leader "
        "dies (docs/replication.md).",
    )
    min_insync_replicas: int = doc(
        2,
        "Fewest replicas (the leader included) that must hold a message before it is "
        "acknowledged with acks = all.",
    )
    replica_lag_max_s: float = doc(
        10.0,
        "A follower that has not caught up with the leader for this long leaves the in-sync "
        "set; it rejoins once it has caught up.",
    )
    replication_timeout_s: float = doc(
        15.0,
        "Longest a send waits for the in-sync set to confirm it before it is answered "
        "NOT_REPLICATED (stored on the leader, outcome unknown).",
    )
    unclean_election: bool = doc(
        False,
        "Let a replica outside the in-sync set lead when no in-sync one is left: the group "
        "serves again, and loses what only the others had. Off: it waits for one of them.",
    )

    def __post_init__(self) -> None:
        for name in ("cluster", "broker_name"):
            value = getattr(self, name)
            if not value or any(c.isspace() for c in value):
                raise InvalidArgumentError(
                    field=name, rule=f"must be non-empty without spaces, got {value!r}"
                )
        check_address("listen", self.listen, allow_port_zero=True)
        check_metrics_listen(self.metrics_listen)
        if self.advertised_address:
            check_address("advertised_address", self.advertised_address)
        parse_nameservers(self.namesrv)
        if not 1 <= self.default_topic_queues <= 1024:
            raise InvalidArgumentError(
                field="default_topic_queues",
                rule=f"must be between 1 and 1024, got {self.default_topic_queues}",
            )
        for name in ("heartbeat_interval_s", "register_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(field=name, rule="must be positive")
        if self.shutdown_grace_s < 0:
            raise InvalidArgumentError(field="shutdown_grace_s", rule="must not be negative")
        if self.max_messages_per_request < 1:
            raise InvalidArgumentError(field="max_messages_per_request", rule="must be at least 1")
        for name, least, most in (
            ("long_poll_max_ms", 0, 3_600_000),
            ("pull_max_messages", 1, 65_536),
            ("pull_max_bytes", 1024, PULL_BYTES_LIMIT),
            ("consumer_expiry_ms", 1000, 86_400_000),
            ("lock_expiry_ms", 1000, 86_400_000),
            ("metrics_max_topics", 0, 1_000_000),
            ("metrics_max_groups", 0, 1_000_000),
        ):
            value = getattr(self, name)
            if not least <= value <= most:
                raise InvalidArgumentError(
                    field=name, rule=f"must be between {least} and {most}, got {value}"
                )
        if not 0 <= self.delivery_coalesce_ms <= 100:
            raise InvalidArgumentError(
                field="delivery_coalesce_ms",
                rule=f"must be between 0 and 100, got {self.delivery_coalesce_ms}",
            )
        if not 0 < self.producer_expiry_s <= 86_400:
            raise InvalidArgumentError(
                field="producer_expiry_s",
                rule=f"must be above 0 and at most 86400, got {self.producer_expiry_s}",
            )
        if not 0 < self.offset_persist_interval_s <= 3600:
            raise InvalidArgumentError(
                field="offset_persist_interval_s",
                rule=f"must be above 0 and at most 3600, got {self.offset_persist_interval_s}",
            )
        delays = parse_delay_levels(self.delay_levels)
        for name, least, most in (
            ("timer_slot_ms", 10, 3_600_000),
            ("timer_slots", 8, 100_000),
            ("max_reconsume_times", 0, 10_000),
            ("first_retry_delay_level", 1, len(delays)),
        ):
            value = getattr(self, name)
            if not least <= value <= most:
                raise InvalidArgumentError(
                    field=name, rule=f"must be between {least} and {most}, got {value}"
                )
        if self.dedup_window_s < 0:
            raise InvalidArgumentError(
                field="dedup_window_s", rule=f"must be 0 (off) or more, got {self.dedup_window_s}"
            )
        if self.dedup_max_ids < 1:
            raise InvalidArgumentError(
                field="dedup_max_ids", rule=f"must be at least 1, got {self.dedup_max_ids}"
            )
        if not 0 < self.timer_max_delay_s <= 10 * 365 * 86_400:
            raise InvalidArgumentError(
                field="timer_max_delay_s",
                rule=f"must be above 0 and at most ten years, got {self.timer_max_delay_s}",
            )
        if self.log_level.upper() not in _LOG_LEVELS:
            raise InvalidArgumentError(
                field="log_level",
                rule=f"{self.log_level!r} is not one of {', '.join(_LOG_LEVELS)}",
            )
        if self.replication not in REPLICATION_MODES:
            raise InvalidArgumentError(
                field="replication",
                rule=f"{self.replication!r} is not one of {', '.join(REPLICATION_MODES)}",
            )
        if self.acks not in ("all", "leader"):
            raise InvalidArgumentError(
                field="acks", rule=f"must be `all` or `leader`, got {self.acks!r}"
            )
        if self.replication == "etcd":
            if not self.etcd_endpoints_list:
                raise InvalidArgumentError(
                    field="etcd_endpoints",
                    rule="must name at least one host:port (replication = etcd)",
                )
            for endpoint in self.etcd_endpoints_list:
                check_address("etcd_endpoints", endpoint)
        if self.replication == "lease":
            from apogee.service.lease_group import group_lease_name  # noqa: PLC0415

            try:
                group_lease_name(self.lease_prefix, self.broker_name)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(
                    field="lease_prefix", rule=f"{exc.details['rule']} (replication = lease)"
                ) from None
        if self.replication == "file" and not str(self.replica_group_dir).strip(". "):
            raise InvalidArgumentError(
                field="replica_group_dir", rule="must be set (replication = file)"
            )
        for seconds_name, fewest, most_s in (
            ("replica_lease_s", 1.0, 60.0),
            ("replica_lag_max_s", 0.2, 3600.0),
            ("replication_timeout_s", 0.1, 3600.0),
        ):
            seconds = getattr(self, seconds_name)
            if not fewest <= seconds <= most_s:
                raise InvalidArgumentError(
                    field=seconds_name,
                    rule=f"must be between {fewest} and {most_s}, got {seconds}",
                )
        if not 1 <= self.replicas <= 16:
            raise InvalidArgumentError(
                field="replicas", rule=f"must be between 1 and 16, got {self.replicas}"
            )
        if not 1 <= self.min_insync_replicas <= self.replicas:
            raise InvalidArgumentError(
                field="min_insync_replicas",
                rule=f"must be between 1 and replicas ({self.replicas}), got "
                f"{self.min_insync_replicas}",
            )
        self.check_security(calls_services=True)
        self.store_config()  # the store checks its sizes (e.g. max_message_size vs file size)

    @property
    def etcd_endpoints_list(self) -> list[str]:
        """The etcd endpoints of ``etcd_endpoints``, in order."""
        return [e.strip() for e in self.etcd_endpoints.split(",") if e.strip()]

    @property
    def replicated(self) -> bool:
        return self.replication != "none"

    @property
    def nameservers(self) -> list[str]:
        """The nameserver addresses of ``namesrv``, in order, without duplicates."""
        return parse_nameservers(self.namesrv)

    def store_config(self) -> StoreConfig:
        """The store's settings derived from these."""
        return StoreConfig(
            commitlog_file_size=self.commitlog_file_size,
            consume_queue_entries_per_file=self.consume_queue_entries_per_file,
            consume_queue_open_files=self.consume_queue_open_files,
            consume_queue_idle_close_s=self.consume_queue_idle_close_s,
            index_slots=self.index_slots,
            index_entries_per_file=self.index_entries_per_file,
            flush_mode=self.flush_mode,
            max_message_size=self.max_message_size,
            retention_hours=self.retention_hours,
            retention_check_interval_s=self.retention_check_interval_s,
            disk_high_water_ratio=self.disk_high_water_ratio,
            # the schedule topic: 32 delay-level queues, then the timer wheel's slots
            max_queues_per_topic=max(1024, self.schedule_layout().queue_count),
        )

    def schedule_layout(self) -> ScheduleLayout:
        """The schedule topic's queues: delay levels and the timer wheel."""
        return ScheduleLayout(
            parse_delay_levels(self.delay_levels), self.timer_slot_ms, self.timer_slots
        )

    def advertised(self, bound_port: int) -> str:
        """The address put in routes, given the port the server actually bound."""
        if self.advertised_address:
            return self.advertised_address
        host = self.listen.rpartition(":")[0]
        if host in _LOCAL_HOSTS:
            return f"127.0.0.1:{bound_port}"
        return f"{host}:{bound_port}"


def store_host_of(address: str) -> str:
    """The ``ip:port`` form of an advertised address, as the store records it in every message
    (the record holds an IP, not a name). A DNS name is resolved once; an address that does not
    resolve is recorded as empty."""
    host, _, port = address.rpartition(":")
    bare = host.strip("[]")
    try:
        ipaddress.ip_address(bare)
        return address
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(bare, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return ""
    for family, _, _, _, sockaddr in infos:
        if family == socket.AF_INET:
            return f"{sockaddr[0]}:{port}"
    for _, _, _, _, sockaddr in infos:
        return f"[{sockaddr[0]}]:{port}"
    return ""


def load_settings(
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: object,
) -> BrokerSettings:
    """Settings from defaults, ``config_file``, ``env`` (the process environment by default)
    and command-line ``overrides`` (``None``: not given)."""
    return load(
        BrokerSettings, "broker", config_file, os.environ if env is None else env, **overrides
    )


def config_reference() -> str:
    """This package's section of docs/configuration.md."""
    return render_class(
        BrokerSettings,
        "Broker (`apogee_broker.settings.BrokerSettings`)",
        "The broker service: `[broker]` in its config file, `APOGEE_BROKER_<SETTING>` in the "
        "environment, a few also as flags (`--listen`, `--data-dir`, `--name`, `--namesrv`).",
    )
