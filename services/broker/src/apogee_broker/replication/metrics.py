"""The replica group's Prometheus metrics (docs/metrics.md lists them for operators), read from
a :class:`~.node.ReplicaNode` when Prometheus scrapes.

Every replica, whatever its role, exports

- ``apogee_broker_replica_role{broker, replica, role}``: 1 for its role (``LEADER``,
  ``FOLLOWER`` or ``CANDIDATE``), 0 for the other two, so that "no replica leads" is a query;
- ``apogee_broker_replica_epoch{broker, replica}``: the epoch it leads or last read in the
  group's record;
- ``apogee_broker_replica_log_end_bytes{broker, replica}``: where its CommitLog ends (absent
  before its store is open and after it closed);
- ``apogee_broker_replica_high_watermark_bytes{broker, replica}``: a leader's high watermark,
  a follower's the last one its leader told it (absent for a candidate: it has none);
- ``apogee_broker_replica_leader_terms_total{broker, replica}``: the terms it has led;
- ``apogee_broker_replica_refusals_total{broker, reason}``: writes its terms as leader refused
  (``not_enough_replicas``) or could not confirm (``not_replicated``); 0 until the first.

A leader adds the in-sync set: ``apogee_broker_replica_in_sync{broker}`` (its size),
``apogee_broker_replica_min_in_sync{broker}`` (``min_insync_replicas``),
``apogee_broker_replica_under_replicated{broker}`` (1 while the set is smaller than
``replicas``), and per follower that fetched in its term
``apogee_broker_replica_follower_lag_bytes{broker, follower}`` and
``apogee_broker_replica_follower_lag_seconds{broker, follower}`` (0 while it has everything,
else how long since it last had; ``DescribeReplica`` reports the same).

Each term has a :class:`~.leader.ReplicationLeader` of its own, whose refusal counts start at
0. The collector keeps the totals of the terms it saw end and adds the current term's, so the
counter never goes down within a process (refusals of a term after the last scrape before it
ended are not seen).

The node's state lives on its event loop and is read here from the scrape thread without a
lock: each value is one attribute read (a dict is copied in one step), and a part that fails
anyway is logged and left out of that scrape. A scrape never raises.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Final, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

#: The roles a replica moves between (:attr:`ReplicaNode.role`).
ROLES: Final = ("LEADER", "FOLLOWER", "CANDIDATE")
#: Why a leader refused or could not confirm a write (:attr:`ReplicationLeader.refusals`).
REFUSAL_REASONS: Final = ("not_enough_replicas", "not_replicated")


class SettingsView(Protocol):
    @property
    def broker_name(self) -> str: ...
    @property
    def replicas(self) -> int: ...
    @property
    def min_insync_replicas(self) -> int: ...


class RecordView(Protocol):
    @property
    def epoch(self) -> int: ...


class CommitLogView(Protocol):
    @property
    def max_offset(self) -> int: ...


class StoreView(Protocol):
    @property
    def commitlog(self) -> CommitLogView: ...
    @property
    def closed(self) -> bool: ...


class FollowerStateView(Protocol):
    """What the leader knows of one follower (:class:`~.leader.FollowerState`)."""

    @property
    def replica_id(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def caught_up_at(self) -> float: ...


class LeaderView(Protocol):
    @property
    def epoch(self) -> int: ...
    @property
    def in_sync(self) -> Collection[str]: ...
    @property
    def followers(self) -> Mapping[str, FollowerStateView]: ...
    @property
    def written_end(self) -> int: ...
    @property
    def hw(self) -> int: ...
    @property
    def refusals(self) -> Mapping[str, int]: ...


class FollowerView(Protocol):
    @property
    def high_watermark(self) -> int: ...


class NodeView(Protocol):
    """What the collector reads of a :class:`~.node.ReplicaNode`."""

    @property
    def role(self) -> str: ...
    @property
    def replica_id(self) -> str: ...
    @property
    def record(self) -> RecordView: ...
    @property
    def terms(self) -> int: ...
    @property
    def leader(self) -> LeaderView | None: ...
    @property
    def follower(self) -> FollowerView | None: ...
    @property
    def store(self) -> StoreView | None: ...
    @property
    def settings(self) -> SettingsView: ...


class ReplicationCollector(Collector):
    """The replica group's metrics of ``node``, computed when Prometheus scrapes (see the
    module docstring); ``monotonic`` is the clock of :attr:`FollowerState.caught_up_at`."""

    def __init__(self, node: NodeView, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.monotonic = monotonic
        self._lock = threading.Lock()
        #: refusals of the terms seen to end
        self._past: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)
        #: the term whose counts are in ``_current``: (id of its leader, epoch)
        self._term: tuple[int, int] | None = None
        self._current: dict[str, int] = {}

    def describe(self) -> Iterable[Metric]:
        return []  # computed at scrape time: nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        try:
            broker = str(self.node.settings.broker_name)
        except Exception:
            log.exception("replication metrics: the broker's name cannot be read; none exported")
            return
        steps: tuple[Callable[[str], Iterable[Metric]], ...] = (
            self._role,
            self._positions,
            self._counters,
            self._leader,
        )
        for step in steps:
            try:
                # a step's metrics are built whole before any is exported: a failure leaves
                # the step out, never half of it
                yield from list(step(broker))
            except Exception:
                log.exception(
                    "replication metrics: %s failed; its metrics are left out", step.__name__
                )

    def _role(self, broker: str) -> Iterable[Metric]:
        node = self.node
        labels = (broker, str(node.replica_id))
        role = GaugeMetricFamily(
            "apogee_broker_replica_role",
            "This replica's role in its group: 1 for the role it has (LEADER, FOLLOWER, or "
            "CANDIDATE: neither yet), 0 for the others.",
            labels=("broker", "replica", "role"),
        )
        current = str(node.role)
        for name in ROLES:
            role.add_metric((*labels, name), 1 if current == name else 0)
        yield role
        leader = node.leader
        epoch = GaugeMetricFamily(
            "apogee_broker_replica_epoch",
            "The group's epoch: the one this replica leads, else the last it read in the "
            "group's record.",
            labels=("broker", "replica"),
        )
        epoch.add_metric(labels, leader.epoch if leader is not None else node.record.epoch)
        yield epoch

    def _positions(self, broker: str) -> Iterable[Metric]:
        node = self.node
        labels = (broker, str(node.replica_id))
        leader = node.leader
        store = node.store
        if store is not None and not store.closed:
            end = GaugeMetricFamily(
                "apogee_broker_replica_log_end_bytes",
                "Where this replica's CommitLog ends (its offset in bytes).",
                labels=("broker", "replica"),
            )
            end.add_metric(labels, store.commitlog.max_offset)
            yield end
        follower = node.follower
        hw = (
            leader.hw
            if leader is not None
            else follower.high_watermark
            if follower is not None
            else None
        )
        if hw is not None:
            high = GaugeMetricFamily(
                "apogee_broker_replica_high_watermark_bytes",
                "The high watermark (offset in bytes below which the in-sync set has every "
                "message): a leader's own, a follower's the last its leader told it.",
                labels=("broker", "replica"),
            )
            high.add_metric(labels, hw)
            yield high

    def _counters(self, broker: str) -> Iterable[Metric]:
        node = self.node
        terms = CounterMetricFamily(
            "apogee_broker_replica_leader_terms",
            "Terms this replica has led (elections it won) since it started.",
            labels=("broker", "replica"),
        )
        terms.add_metric((broker, str(node.replica_id)), node.terms)
        yield terms
        refusals = CounterMetricFamily(
            "apogee_broker_replica_refusals",
            "Writes this replica refused as leader (not_enough_replicas: the in-sync set "
            "smaller than min_insync_replicas, nothing stored) or could not confirm "
            "(not_replicated: stored, not confirmed within replication_timeout_s), acks = all.",
            labels=("broker", "reason"),
        )
        for reason, count in sorted(self._refusal_totals(node.leader).items()):
            refusals.add_metric((broker, reason), count)
        yield refusals

    def _refusal_totals(self, leader: LeaderView | None) -> dict[str, int]:
        """The refusals of every term seen so far, the current one's included."""
        now = dict(leader.refusals) if leader is not None else {}
        term = (id(leader), leader.epoch) if leader is not None else None
        with self._lock:
            if term != self._term:
                for reason, count in self._current.items():
                    self._past[reason] = self._past.get(reason, 0) + count
                self._term, self._current = term, {}
            for reason, count in now.items():
                self._current[reason] = max(self._current.get(reason, 0), int(count))
            totals = dict(self._past)
            for reason, count in self._current.items():
                totals[reason] = totals.get(reason, 0) + count
        return totals

    def _leader(self, broker: str) -> Iterable[Metric]:
        node = self.node
        leader = node.leader
        if leader is None:
            return
        settings = node.settings
        in_sync = len(leader.in_sync)
        yield _one(
            GaugeMetricFamily(
                "apogee_broker_replica_in_sync",
                "Replicas in the in-sync set, the leader included (exported by the leader).",
                labels=("broker",),
            ),
            broker,
            in_sync,
        )
        yield _one(
            GaugeMetricFamily(
                "apogee_broker_replica_min_in_sync",
                "min_insync_replicas: with acks = all, writes are refused while the in-sync set "
                "is smaller (exported by the leader).",
                labels=("broker",),
            ),
            broker,
            settings.min_insync_replicas,
        )
        yield _one(
            GaugeMetricFamily(
                "apogee_broker_replica_under_replicated",
                "1 while the in-sync set is smaller than the group's replicas, else 0 (exported "
                "by the leader).",
                labels=("broker",),
            ),
            broker,
            1 if in_sync < settings.replicas else 0,
        )
        lag_bytes = GaugeMetricFamily(
            "apogee_broker_replica_follower_lag_bytes",
            "Bytes of the leader's log a follower does not have yet, as of its last fetch "
            "(exported by the leader, per follower that fetched in its term).",
            labels=("broker", "follower"),
        )
        lag_seconds = GaugeMetricFamily(
            "apogee_broker_replica_follower_lag_seconds",
            "Seconds since a follower last had everything the leader had; 0 while it has "
            "(exported by the leader, per follower that fetched in its term).",
            labels=("broker", "follower"),
        )
        written_end = leader.written_end
        now = self.monotonic()
        for f in list(leader.followers.values()):
            behind = max(0, written_end - f.offset)
            lag_bytes.add_metric((broker, f.replica_id), behind)
            lag_seconds.add_metric(
                (broker, f.replica_id), max(0.0, now - f.caught_up_at) if behind else 0.0
            )
        yield lag_bytes
        yield lag_seconds


def _one(family: GaugeMetricFamily, label: str, value: float) -> GaugeMetricFamily:
    family.add_metric((label,), value)
    return family
