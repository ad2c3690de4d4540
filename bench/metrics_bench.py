"""Benchmark of what Prometheus metrics cost on the send path: async send throughput (1 KiB
bodies, ``send_nowait`` with at most ``--window`` sends unsettled, 64 by default), a producer in
this process, a nameserver and a broker as separate processes (``apogee.local.cluster``,
async flush), a fresh cluster for each run. The cases alternate, in a rotated order, for
``--rounds`` rounds, so that a noisy machine weighs on all of them alike.

What "off" can mean: the SDK's metrics are off unless a client is given a registry. The
services always count: ``APOGEE_BROKER_METRICS_LISTEN=`` (empty) only leaves out the HTTP
endpoint, an idle thread, and the broker counts exactly as before (``apogee_broker.app``
creates and feeds its ``BrokerMetrics`` either way), so that case would measure nothing. What
the broker's counting costs is measured instead by stubbing it out (a case no setting gives),
and what a scrape costs by scraping.

Cases:

- ``default``: as shipped: the broker counts (its endpoint on, not scraped); the producer has
  no metrics. Every other case is compared with it.
- ``client_on``: the producer counts too (``metrics_registry=`` a registry of its own): one
  update per send as it settles.
- ``broker_uncounted``: the broker's counting replaced by no-ops (its ``BrokerMetrics``
  updates and histograms, through a ``sitecustomize`` this script puts on the broker's
  ``PYTHONPATH``): what an off switch for the services' counting could save at most.
- ``scraped``: ``default`` with the broker's ``/metrics`` read every ``--scrape-every``
  seconds (1 by default; Prometheus is usually set to 15-60 s) by a thread of this process
  that reads the answer without parsing it.

- ``client_path_off`` / ``client_path_on``: after the rounds, the producer alone, metrics off
  and on alternated ``2 x --rounds`` times in this process, each request answered at once
  here (no broker, no gRPC: what the client metrics add to the producer's own CPU per send,
  with less of the machine's noise); a summary line ``client_path`` gives the medians and
  their difference.

Prints one JSON object per run (see ``figures.emit``) with ``round``, ``client_cpu_s`` and
``broker_cpu_s`` (CPU each process used during the run), ``client_us_per_msg`` and
``broker_us_per_msg`` (that CPU per message), ``vs_default`` (the throughput as a fraction of
the same round's ``default`` run; a round's lines are printed when it is over), and what was
counted (``client_sent_counted``: the producer's ``apogee_client_messages_sent_total``;
``broker_stored_counted``: the broker's ``apogee_broker_messages_in_total``, warm-up included;
``scrapes``). Then one line per case
with ``"summary": true``: the medians over the rounds of the throughput, of ``vs_default`` and
of the CPU per message, and their ratios to ``default``'s.

    python bench/metrics_bench.py            # 5 rounds, about five minutes
    python bench/metrics_bench.py --quick    # 2 rounds, about a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import struct
import tempfile
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from figures import ProcessMeter, emit, loop_name, run_async
from load import create_topics, windowed_sends
from prometheus_client import CollectorRegistry

from apogee.client import Message, Producer
from apogee.client.producer import wire
from apogee.common.metrics import scrape
from apogee.local import cluster as local_cluster
from apogee.v1 import broker_pb2

TOPIC = "BenchMetrics"
BODY = 1024
SAMPLE = 16  # the latency of one send in SAMPLE is measured
WARM = 500  # sends before each run, not timed
CASES = ("default", "client_on", "broker_uncounted", "scraped")

#: The broker's counting as no-ops: imported by the broker's interpreter at its start.
UNCOUNTED = '''"""metrics_bench: the broker's counting replaced by no-ops (this broker only)."""
from apogee_broker import metrics as _metrics


class _Nothing:
    def observe(self, *args, **kwargs):
        pass

    def inc(self, *args, **kwargs):
        pass

    def labels(self, *args, **kwargs):
        return self


def _nothing(*args, **kwargs):
    pass


_init = _metrics.BrokerMetrics.__init__


def _init_uncounted(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    for name in ("send_latency", "append_latency", "flush_latency", "long_poll_hold"):
        setattr(self, name, _Nothing())


_metrics.BrokerMetrics.__init__ = _init_uncounted
for _name in ("stored", "sent_out", "pulled", "send_failed", "sent_back"):
    setattr(_metrics.BrokerMetrics, _name, _nothing)
'''


@dataclass
class Outcome:
    """What one run measured."""

    seconds: float
    latencies: list[float]
    errors: int
    client_cpu_s: float
    client_sent_counted: float | None


async def timed_sends(producer: Producer, msg: Message, count: int, window: int) -> Outcome:
    """``count`` sends of ``msg`` (:func:`load.windowed_sends`), one in :data:`SAMPLE` timed."""
    sent = await windowed_sends(producer, msg, count, window, SAMPLE)
    return Outcome(sent.seconds, sent.latencies, sent.errors, sent.cpu_s, None)


def sent_counted(registry: CollectorRegistry | None, group: str) -> float | None:
    if registry is None:
        return None
    labels = {"group": group, "topic": TOPIC}
    return registry.get_sample_value("apogee_client_messages_sent_total", labels)


async def send_all(
    namesrv: str, count: int, window: int, registry: CollectorRegistry | None
) -> Outcome:
    """A producer's ``count`` timed sends (after :data:`WARM` untimed ones)."""
    msg = Message(TOPIC, os.urandom(BODY), tags="TagA")
    async with Producer(namesrv, metrics_registry=registry) as producer:
        assert (producer._metrics is None) == (registry is None)
        await asyncio.gather(*(producer.send(msg) for _ in range(WARM)))
        out = await timed_sends(producer, msg, count, window)
    out.client_sent_counted = sent_counted(registry, producer.config.group)
    return out


async def answered_at_once(broker: str, records: list[bytearray]) -> wire.Answer:
    """A broker's answer to a request, made up here: every record stored."""
    n = len(records)
    offsets = struct.pack(f"<{n}q", *range(n))
    return wire.Answer(broker_pb2.SendMessagesResponse(queue_offsets=offsets), broker)


async def client_path(namesrv: str, args: argparse.Namespace) -> None:
    """The producer's own CPU per send, metrics off and on, alternated ``--rounds`` times x 2
    in this process, each request answered at once in this process (the route from the
    cluster): no broker, no gRPC, so that the machine's noise weighs less. Prints one line
    per run and a summary."""
    msg = Message(TOPIC, os.urandom(BODY), tags="TagA")
    runs: dict[str, list[Outcome]] = {"off": [], "on": []}
    for r in range(2 * args.rounds):
        for case in ("off", "on") if r % 2 == 0 else ("on", "off"):
            registry = CollectorRegistry() if case == "on" else None
            async with Producer(namesrv, metrics_registry=registry) as producer:
                await producer.send(msg)  # the route
                producer._acc._send = answered_at_once
                await timed_sends(producer, msg, args.messages // 4, args.window)  # warm
                o = await timed_sends(producer, msg, args.messages, args.window)
                o.client_sent_counted = sent_counted(registry, producer.config.group)
            runs[case].append(o)
            emit(
                f"client_path_{case}",
                args.messages,
                BODY,
                o.seconds,
                o.latencies,
                round=r,
                client_us_per_msg=round(o.client_cpu_s / args.messages * 1e6, 3),
                client_sent_counted=o.client_sent_counted,
                window=args.window,
                errors=o.errors,
                latency_of="send_nowait to its result, answers made up in this process",
            )
    us = {
        case: statistics.median(o.client_cpu_s / args.messages * 1e6 for o in outs)
        for case, outs in runs.items()
    }
    print(
        json.dumps(
            {
                "case": "client_path",
                "summary": True,
                "runs": len(runs["on"]),
                "off_us_per_msg_median": round(us["off"], 3),
                "on_us_per_msg_median": round(us["on"], 3),
                "added_us_per_msg": round(us["on"] - us["off"], 3),
                "on_vs_off": round(us["on"] / us["off"], 3),
            }
        ),
        flush=True,
    )


class Scraper:
    """Reads ``http://<address>/metrics`` every ``every`` seconds on a thread, answers unparsed
    (as little of this process's CPU as a read can take)."""

    def __init__(self, address: str, every: float) -> None:
        self.address = address
        self.every = every
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="scraper", daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _main(self) -> None:
        while not self._stop.wait(self.every):
            with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=5) as resp:
                resp.read()
            self.count += 1


@dataclass
class Run:
    """One run's figures, printed once its round is over (``vs_default`` needs the round's
    ``default`` run)."""

    case: str
    rate: float
    outcome: Outcome
    row: dict[str, Any]

    def emit(self, messages: int, default_rate: float) -> None:
        self.row["vs_default"] = round(self.rate / default_rate, 3)
        o = self.outcome
        emit(self.case, messages, BODY, o.seconds, o.latencies, **self.row)


def run_case(case: str, round_no: int, args: argparse.Namespace, loop: str, base: Path) -> Run:
    """One run of ``case`` on a cluster of its own."""
    data = Path(tempfile.mkdtemp(prefix=f"metrics-bench-{case}-", dir=base))
    try:
        env: dict[str, str] = {}
        if case == "broker_uncounted":
            site = data / "uncounted"
            site.mkdir()
            (site / "sitecustomize.py").write_text(UNCOUNTED)
            env["PYTHONPATH"] = str(site)
        state = local_cluster.up(
            data,
            brokers=1,
            nameservers=1,
            broker_env=env,
            schedule=False,
            txn_checker=False,
            console=False,
        )
        member = state.brokers[0]
        broker = ProcessMeter(member.pid)
        run_async(create_topics(state.namesrv, [TOPIC]), loop)
        registry = CollectorRegistry() if case == "client_on" else None
        out: list[Outcome] = []

        async def go() -> None:
            out.append(await send_all(state.namesrv, args.messages, args.window, registry))

        scraper = Scraper(member.metrics, args.scrape_every)
        broker_cpu0 = broker.cpu_s()
        with scraper if case == "scraped" else contextlib.nullcontext(scraper):
            run_async(go(), loop)
        broker_cpu = broker.cpu_s() - broker_cpu0
        stored = scrape(member.metrics).get_sample("apogee_broker_messages_in_total", topic=TOPIC)
        local_cluster.down(data)
        o = out[0]
        row: dict[str, Any] = {
            "round": round_no,
            "client_cpu_s": round(o.client_cpu_s, 2),
            "broker_cpu_s": round(broker_cpu, 2),
            "client_us_per_msg": round(o.client_cpu_s / args.messages * 1e6, 2),
            "broker_us_per_msg": round(broker_cpu / args.messages * 1e6, 2),
            "vs_default": None,
            "client_sent_counted": o.client_sent_counted,
            "broker_stored_counted": stored,
            "scrapes": scraper.count,
            "window": args.window,
            "errors": o.errors,
            "loop": loop,
            "latency_of": f"send_nowait to its result (one send in {SAMPLE})",
        }
        return Run(case, args.messages / o.seconds, o, row)
    finally:
        with contextlib.suppress(Exception):
            local_cluster.down(data)
        shutil.rmtree(data, ignore_errors=True)


def summarize(runs: dict[str, list[Run]]) -> None:
    """One line per case: medians over the rounds, and their ratios to ``default``'s."""

    def median(case: str, key: str) -> float:
        return statistics.median(r.rate if key == "rate" else r.row[key] for r in runs[case])

    base = {k: median("default", k) for k in ("rate", "client_us_per_msg", "broker_us_per_msg")}
    for case, rows in runs.items():
        rate = median(case, "rate")
        client_us = median(case, "client_us_per_msg")
        broker_us = median(case, "broker_us_per_msg")
        line = {
            "case": case,
            "summary": True,
            "rounds": len(rows),
            "msgs_per_s_median": round(rate),
            "msgs_per_s_all": [round(r.rate) for r in rows],
            "vs_default": round(rate / base["rate"], 3),
            "vs_default_paired_median": round(
                statistics.median(r.row["vs_default"] for r in rows), 3
            ),
            "client_us_per_msg_median": round(client_us, 2),
            "client_cpu_vs_default": round(client_us / base["client_us_per_msg"], 3),
            "broker_us_per_msg_median": round(broker_us, 2),
            "broker_cpu_vs_default": round(broker_us / base["broker_us_per_msg"], 3),
        }
        print(json.dumps(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="2 rounds of fewer sends")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every case (5)")
    ap.add_argument("--messages", type=int, default=None, help="sends per run (100,000)")
    ap.add_argument("--window", type=int, default=64, help="unsettled sends at most")
    ap.add_argument(
        "--scrape-every", type=float, default=1.0, help="seconds between scrapes (scraped)"
    )
    ap.add_argument("--case", action="append", choices=CASES, help="only these (repeatable)")
    ap.add_argument(
        "--client-path-only", action="store_true", help="only the in-process client path"
    )
    ap.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default=None,
        help="this process's event loop (default: uvloop when installed)",
    )
    ap.add_argument("--dir", default=None, help="where to put the clusters (default: a temp dir)")
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.messages = args.messages or (30_000 if args.quick else 100_000)
    cases = [c for c in CASES if not args.case or c in args.case or c == "default"]
    loop = loop_name(args.loop)
    base = Path(args.dir or tempfile.gettempdir())
    runs: dict[str, list[Run]] = {c: [] for c in cases}
    for r in range(0 if args.client_path_only else args.rounds):
        order = cases[r % len(cases) :] + cases[: r % len(cases)]  # rotated each round
        done = {case: run_case(case, r, args, loop, base) for case in order}
        for case in order:
            done[case].emit(args.messages, done["default"].rate)
            runs[case].append(done[case])
    if runs["default"]:
        summarize(runs)
    data = Path(tempfile.mkdtemp(prefix="metrics-bench-client-path-", dir=base))
    try:
        state = local_cluster.up(
            data, brokers=1, nameservers=1, schedule=False, txn_checker=False, console=False
        )
        run_async(create_topics(state.namesrv, [TOPIC]), loop)
        run_async(client_path(state.namesrv, args), loop)
    finally:
        with contextlib.suppress(Exception):
            local_cluster.down(data)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
