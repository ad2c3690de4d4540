"""Prometheus metrics of the SDK's clients, opt-in: on when a client is given a
``prometheus_client`` registry (``metrics_registry=``), off otherwise.

Off, a client holds no metrics object and this module is never imported (nor is
``prometheus_client``, which the SDK does not depend on): the hot paths check for one with
``is None`` and go on. On, every client given the same registry shares one
:class:`ClientMetrics` (created by the first of them, see :func:`client_metrics`), and each
client keeps a small handle on it (:class:`ProducerMetrics`, :class:`ConsumerMetrics`).

Metrics (``group`` is the producer or consumer group; docs/client.md says more):

====================================================  =========  ==========================
``apogee_client_messages_sent_total``                 counter    group, topic
``apogee_client_bytes_sent_total``                    counter    group, topic
``apogee_client_send_errors_total``                   counter    group, kind
``apogee_client_send_latency_seconds``                histogram  group
``apogee_client_sends_in_flight``                     gauge      group
``apogee_client_transactions_total``                  counter    group, outcome
``apogee_client_messages_received_total``             counter    group, topic
``apogee_client_bytes_received_total``                counter    group, topic
``apogee_client_messages_processed_total``            counter    group, topic, result
``apogee_client_process_latency_seconds``             histogram  group
====================================================  =========  ==========================

What it costs: a send that settles makes one call here, which adds to a few integers of its
producer's own (no lock: a client's counts are written on its event loop only), less than one
``Histogram.observe`` of ``prometheus_client`` costs, where its own objects would need five
updates per send (two counters, the histogram, the gauge up and down) and a lock for each. A
batch of ``send_batch`` is one update, an answer of the brokers to a consumer one, a listener
call one. The counts become samples when Prometheus scrapes (:meth:`ClientMetrics.collect`),
which adds up the group's clients as they are then, and those gone (folded into the group's
counts when a client is collected, so that no counter goes down); the in-flight gauge is read
then, through the count each producer hands its handle (``in_flight``), and costs nothing in
between.

This module knows nothing of the clients it measures: a producer's handle reads what it needs
of a send through :class:`SettledSend`, and of the producer through a callback, so that the
producer (which imports this module only when it is given a registry) is not imported here.

Topic labels are capped as the services cap theirs (:class:`~apogee.common.metrics.LabelCap`):
the first ``max_topics`` topics a registry's clients see keep a label of their own, every later
one is counted under ``other``.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from time import perf_counter
from typing import Any, Final, Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from apogee.common.errors import ApogeeError, InvalidArgumentError
from apogee.common.metrics import LabelCap

__all__ = [
    "MAX_TOPICS",
    "PROCESS_BUCKETS",
    "SEND_BUCKETS",
    "ClientMetrics",
    "ConsumerMetrics",
    "ProducerMetrics",
    "SettledSend",
    "client_metrics",
    "error_kind",
]

#: Topics with a label of their own in one registry, unless :func:`client_metrics` says else.
MAX_TOPICS: Final = 1000
#: Seconds buckets of the send latency: 100 us to 10 s (the brokers' own).
SEND_BUCKETS: Final = (
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
#: Seconds buckets of a listener call: 100 us to 5 min.
PROCESS_BUCKETS: Final = (*SEND_BUCKETS, 30.0, 60.0, 300.0)
#: The ``result`` label of ``apogee_client_messages_processed_total``.
OK: Final = "ok"
RETRIED: Final = "retried"
FAILED: Final = "failed"
#: The ``kind`` of a send the caller cancelled, and of a failure that is not an ApogeeError.
CANCELLED: Final = "CANCELLED"
INTERNAL: Final = "INTERNAL"

_registries: weakref.WeakKeyDictionary[CollectorRegistry, ClientMetrics] = (
    weakref.WeakKeyDictionary()
)
_registries_lock = threading.Lock()


class SettledSend(Protocol):
    """What :meth:`ProducerMetrics.settled` reads of a send that ended (a producer's
    :class:`~apogee.client.producer.delivery.Delivery` is one)."""

    @property
    def started(self) -> float:
        """``perf_counter()`` when the send began."""

    @property
    def topic(self) -> str: ...

    @property
    def records(self) -> Sequence[Sized]:
        """The encoded record of each message of the send."""

    @property
    def group(self) -> bool:
        """Whether it is a batch (``send_batch``), whose messages settle one by one."""

    @property
    def results(self) -> Sequence[object]:
        """Of a batch: each message's result, None for those not stored."""


def client_metrics(registry: CollectorRegistry, max_topics: int | None = None) -> ClientMetrics:
    """The client metrics of ``registry``, registered on it the first time they are asked for.

    ``max_topics`` (default :data:`MAX_TOPICS`) caps the topic labels; to choose it, call this
    before the first client is given the registry. Asking again with another cap raises
    :class:`~apogee.common.errors.InvalidArgumentError` (the labels are already handed out)."""
    if not isinstance(registry, CollectorRegistry):
        raise InvalidArgumentError(
            field="metrics_registry",
            rule=f"must be a prometheus_client CollectorRegistry, got {type(registry).__name__}",
        )
    with _registries_lock:
        metrics = _registries.get(registry)
        if metrics is None:
            metrics = ClientMetrics(MAX_TOPICS if max_topics is None else max_topics)
            registry.register(metrics)
            _registries[registry] = metrics
        elif max_topics is not None and max_topics != metrics.topic_cap.limit:
            raise InvalidArgumentError(
                field="max_topics",
                rule=f"the registry's client metrics cap topics at {metrics.topic_cap.limit} "
                f"already; got {max_topics}",
            )
    return metrics


def error_kind(exc: BaseException) -> str:
    """The ``kind`` label of a failed send: the error's kind (``MESSAGE_TOO_LARGE``,
    ``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ...), ``CANCELLED`` when the caller gave up."""
    if isinstance(exc, ApogeeError):
        return exc.kind.name
    if isinstance(exc, asyncio.CancelledError):
        return CANCELLED
    return INTERNAL


class _Histogram:
    """Bucket counts (not cumulative; the last is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def add_to(self, total: _Histogram) -> None:
        for i, n in enumerate(list(self.counts)):
            total.counts[i] += n
        total.sum += self.sum

    def samples(self) -> tuple[list[tuple[str, float]], float]:
        """(cumulative buckets as the text format has them, sum)."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip(self.bounds, self.counts[:-1], strict=True):
            total += n
            out.append((repr(float(bound)), total))
        out.append(("+Inf", total + self.counts[-1]))
        return out, self.sum


def _add_pairs(total: dict[str, list[int]], part: dict[str, list[int]]) -> None:
    for key, (a, b) in list(part.items()):  # list(): one step, however the writer goes on
        cell = total.setdefault(key, [0, 0])
        cell[0] += a
        cell[1] += b


def _add_counts(total: dict[Any, int], part: dict[Any, int]) -> None:
    for key, n in list(part.items()):
        total[key] = total.get(key, 0) + n


class _ProducerCells:
    """One producer's counts, written only on its event loop: no lock. A scrape reads them
    from another thread as they are (each copy of a dict or list is one step for the
    interpreter), at worst one send behind."""

    __slots__ = ("errors", "latency", "sent", "transactions")

    def __init__(self) -> None:
        #: topic label -> [messages, bytes] stored
        self.sent: dict[str, list[int]] = {}
        self.errors: dict[str, int] = {}
        self.latency = _Histogram(SEND_BUCKETS)
        self.transactions: dict[str, int] = {}

    def add_to(self, total: _ProducerCells) -> None:
        _add_pairs(total.sent, self.sent)
        _add_counts(total.errors, self.errors)
        self.latency.add_to(total.latency)
        _add_counts(total.transactions, self.transactions)


class _ConsumerCells:
    """One consumer's counts, written only on its event loop (see :class:`_ProducerCells`)."""

    __slots__ = ("latency", "processed", "received")

    def __init__(self) -> None:
        #: topic label -> [messages, bytes] received
        self.received: dict[str, list[int]] = {}
        #: (topic label, result) -> messages
        self.processed: dict[tuple[str, str], int] = {}
        self.latency = _Histogram(PROCESS_BUCKETS)

    def add_to(self, total: _ConsumerCells) -> None:
        _add_pairs(total.received, self.received)
        _add_counts(total.processed, self.processed)
        self.latency.add_to(total.latency)


C = TypeVar("C", _ProducerCells, _ConsumerCells)


class _Group(Generic[C]):
    """The clients of one group: the cells of those alive, and what those gone had counted
    (folded in when their handle is collected, so that the counters never go down)."""

    def __init__(self, new: Callable[[], C]) -> None:
        #: reentrant: a client collected while this thread holds it leaves within
        self.lock = threading.RLock()
        self._new: Callable[[], C] = new
        self._live: list[C] = []
        self._gone: C = new()
        #: the handles of the group's producers alive (each reads its producer's in-flight count)
        self.producers: weakref.WeakSet[ProducerMetrics] = weakref.WeakSet()

    def join(self, handle: object) -> C:
        """Cells for a new client, folded into the group's when ``handle`` is collected."""
        cells = self._new()
        with self.lock:
            self._live.append(cells)
        weakref.finalize(handle, self._leave, cells)
        return cells

    def _leave(self, cells: C) -> None:
        with self.lock:
            self._live.remove(cells)
            cells.add_to(self._gone)

    def total(self) -> C:
        total = self._new()
        with self.lock:
            self._gone.add_to(total)
            for cells in list(self._live):
                cells.add_to(total)
        return total

    def in_flight(self) -> int:
        """Sends unsettled in the group's producers alive."""
        with self.lock:
            live = list(self.producers)
        return sum(p.in_flight() for p in live)


class ClientMetrics(Collector):
    """The metrics of every client given one registry: a collector registered on it, whose
    samples are made when the registry is scraped."""

    def __init__(self, max_topics: int = MAX_TOPICS) -> None:
        self.topic_cap = LabelCap(max_topics)
        self._lock = threading.Lock()
        self._producers: dict[str, _Group[_ProducerCells]] = {}
        self._consumers: dict[str, _Group[_ConsumerCells]] = {}

    def producer_group(self, group: str) -> _Group[_ProducerCells]:
        with self._lock:
            g = self._producers.get(group)
            if g is None:
                g = self._producers[group] = _Group(_ProducerCells)
            return g

    def consumer_group(self, group: str) -> _Group[_ConsumerCells]:
        with self._lock:
            g = self._consumers.get(group)
            if g is None:
                g = self._consumers[group] = _Group(_ConsumerCells)
            return g

    # -- the collector -------------------------------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        """The families without samples (the registry checks their names once)."""
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            producers = list(self._producers.items())
            consumers = list(self._consumers.items())
        return list(self._families(producers, consumers))

    def _families(
        self,
        producers: Sequence[tuple[str, _Group[_ProducerCells]]] = (),
        consumers: Sequence[tuple[str, _Group[_ConsumerCells]]] = (),
    ) -> Iterator[Metric]:
        g, gt = ["group"], ["group", "topic"]
        sent = CounterMetricFamily(
            "apogee_client_messages_sent",
            "Messages the brokers stored, by producer group and topic.",
            labels=gt,
        )
        sent_bytes = CounterMetricFamily(
            "apogee_client_bytes_sent",
            "Bytes of the records of the messages stored, by producer group and topic.",
            labels=gt,
        )
        errors = CounterMetricFamily(
            "apogee_client_send_errors",
            "Messages whose send failed (retries used up, refused, timed out, cancelled), by "
            "producer group and error kind.",
            labels=["group", "kind"],
        )
        send_latency = HistogramMetricFamily(
            "apogee_client_send_latency_seconds",
            "Time from a send (one message, or one send_batch) to its outcome, retries "
            "included, by producer group.",
            labels=g,
        )
        in_flight = GaugeMetricFamily(
            "apogee_client_sends_in_flight",
            "Sends (and transactions) started and not settled yet, by producer group.",
            labels=g,
        )
        transactions = CounterMetricFamily(
            "apogee_client_transactions",
            "Transactions sent whose half was stored, by producer group and end outcome.",
            labels=["group", "outcome"],
        )
        for group, pg in producers:
            p = pg.total()
            for topic, (messages, nbytes) in p.sent.items():
                sent.add_metric([group, topic], messages)
                sent_bytes.add_metric([group, topic], nbytes)
            for kind, n in p.errors.items():
                errors.add_metric([group, kind], n)
            for outcome, n in p.transactions.items():
                transactions.add_metric([group, outcome], n)
            send_latency.add_metric([group], *p.latency.samples())
            in_flight.add_metric([group], pg.in_flight())
        yield from (sent, sent_bytes, errors, send_latency, in_flight, transactions)

        received = CounterMetricFamily(
            "apogee_client_messages_received",
            "Messages the brokers delivered, by consumer group and the topic of their queue.",
            labels=gt,
        )
        received_bytes = CounterMetricFamily(
            "apogee_client_bytes_received",
            "Bytes of the records delivered, by consumer group and topic.",
            labels=gt,
        )
        processed = CounterMetricFamily(
            "apogee_client_messages_processed",
            "Messages handed to a push consumer's listener, by consumer group, topic and "
            "result: ok (the call succeeded), retried (it failed; the message comes again), "
            "failed (it failed; the message was dead-lettered or dropped).",
            labels=["group", "topic", "result"],
        )
        process_latency = HistogramMetricFamily(
            "apogee_client_process_latency_seconds",
            "Time of one listener call of a push consumer, by consumer group.",
            labels=g,
        )
        for group, cg in consumers:
            c = cg.total()
            for topic, (messages, nbytes) in c.received.items():
                received.add_metric([group, topic], messages)
                received_bytes.add_metric([group, topic], nbytes)
            for (topic, result), n in c.processed.items():
                processed.add_metric([group, topic, result], n)
            process_latency.add_metric([group], *c.latency.samples())
        yield from (received, received_bytes, processed, process_latency)


class _Labelled:
    """A client's topic labels, each capped once: a topic seen before costs a dict lookup
    (``self._known.get(topic) or self._label(topic)`` on the hot paths)."""

    __slots__ = ("__weakref__", "_cap", "_known", "_most")

    def __init__(self, cap: LabelCap) -> None:
        self._cap = cap
        self._known: dict[str, str] = {}
        #: topics remembered at most (as the broker's metrics do: those past it are capped
        #: again each time)
        self._most = 4 * max(cap.limit, 1) + 1024

    def _label(self, topic: str) -> str:
        label = self._known.get(topic)
        if label is None:
            label = self._cap(topic)
            if len(self._known) < self._most:
                self._known[topic] = label
        return label


class ProducerMetrics(_Labelled):
    """One producer's handle on its registry's metrics (see the module docstring). Used on
    the producer's event loop only."""

    __slots__ = ("_cells", "_sent", "in_flight")

    def __init__(
        self, registry: CollectorRegistry, group: str, in_flight: Callable[[], int]
    ) -> None:
        """``in_flight`` answers the producer's sends (and transactions) started and not
        settled yet; it is called when the registry is scraped, from the scraping thread,
        for as long as this handle lives (the producer holds it: the handle goes with it)."""
        metrics = client_metrics(registry)
        super().__init__(metrics.topic_cap)
        g = metrics.producer_group(group)
        self._cells = g.join(self)
        #: topic -> its [messages, bytes] cell of ``_cells.sent`` (under its label)
        self._sent: dict[str, list[int]] = {}
        self.in_flight = in_flight
        with g.lock:
            g.producers.add(self)

    def settled(self, d: SettledSend, outcome: object) -> None:
        """Send ``d`` ended with ``outcome`` (a result, a batch's results, None, or the
        exception): one update for all its messages."""
        seconds = perf_counter() - d.started
        if isinstance(outcome, BaseException):
            self._failed_send(d, outcome, seconds)
            return
        cell = self._sent.get(d.topic) or self._sent_cell(d.topic)
        records = d.records
        count = len(records)
        cell[0] += count
        cell[1] += len(records[0]) if count == 1 else sum(map(len, records))
        latency = self._cells.latency
        latency.counts[bisect_left(SEND_BUCKETS, seconds)] += 1
        latency.sum += seconds

    def _sent_cell(self, topic: str) -> list[int]:
        cell = self._cells.sent.setdefault(self._label(topic), [0, 0])
        if len(self._sent) < self._most:
            self._sent[topic] = cell
        return cell

    def _failed_send(self, d: SettledSend, exc: BaseException, seconds: float) -> None:
        """:meth:`settled` of a failed send: a batch's messages stored before it failed count
        as sent, the others as errors of ``exc``'s kind."""
        cells = self._cells
        records = d.records
        stored = [k for k, r in enumerate(d.results) if r is not None] if d.group else []
        if stored:
            cell = self._sent_cell(d.topic)
            cell[0] += len(stored)
            cell[1] += sum(len(records[k]) for k in stored)
        self.failed(exc, len(records) - len(stored))
        latency = cells.latency
        latency.counts[bisect_left(SEND_BUCKETS, seconds)] += 1
        latency.sum += seconds

    def failed(self, exc: BaseException, count: int = 1) -> None:
        """``count`` messages failed (of a send, or a transaction's half)."""
        errors = self._cells.errors
        kind = error_kind(exc)
        errors[kind] = errors.get(kind, 0) + count

    def transaction(self, outcome: str) -> None:
        """A transaction whose half was stored came to ``outcome`` (an ``EndOutcome`` value)."""
        counts = self._cells.transactions
        counts[outcome] = counts.get(outcome, 0) + 1


class ConsumerMetrics(_Labelled):
    """One consumer's handle on its registry's metrics (see the module docstring), used on
    the consumer's event loop only. Messages are counted under the topic of the queue they
    were read from: a retried message under the group's retry topic ``%RETRY%<group>``, as the
    brokers count it."""

    __slots__ = ("_cells",)

    def __init__(self, registry: CollectorRegistry, group: str) -> None:
        metrics = client_metrics(registry)
        super().__init__(metrics.topic_cap)
        self._cells = metrics.consumer_group(group).join(self)

    def received(self, topic: str, count: int, nbytes: int) -> None:
        """``count`` messages of ``topic`` (``nbytes`` of records) arrived in one answer."""
        label = self._known.get(topic) or self._label(topic)
        received = self._cells.received
        cell = received.get(label)
        if cell is None:
            cell = received[label] = [0, 0]
        cell[0] += count
        cell[1] += nbytes

    def called(self, topic: str, count: int, seconds: float, ok: bool) -> None:
        """A listener call on ``count`` messages took ``seconds``; ``ok``: it succeeded (a
        failed call's messages are counted by :meth:`fate` once their fate is known)."""
        cells = self._cells
        if ok:
            key = (self._known.get(topic) or self._label(topic), OK)
            cells.processed[key] = cells.processed.get(key, 0) + count
        latency = cells.latency
        latency.counts[bisect_left(PROCESS_BUCKETS, seconds)] += 1
        latency.sum += seconds

    def fate(self, topic: str, retried: int, failed: int) -> None:
        """Of messages of ``topic`` whose listener call failed, ``retried`` come again (through
        the retry topic, or a local retry) and ``failed`` do not (dead-lettered, dropped)."""
        label = self._known.get(topic) or self._label(topic)
        processed = self._cells.processed
        for result, count in ((RETRIED, retried), (FAILED, failed)):
            if count > 0:
                processed[label, result] = processed.get((label, result), 0) + count
