"""The broker's Prometheus metrics, declared once (docs/metrics.md lists them for operators).

Two kinds:

- counted as things happen (:class:`BrokerMetrics`): traffic per topic, sends, the store's
  appends and flushes, pulls and pushes, retries and dead letters, transaction ends and checks.
  The hot paths pay one call per batch, not per message: each topic's label children are bound
  once and cached (:meth:`BrokerMetrics.topic`), and a batch of one topic (the usual case) adds
  its count and bytes in one step;
- read when Prometheus scrapes (:class:`BrokerCollector`): the store's disk and dispatch
  backlog, the last recovery, consumer groups (lag, members), delayed messages waiting, and
  transactions pending, from what the broker already keeps. Lag that cannot be computed (a group
  that committed nothing on a topic, a message whose store time cannot be read) is left out,
  never reported as 0 or -1.

This module imports nothing of the broker's core: what the collector reads comes in through
:class:`BrokerSources` (small interfaces and callables the app wires), and the core counts on a
:class:`BrokerMetrics` handed to it.

Topic and group labels are capped (``metrics_max_topics``, ``metrics_max_groups``): the first
values seen keep their own label for the life of the process, later ones are counted under
``other`` (:class:`apogee.common.metrics.LabelCap`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.metrics import OTHER, LabelCap
from apogee.common.topics import TRANS_CHECK_MAX_TIME_TOPIC
from apogee.service.metrics import on_loop
from apogee.store import AppendResult

if TYPE_CHECKING:
    from apogee.store import MessageStore

log = logging.getLogger(__name__)

#: Seconds buckets of the latency histograms: 100 us to 10 s.
LATENCY_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: Seconds buckets of long-poll holds: up to the 15 s hold (and a little over).
HOLD_BUCKETS: Final = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0)
#: How long a scrape waits for the event loop to hand over its state.
LOOP_TIMEOUT_S: Final = 5.0
#: Most pending transactions a scrape lists (the count stops there).
MAX_PENDING_COUNTED: Final = 10_000

_TOPIC = itemgetter(0)
_SIZE = itemgetter(4)


class TopicTraffic:
    """The pre-bound counters of one topic (its label capped)."""

    __slots__ = ("bytes_in", "bytes_out", "messages_in", "messages_out")

    def __init__(self, m: BrokerMetrics, label: str) -> None:
        self.messages_in = m.messages_in.labels(label)
        self.bytes_in = m.bytes_in.labels(label)
        self.messages_out = m.messages_out.labels(label)
        self.bytes_out = m.bytes_out.labels(label)


class BrokerMetrics:
    """The broker's counters and histograms, on ``registry`` (a fresh one when None)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        max_topics: int = 1000,
        max_groups: int = 1000,
    ) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.topic_cap = LabelCap(max_topics)
        self.group_cap = LabelCap(max_groups)
        self._topics: dict[str, TopicTraffic] = {}
        self._groups: dict[str, tuple[Counter, Counter]] = {}
        t = ("topic",)
        self.messages_in = Counter(
            "apogee_broker_messages_in", "Messages stored, by topic.", t, registry=r
        )
        self.bytes_in = Counter(
            "apogee_broker_bytes_in", "Bytes of the records stored, by topic.", t, registry=r
        )
        self.messages_out = Counter(
            "apogee_broker_messages_out",
            "Messages answered to consumers (pulls and push deliveries), by topic.",
            t,
            registry=r,
        )
        self.bytes_out = Counter(
            "apogee_broker_bytes_out",
            "Bytes of the records answered to consumers, by topic.",
            t,
            registry=r,
        )
        self.send_latency = Histogram(
            "apogee_broker_send_latency_seconds",
            "Time to answer one send request (all its messages), from its arrival.",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.send_errors = Counter(
            "apogee_broker_send_errors",
            "Messages refused or not confirmed by a send, by error kind.",
            ("kind",),
            registry=r,
        )
        self.append_latency = Histogram(
            "apogee_broker_store_append_latency_seconds",
            "Time of one append to the CommitLog (a request's batch), durability wait excluded.",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.flush_latency = Histogram(
            "apogee_broker_store_flush_latency_seconds",
            "Time of one CommitLog flush that wrote data (write and fdatasync).",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.pulls = Counter(
            "apogee_broker_pulls",
            "Pull requests answered, by whether any message came back.",
            ("result",),
            registry=r,
        )
        self._pull_found = self.pulls.labels("found")
        self._pull_empty = self.pulls.labels("empty")
        self.long_polls = Counter(
            "apogee_broker_long_polls",
            "Pulls held waiting for a message (long polling).",
            registry=r,
        )
        self.long_poll_hold = Histogram(
            "apogee_broker_long_poll_hold_seconds",
            "How long a held pull waited before it was answered.",
            registry=r,
            buckets=HOLD_BUCKETS,
        )
        g = ("group",)
        self.retries = Counter(
            "apogee_broker_retry_messages",
            "Messages sent back for a retry (to %RETRY%<group>), by consumer group.",
            g,
            registry=r,
        )
        self.dead_letters = Counter(
            "apogee_broker_dlq_messages",
            "Messages moved to the dead-letter topic (%DLQ%<group>), by consumer group.",
            g,
            registry=r,
        )
        self.rebalances = Counter(
            "apogee_broker_group_rebalances",
            "Membership changes of a consumer group seen by this broker (each makes the "
            "group's consumers rebalance), by group.",
            g,
            registry=r,
        )
        self.txn_ends = Counter(
            "apogee_broker_txn_ends",
            "EndTransaction answers, by outcome and by who decided (producer, check, operator).",
            ("outcome", "source"),
            registry=r,
        )
        self.txn_checks = Counter(
            "apogee_broker_txn_checks",
            "CheckHalf answers to the transaction checker, by outcome.",
            ("outcome",),
            registry=r,
        )
        self.v2_requests = Counter(
            "apogee_broker_v2_requests",
            "Requests of the official RocketMQ 5 clients (apache.rocketmq.v2), by RPC and by "
            "the code answered (OK, MESSAGE_NOT_FOUND, TOPIC_NOT_FOUND, ...).",
            ("rpc", "code"),
            registry=r,
        )
        self.v2_latency = Histogram(
            "apogee_broker_v2_request_latency_seconds",
            "Time to answer one apache.rocketmq.v2 request (a receive: its long poll included), "
            "by RPC.",
            ("rpc",),
            registry=r,
            buckets=HOLD_BUCKETS,
        )
        self.pop_messages = Counter(
            "apogee_broker_pop_messages",
            "POP consumption (official clients), by consumer group and event: received (handed "
            "out), acked, nacked (invisible time changed), expired (invisible time ran out: "
            "handed out again), dead_lettered.",
            ("group", "event"),
            registry=r,
        )

    # -- the hot paths ----------------------------------------------------------------------

    def topic(self, name: str) -> TopicTraffic:
        """The counters of topic ``name``, bound once."""
        t = self._topics.get(name)
        if t is None:
            label = self.topic_cap(name)
            t = self._topics.get(label) if label == OTHER else None
            if t is None:
                t = TopicTraffic(self, label)
            if len(self._topics) < 4 * max(self.topic_cap.limit, 1) + 1024:
                self._topics[name] = t
        return t

    def stored(self, results: Sequence[AppendResult]) -> None:
        """Count an append's messages and bytes by topic."""
        n = len(results)
        if not n:
            return
        first = results[0].topic
        if n == 1 or len(set(map(_TOPIC, results))) == 1:
            t = self.topic(first)
            t.messages_in.inc(n)
            t.bytes_in.inc(sum(map(_SIZE, results)) if n > 1 else results[0].size)
            return
        by_topic: dict[str, list[int]] = {}
        for r in results:
            acc = by_topic.get(r.topic)
            if acc is None:
                by_topic[r.topic] = [1, r.size]
            else:
                acc[0] += 1
                acc[1] += r.size
        for name, (count, size) in by_topic.items():
            t = self.topic(name)
            t.messages_in.inc(count)
            t.bytes_in.inc(size)

    def sent_out(self, topic: str, count: int, nbytes: int) -> None:
        """Count messages answered to a consumer."""
        t = self.topic(topic)
        t.messages_out.inc(count)
        t.bytes_out.inc(nbytes)

    def pulled(self, topic: str, count: int, nbytes: int, held_s: float | None) -> None:
        """Count one pull (``held_s``: how long it was held, None when it was not)."""
        if count:
            self._pull_found.inc()
            self.sent_out(topic, count, nbytes)
        else:
            self._pull_empty.inc()
        if held_s is not None:
            self.long_polls.inc()
            self.long_poll_hold.observe(held_s)

    def send_failed(self, kinds: Iterable[str]) -> None:
        """Count refused (or unconfirmed) messages by their error kinds."""
        for kind in kinds:
            self.send_errors.labels(kind).inc()

    def _group(self, group: str) -> tuple[Counter, Counter]:
        g = self._groups.get(group)
        if g is None:
            label = self.group_cap(group)
            g = (self.retries.labels(label), self.dead_letters.labels(label))
            if len(self._groups) < 4 * max(self.group_cap.limit, 1) + 1024:
                self._groups[group] = g
        return g

    def sent_back(self, group: str, retries: int, dead: int) -> None:
        retry_child, dlq_child = self._group(group)
        if retries:
            retry_child.inc(retries)
        if dead:
            dlq_child.inc(dead)

    def v2_request(self, rpc: str, code: str, seconds: float) -> None:
        """Count one apache.rocketmq.v2 answer."""
        self.v2_requests.labels(rpc, code).inc()
        self.v2_latency.labels(rpc).observe(seconds)

    def pop(self, group: str, event: str, count: int = 1) -> None:
        """Count POP events of ``group``."""
        if count:
            self.pop_messages.labels(self.group_cap(group), event).inc(count)

    def members_changed(self, group: str, _client_ids: list[str]) -> None:
        """A membership listener of the consumer groups: one rebalance of ``group``."""
        self.rebalances.labels(self.group_cap(group)).inc()


class GroupLags(Protocol):
    """What the group gauges read of the consumer groups (the core's group administration):
    the groups known here and, per group, its members and (topic, queue, committed offset or
    None) of each of its queues, both on the loop; then each queue's (broker offset, consumer
    offset, lag in messages, lag in ms; -1: unknown), which reads the store, on the scrape
    thread."""

    def known_groups(self) -> Iterable[str]: ...

    def lag_inputs(self, group: str) -> tuple[Sized, Sequence[tuple[str, int, int | None]]]: ...

    def queue_lag(
        self, topic: str, queue_id: int, committed: int | None, now_ms: int
    ) -> tuple[int, int, int, int]: ...


#: Undecided transactions, counting at most the limit given: (still checked, given up, first
#: store time in ms of the oldest still checked or None); awaited on the loop.
PendingCount = Callable[[int], Coroutine[Any, Any, tuple[int, int, int | None]]]


@dataclass
class BrokerSources:
    """What :class:`BrokerCollector` reads: set by the app as it wires the broker."""

    loop: asyncio.AbstractEventLoop
    clock: Clock = SYSTEM_CLOCK
    store: MessageStore | None = None
    groups: GroupLags | None = None
    #: delayed and timer messages waiting, by level (``"1"`` .. ``"N"``, ``"timer"``); called
    #: on the loop
    schedule_waiting: Callable[[], Mapping[str, int]] | None = None
    pending_transactions: PendingCount | None = None


class BrokerCollector(Collector):
    """The broker's gauges, computed when Prometheus scrapes (on the scrape thread; what
    lives on the event loop is read there, with a bound)."""

    def __init__(self, sources: BrokerSources, metrics: BrokerMetrics) -> None:
        self.sources = sources
        self.metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []  # computed at scrape time: nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        s = self.sources
        steps: list[Callable[[], Iterable[Metric]]] = []
        if s.store is not None and not s.store.closed:
            steps.append(self._store)
        if s.groups is not None:
            steps.append(self._groups)
        if s.schedule_waiting is not None:
            steps.append(self._schedule)
        if s.pending_transactions is not None:
            steps.append(self._transactions)
        for step in steps:
            try:
                yield from step()
            except Exception:
                log.exception("metrics: %s failed; its metrics are left out", step.__name__)

    def _store(self) -> Iterable[Metric]:
        store = self.sources.store
        assert store is not None
        log_ = store.commitlog
        yield _gauge(
            "apogee_broker_commitlog_bytes",
            "Bytes of the CommitLog kept (from the earliest offset kept to the end).",
            log_.max_offset - log_.min_offset,
        )
        yield _gauge(
            "apogee_broker_dispatch_backlog_bytes",
            "CommitLog bytes written but not yet indexed into consume queues.",
            max(0, log_.max_offset - store.dispatcher.dispatched),
        )
        cqs = store.cqs
        yield _gauge(
            "apogee_broker_consume_queues",
            "Consume queues with files (queues ever written that retention has not emptied).",
            len(cqs.queues),
        )
        yield _gauge(
            "apogee_broker_consume_queue_open_files",
            "Consume queue files open now; at most consume_queue_open_files, and an idle "
            "queue's file closes after consume_queue_idle_close_s.",
            cqs.handles.open_count,
        )
        yield CounterMetricFamily(
            "apogee_broker_consume_queue_file_opens",
            "Times a consume queue file was opened: a rate that keeps up with reads means "
            "consume_queue_open_files is smaller than the queues in use.",
            value=cqs.handles.opened,
        )
        usage = shutil.disk_usage(store.root)
        yield _gauge(
            "apogee_broker_disk_free_bytes", "Free bytes of the data directory's disk.", usage.free
        )
        yield _gauge(
            "apogee_broker_disk_used_ratio",
            "Share of the data directory's disk in use (retention deletes the oldest files "
            "above disk_high_water_ratio).",
            usage.used / usage.total if usage.total else 0.0,
        )
        report = store.recovery
        yield _gauge(
            "apogee_broker_last_recovery_duration_seconds",
            "How long the store's recovery took when the broker last started.",
            report.seconds,
        )
        yield _gauge(
            "apogee_broker_last_recovery_truncated_bytes",
            "Bytes of torn CommitLog tail the last recovery truncated.",
            report.bytes_truncated,
        )
        result = (
            "quarantined"
            if report.files_quarantined
            else "truncated"
            if report.bytes_truncated
            else "ok"
        )
        info = GaugeMetricFamily(
            "apogee_broker_last_recovery",
            "The last recovery: after a clean stop or a crash, and its result (ok, truncated: "
            "a torn tail was cut, quarantined: damaged files were set aside). Always 1.",
            labels=("after", "result"),
        )
        info.add_metric(("clean_stop" if report.clean_shutdown else "crash", result), 1)
        yield info

    def _groups(self) -> Iterable[Metric]:
        admin = self.sources.groups
        assert admin is not None

        def inputs() -> list[tuple[str, int, Sequence[tuple[str, int, int | None]]]]:
            out: list[tuple[str, int, Sequence[tuple[str, int, int | None]]]] = []
            for group in admin.known_groups():
                members, queues = admin.lag_inputs(group)
                out.append((group, len(members), queues))
            return out

        got = on_loop(self.sources.loop, inputs, LOOP_TIMEOUT_S)
        if got is None:
            return
        cap = self.metrics.group_cap
        tcap = self.metrics.topic_cap
        members = GaugeMetricFamily(
            "apogee_broker_group_members",
            "Consumers of the group connected to this broker.",
            labels=("group",),
        )
        lag_msgs = GaugeMetricFamily(
            "apogee_broker_group_lag_messages",
            "Messages of the topic's queues on this broker the group has not consumed (summed "
            "over the queues it has committed an offset on; absent when it has none).",
            labels=("group", "topic"),
        )
        lag_secs = GaugeMetricFamily(
            "apogee_broker_group_lag_seconds",
            "Age of the oldest message the group has not consumed on the topic's queues on "
            "this broker (0: caught up; absent when no queue's age can be computed).",
            labels=("group", "topic"),
        )
        now = self.sources.clock.time_ms()
        member_sum: dict[str, int] = {}
        lags: dict[tuple[str, str], list[int]] = {}
        ages: dict[tuple[str, str], int] = {}
        for group, count, queues in got:
            glabel = cap(group)
            member_sum[glabel] = member_sum.get(glabel, 0) + count
            for topic, queue_id, committed in queues:
                if committed is None:
                    continue
                _, _, lag, lag_ms = admin.queue_lag(topic, queue_id, committed, now)
                key = (glabel, tcap(topic))
                if lag >= 0:
                    acc = lags.setdefault(key, [0])
                    acc[0] += lag
                if lag_ms >= 0:
                    ages[key] = max(ages.get(key, 0), lag_ms)
        for glabel, count in member_sum.items():
            members.add_metric((glabel,), count)
        for key, (lag,) in lags.items():
            lag_msgs.add_metric(key, lag)
        for key, ms in ages.items():
            lag_secs.add_metric(key, ms / 1000)
        yield members
        yield lag_msgs
        yield lag_secs

    def _schedule(self) -> Iterable[Metric]:
        waiting_by_level = self.sources.schedule_waiting
        assert waiting_by_level is not None
        by_level = on_loop(self.sources.loop, waiting_by_level, LOOP_TIMEOUT_S)
        if by_level is None:
            return
        waiting = GaugeMetricFamily(
            "apogee_broker_schedule_waiting_messages",
            "Delayed and timer messages stored here that the schedule service has not passed "
            "yet, by delay level (`timer`: the timer wheel).",
            labels=("level",),
        )
        for level, n in by_level.items():
            waiting.add_metric((level,), n)
        yield waiting

    def _transactions(self) -> Iterable[Metric]:
        count_pending = self.sources.pending_transactions
        assert count_pending is not None
        loop = self.sources.loop
        if loop.is_closed():
            return
        fut = asyncio.run_coroutine_threadsafe(count_pending(MAX_PENDING_COUNTED), loop)
        try:
            checking, given_up, oldest = fut.result(LOOP_TIMEOUT_S)
        except Exception:
            fut.cancel()
            return
        yield _gauge(
            "apogee_broker_txn_half_pending",
            "Transactions (half messages) nobody decided yet and still checked (counted up to "
            f"{MAX_PENDING_COUNTED}).",
            checking,
        )
        yield _gauge(
            "apogee_broker_txn_half_given_up",
            f"Undecided transactions given up after the most checks (in "
            f"{TRANS_CHECK_MAX_TIME_TOPIC}).",
            given_up,
        )
        if oldest is not None:
            yield _gauge(
                "apogee_broker_txn_half_oldest_age_seconds",
                "Age of the oldest undecided transaction still checked (absent when none).",
                max(0, self.sources.clock.time_ms() - oldest) / 1000,
            )


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)
