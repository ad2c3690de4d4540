"""``apogee top``: a live view of a cluster's traffic, consumer lag and latencies, read from the
services' ``/metrics`` endpoints directly (no Prometheus needed).

The endpoints are the local cluster's (``cluster.json``, every member that serves metrics) or
those given with ``--metrics host:port`` (repeatable). Every ``--interval`` seconds all of them
are scraped at once and a frame is printed, computed from the last two scrapes; ``--once``
prints one frame (two scrapes ``--interval`` apart) and exits. On a terminal each frame clears
the screen first (an ANSI escape); otherwise frames follow one another, a blank line apart.

A frame shows:

- TOPICS: messages and KiB stored (``in``) and answered to consumers (``out``) per second, over
  the brokers (``apogee_broker_{messages,bytes}_{in,out}_total``).
- GROUPS: per group and topic, the lag in messages summed over the brokers, in seconds (the
  oldest over the brokers), how fast the lag grows (negative: the group catches up), the
  group's consumers (the most any broker sees), and retries and dead letters per second. Lag
  that cannot be computed is ``unknown``, never 0.
- BROKERS: send requests per second and their latency (p50, p99) over the interval, the
  store's append and flush p99, refused messages per second, disk use. The brokers keep these
  latencies per broker, not per topic.
- SCHEDULE / TXN-CHECKER, when they run: deliveries per second and their lateness (p99);
  transaction checks per second.

Counters use Prometheus's rules: a counter that went down was reset (its process restarted) and
counts from 0; a series that appeared between the scrapes counts from 0; an endpoint that did
not answer both scrapes adds nothing to the rates (one that does not answer now is named under
the frame). Quantiles are interpolated within histogram buckets as ``histogram_quantile`` does.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, TextIO

from apogee.cli.common import UsageError, data_dir
from apogee.cli.local_state import ClusterState
from apogee.common.errors import UnavailableError
from apogee.common.metrics import Samples, scrape

#: Clears a terminal and puts the cursor home.
CLEAR: Final = "\x1b[H\x1b[2J"
#: What a lag that cannot be computed shows.
UNKNOWN: Final = "unknown"
#: What a value with nothing to compute it from shows (no observation in the interval).
NONE: Final = "-"

_IN_MSGS = "apogee_broker_messages_in_total"
_OUT_MSGS = "apogee_broker_messages_out_total"
_IN_BYTES = "apogee_broker_bytes_in_total"
_OUT_BYTES = "apogee_broker_bytes_out_total"
_LAG_MSGS = "apogee_broker_group_lag_messages"
_LAG_SECS = "apogee_broker_group_lag_seconds"
_MEMBERS = "apogee_broker_group_members"
_RETRIES = "apogee_broker_retry_messages_total"
_DLQ = "apogee_broker_dlq_messages_total"
_SEND = "apogee_broker_send_latency_seconds"
_APPEND = "apogee_broker_store_append_latency_seconds"
_FLUSH = "apogee_broker_store_flush_latency_seconds"
_SEND_ERRORS = "apogee_broker_send_errors_total"
_DISK_USED = "apogee_broker_disk_used_ratio"
_DELIVERED = "apogee_schedule_delivered_messages_total"
_LATENESS = "apogee_schedule_delivery_lateness_seconds"
_CHECKS = "apogee_txn_checker_checks_total"


@dataclass(frozen=True)
class Endpoint:
    """A ``/metrics`` endpoint: what the frame calls it (a member's name, or the address) and
    its ``host:port``."""

    label: str
    address: str


@dataclass(frozen=True)
class Scrape:
    """All endpoints scraped once: when (``time.monotonic()``), what each answered, and why
    the others did not."""

    at: float
    samples: Mapping[str, Samples]
    errors: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TopicRow:
    topic: str
    in_msgs: float
    out_msgs: float
    in_bytes: float
    out_bytes: float


@dataclass(frozen=True)
class GroupRow:
    group: str
    topic: str
    #: summed over the brokers that report it; None: no broker can compute it
    lag_messages: float | None
    #: the oldest over the brokers; None: unknown
    lag_seconds: float | None
    #: change of lag_messages per second over the interval; None: not known at both scrapes
    lag_change: float | None
    members: float | None
    retries: float
    dead_letters: float


@dataclass(frozen=True)
class BrokerRow:
    label: str
    sends: float
    send_p50: float | None
    send_p99: float | None
    append_p99: float | None
    flush_p99: float | None
    errors: float
    disk_used: float | None


@dataclass(frozen=True)
class ServiceRow:
    label: str
    text: str


@dataclass(frozen=True)
class Frame:
    """What one screen shows; :func:`compute` makes it, :func:`render` prints it."""

    seconds: float
    endpoints: int
    answered: int
    topics: list[TopicRow]
    groups: list[GroupRow]
    brokers: list[BrokerRow]
    services: list[ServiceRow]
    #: (endpoint label, why it did not answer)
    unreachable: list[tuple[str, str]]


# -- computing ----------------------------------------------------------------------------------


def increase(prev: float | None, cur: float) -> float:
    """How much a counter grew from ``prev`` to ``cur``: a drop is a reset (the process
    restarted), counted from 0; a series without ``prev`` appeared in between, from 0."""
    if prev is None or cur < prev:
        return cur
    return cur - prev


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``q`` quantile (0..1) of a histogram given as (upper bound, cumulative count)
    pairs, interpolated linearly within its bucket as Prometheus does (the first bucket starts
    at 0; a rank in the ``+Inf`` bucket gives the highest finite bound). None when empty."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    low, below = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank and count > below:  # (count == below only when rank is 0)
            if math.isinf(bound):
                return low
            return low + (bound - low) * (rank - below) / (count - below)
        low, below = (bound if not math.isinf(bound) else low), count
    return low


def _series(samples: Samples, name: str) -> Iterable[tuple[dict[str, str], float]]:
    for (n, labels), value in samples.items():
        if n == name:
            yield dict(labels), value


def _both(prev: Scrape, cur: Scrape) -> list[str]:
    """The endpoints that answered both scrapes (rates come from these only)."""
    return [label for label in cur.samples if label in prev.samples]


def _increases(
    prev: Scrape, cur: Scrape, name: str, key: Callable[[dict[str, str]], str]
) -> dict[str, float]:
    """Increase of counter ``name`` over the interval, summed over endpoints, by ``key``."""
    out: dict[str, float] = {}
    for label in _both(prev, cur):
        before = prev.samples[label]
        for labels, value in _series(cur.samples[label], name):
            was = before.get((name, frozenset(labels.items())))
            k = key(labels)
            out[k] = out.get(k, 0.0) + increase(was, value)
    return out


def _bucket_increases(prev: Samples | None, cur: Samples, name: str) -> list[tuple[float, float]]:
    """(upper bound, increase of its cumulative count) of histogram ``name`` (no labels but
    ``le``) over the interval."""
    out = []
    for labels, value in _series(cur, f"{name}_bucket"):
        was = prev.get((f"{name}_bucket", frozenset(labels.items()))) if prev else None
        out.append((float(labels["le"]), increase(was, value)))
    return out


_LabelKey = tuple[tuple[str, str], ...]


def _gauges(samples: Mapping[str, Samples], name: str) -> dict[_LabelKey, list[float]]:
    """The values of gauge ``name`` at each endpoint, by labels."""
    out: dict[_LabelKey, list[float]] = {}
    for s in samples.values():
        for labels, value in _series(s, name):
            out.setdefault(tuple(sorted(labels.items(), key=lambda kv: kv[0])), []).append(value)
    return out


def _topic_of(labels: dict[str, str]) -> str:
    return labels.get("topic", "")


def _group_of(labels: dict[str, str]) -> str:
    return labels.get("group", "")


def _per_second(value: float, seconds: float) -> float:
    return value / seconds if seconds > 0 else 0.0


def compute(prev: Scrape, cur: Scrape) -> Frame:
    """The frame of the interval from ``prev`` to ``cur``."""
    dt = cur.at - prev.at
    traffic = {
        name: _increases(prev, cur, name, _topic_of)
        for name in (_IN_MSGS, _OUT_MSGS, _IN_BYTES, _OUT_BYTES)
    }
    topic_names = sorted({t for counts in traffic.values() for t in counts})
    topics = [
        TopicRow(
            t,
            *(_per_second(traffic[n].get(t, 0.0), dt) for n in (_IN_MSGS, _OUT_MSGS)),
            *(_per_second(traffic[n].get(t, 0.0), dt) for n in (_IN_BYTES, _OUT_BYTES)),
        )
        for t in topic_names
    ]
    return Frame(
        seconds=dt,
        endpoints=len(cur.samples) + len(cur.errors),
        answered=len(cur.samples),
        topics=topics,
        groups=_groups(prev, cur, dt),
        brokers=_brokers(prev, cur, dt),
        services=_services(prev, cur, dt),
        unreachable=sorted(cur.errors.items()),
    )


def _groups(prev: Scrape, cur: Scrape, dt: float) -> list[GroupRow]:
    lag_now = _gauges(cur.samples, _LAG_MSGS)
    secs_now = _gauges(cur.samples, _LAG_SECS)
    # the lag's change over the endpoints that answered both scrapes
    both = _both(prev, cur)
    lag_then = _gauges({k: prev.samples[k] for k in both}, _LAG_MSGS)
    lag_now_both = _gauges({k: cur.samples[k] for k in both}, _LAG_MSGS)
    members = {dict(k).get("group", ""): max(v) for k, v in _gauges(cur.samples, _MEMBERS).items()}
    retries = _increases(prev, cur, _RETRIES, _group_of)
    dead = _increases(prev, cur, _DLQ, _group_of)
    rows = []
    for key in sorted(set(lag_now) | set(secs_now)):
        labels = dict(key)
        group, topic = labels.get("group", ""), labels.get("topic", "")
        change = None
        if key in lag_then and key in lag_now_both and dt > 0:
            change = (sum(lag_now_both[key]) - sum(lag_then[key])) / dt
        rows.append(
            GroupRow(
                group,
                topic,
                sum(lag_now[key]) if key in lag_now else None,
                max(secs_now[key]) if key in secs_now else None,
                change,
                members.get(group),
                _per_second(retries.get(group, 0.0), dt),
                _per_second(dead.get(group, 0.0), dt),
            )
        )
    # groups that are known (members online) but report no lag on any topic
    for group in sorted(set(members) - {r.group for r in rows}):
        rows.append(GroupRow(group, NONE, None, None, None, members[group], 0.0, 0.0))
    rows.sort(key=lambda r: (r.group, r.topic))
    return rows


def _brokers(prev: Scrape, cur: Scrape, dt: float) -> list[BrokerRow]:
    rows = []
    for label, samples in cur.samples.items():
        if (f"{_SEND}_count", frozenset()) not in samples:
            continue  # not a broker
        before = prev.samples.get(label)
        if before is None:  # no interval to compute over
            rows.append(BrokerRow(label, 0.0, None, None, None, None, 0.0, None))
            continue
        send = _bucket_increases(before, samples, _SEND)
        errors = sum(
            increase(before.get((_SEND_ERRORS, frozenset(labels.items()))), value)
            for labels, value in _series(samples, _SEND_ERRORS)
        )
        rows.append(
            BrokerRow(
                label,
                _per_second(max((c for b, c in send if math.isinf(b)), default=0.0), dt),
                histogram_quantile(0.5, send),
                histogram_quantile(0.99, send),
                histogram_quantile(0.99, _bucket_increases(before, samples, _APPEND)),
                histogram_quantile(0.99, _bucket_increases(before, samples, _FLUSH)),
                _per_second(errors, dt),
                samples.get((_DISK_USED, frozenset())),
            )
        )
    return sorted(rows, key=lambda r: r.label)


def _services(prev: Scrape, cur: Scrape, dt: float) -> list[ServiceRow]:
    rows = []
    for label in sorted(_both(prev, cur)):
        before, samples = prev.samples[label], cur.samples[label]
        delivered = samples.get((_DELIVERED, frozenset()))
        if delivered is not None:
            done = increase(before.get((_DELIVERED, frozenset())), delivered)
            late = histogram_quantile(0.99, _bucket_increases(before, samples, _LATENESS))
            rows.append(
                ServiceRow(
                    label,
                    f"delivered {_rate(_per_second(done, dt))}/s, lateness p99 {_seconds(late)}",
                )
            )
        checks = list(_series(samples, _CHECKS))
        if checks:
            done = sum(
                increase(before.get((_CHECKS, frozenset(labels.items()))), value)
                for labels, value in checks
            )
            rows.append(ServiceRow(label, f"checks {_rate(_per_second(done, dt))}/s"))
    return rows


# -- printing -----------------------------------------------------------------------------------


def _rate(value: float) -> str:
    return f"{value:.1f}"


def _seconds(value: float | None) -> str:
    if value is None or math.isnan(value):
        return NONE
    if value < 0.001:
        return f"{value * 1e6:.0f}us"
    if value < 1:
        return f"{value * 1e3:.1f}ms"
    return f"{value:.2f}s"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int) -> list[str]:
    """Columns as wide as their widest cell; the first ``left`` columns left-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def render(frame: Frame, now: datetime | None = None) -> str:
    """The frame as text (no terminal escapes), ending with a newline."""
    when = (now or datetime.now(UTC)).isoformat(timespec="seconds")
    lines = [
        f"apogee top  {when}  rates over {frame.seconds:.1f} s, "
        f"{frame.answered} of {frame.endpoints} endpoints answered",
        "",
    ]
    if frame.topics:
        lines += _table(
            ["TOPIC", "IN MSG/S", "OUT MSG/S", "IN KIB/S", "OUT KIB/S"],
            [
                [
                    t.topic,
                    _rate(t.in_msgs),
                    _rate(t.out_msgs),
                    _rate(t.in_bytes / 1024),
                    _rate(t.out_bytes / 1024),
                ]
                for t in frame.topics
            ],
            left=1,
        )
    else:
        lines.append("no topic has traffic counted yet")
    lines.append("")
    if frame.groups:
        lines += _table(
            ["GROUP", "TOPIC", "LAG MSGS", "LAG S", "LAG CHG/S", "MEMBERS", "RETRY/S", "DLQ/S"],
            [
                [
                    g.group,
                    g.topic,
                    UNKNOWN if g.lag_messages is None else f"{g.lag_messages:.0f}",
                    UNKNOWN if g.lag_seconds is None else f"{g.lag_seconds:.1f}",
                    NONE if g.lag_change is None else f"{g.lag_change:+.1f}",
                    NONE if g.members is None else f"{g.members:.0f}",
                    _rate(g.retries),
                    _rate(g.dead_letters),
                ]
                for g in frame.groups
            ],
            left=2,
        )
    else:
        lines.append("no consumer group is known to the brokers")
    if frame.brokers:
        lines.append("")
        lines += _table(
            [
                "BROKER",
                "SENDS/S",
                "SEND P50",
                "SEND P99",
                "APPEND P99",
                "FLUSH P99",
                "ERR/S",
                "DISK",
            ],
            [
                [
                    b.label,
                    _rate(b.sends),
                    _seconds(b.send_p50),
                    _seconds(b.send_p99),
                    _seconds(b.append_p99),
                    _seconds(b.flush_p99),
                    _rate(b.errors),
                    NONE if b.disk_used is None else f"{b.disk_used:.0%}",
                ]
                for b in frame.brokers
            ],
            left=1,
        )
    if frame.services:
        lines.append("")
        width = max(len(s.label) for s in frame.services)
        lines += [f"{s.label.ljust(width)}  {s.text}" for s in frame.services]
    if frame.unreachable:
        lines.append("")
        lines += [f"not answering: {label}: {why}" for label, why in frame.unreachable]
    return "\n".join(lines) + "\n"


# -- scraping and the command -------------------------------------------------------------------


def scrape_all(
    endpoints: Sequence[Endpoint],
    timeout: float,
    pool: concurrent.futures.Executor,
    clock: Callable[[], float] = time.monotonic,
) -> Scrape:
    """Every endpoint scraped at once (on ``pool``); the time is taken when they were asked."""
    at = clock()
    futures = {e.label: pool.submit(scrape, e.address, timeout) for e in endpoints}
    samples: dict[str, Samples] = {}
    errors: dict[str, str] = {}
    for e in endpoints:
        try:
            samples[e.label] = futures[e.label].result()
        except Exception as exc:  # refused, timed out, not the text format
            reason = getattr(exc, "reason", exc)
            errors[e.label] = f"{e.address} ({reason})"
    return Scrape(at, samples, errors)


def endpoints_of(args: argparse.Namespace) -> list[Endpoint]:
    """``--metrics`` addresses, else the local cluster's members that serve metrics."""
    if args.metrics:
        out = []
        for address in args.metrics:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UsageError(f"--metrics {address!r}: use host:port")
            out.append(Endpoint(address, address))
        return out
    state = ClusterState.load(data_dir(args).resolve())
    members = [Endpoint(p.name, p.metrics) for p in state.all() if p.metrics] if state else []
    if not members:
        raise UsageError(
            "no metrics endpoint: pass --metrics host:port (repeatable), or start a local "
            "cluster with `apogee cluster up`"
        )
    return members


def add_command(sub: Any) -> None:
    top = sub.add_parser(
        "top",
        help="live rates, lag and latency per topic and group, from the /metrics endpoints",
        description="Scrapes the services' /metrics endpoints (the local cluster's, or "
        "--metrics) every --interval seconds and shows messages per second per topic, lag per "
        "consumer group and topic, and the brokers' latencies, computed from the last two "
        "scrapes. Ctrl-C stops it.",
    )
    top.add_argument(
        "--metrics",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an endpoint to read (repeatable; default: every member of the local cluster)",
    )
    top.add_argument(
        "--interval", type=float, default=2.0, help="seconds between frames (default 2)"
    )
    top.add_argument(
        "--once", action="store_true", help="print one frame (two scrapes --interval apart)"
    )
    top.set_defaults(run=cmd_top)


def cmd_top(args: argparse.Namespace, out: TextIO) -> int:
    interval: float = args.interval
    if not math.isfinite(interval) or interval <= 0:
        raise UsageError(f"--interval {interval}: must be a number of seconds above 0")
    endpoints = endpoints_of(args)
    try:
        run(endpoints, interval, args.once, out)
    except KeyboardInterrupt:  # how a live view is left
        return 0
    return 0


def run(
    endpoints: Sequence[Endpoint],
    interval: float,
    once: bool,
    out: TextIO,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Print a frame every ``interval`` seconds (one with ``once``); ``sleep`` and ``clock``
    set the pace."""
    clear = CLEAR if out.isatty() else ""
    timeout = max(1.0, min(5.0, interval))
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(endpoints)) as pool:
        prev = scrape_all(endpoints, timeout, pool, clock)
        next_at = prev.at + interval
        first = True
        while True:
            sleep(max(0.0, next_at - clock()))  # the refresh pace, not a wait for an event
            cur = scrape_all(endpoints, timeout, pool, clock)
            next_at = max(next_at + interval, cur.at)
            if once and not cur.samples:
                raise UnavailableError(
                    what="every metrics endpoint", detail="; ".join(cur.errors.values())
                )
            frame = compute(prev, cur)
            out.write(clear + ("" if first or clear else "\n") + render(frame))
            out.flush()
            if once:
                return
            prev, first = cur, False
