"""Axis ``txns`` of the scale benchmark (``scale_bench.py``): what a broker and the transaction
checker pay for transactions left pending (halves sent, never committed nor rolled back), at a
series of steps (10,000 and 1,000,000 by default), each on a fresh cluster (one nameserver, one
broker, async flush, the transaction checker; every member on free ports).

The checker runs, as in a deployment, but with a round every second and a first check 1 s after
a half is stored (its default is a round a minute, a first check after 6 s): what a round costs
with n pending is the same, and a short window then holds several rounds. A producer of the
pending group stays connected and answers every check UNKNOWN, so the halves stay pending and
the checks it is sent (at most ``checks_per_group_per_s``, 100 a second) are answered as a live
application would; the checker's rate limit keeps the checks themselves independent of n,
which leaves what does grow with n: scanning the pending halves. (``--no-checker`` measures the
broker alone.)

At each step:

- ``send_s``, ``sends_per_s``, ``send_errors``: the n halves, ``send_in_transaction`` with an
  executor that answers UNKNOWN, :data:`IN_FLIGHT` at a time (the producer batches their
  SendHalf calls);
- ``broker_rss_mb``, ``broker_fds``, ``broker_maps``: the broker with the n pending;
  ``checker_rss_mb``: the checker's resident memory;
- ``checker_cpu_s`` over ``window_s`` (``--cpu-window``) and ``checker_cpu_per_round_s``, from
  ``/proc/<pid>/stat``; ``broker_window_cpu_s``: the broker's over the same window (it answers
  the checker's scans); ``checker_rounds``, ``checker_last_round``: the rounds the checker
  logged in the window and the last one's summary (how many halves it scanned, why its scan
  ended, how long it took);
- ``scrape_ms``, ``scrape_max_ms``: one ``GET /metrics`` of the broker (median and slowest of
  ``--scrapes``), ``scrape_broker_cpu_ms``: the broker's CPU per scrape, and
  ``scrape_pending``: the ``apogee_broker_txn_half_pending`` it answered ("absent": the
  broker left the transaction metrics out, their count took longer than its bound);
- ``fresh_p50_ms``, ``fresh_p99_ms``: ``--fresh`` new transactions (send half and commit) one
  after another, another producer group, with the n pending; ``fresh_failed``: those not
  stored within the producer's send timeout (3 s) or not committed; ``fresh_visible``: how
  many of the committed ones a ``QueueReader`` reads back from the topic (only committed
  messages reach it), and ``fresh_visible_s``: how long until it read them all;
  ``fresh_scraping_p50_ms``, ``fresh_scraping_p99_ms``, ``fresh_scraping_failed``: as many
  again (``fresh_scraping``: those committed of those begun within 30 s) while ``/metrics``
  is scraped without pause (``scrapes_meanwhile`` times);
- ``recovery_s``: after ``kill -9`` of the broker, until it is up and registered again;
  ``recovered_rss_mb`` and ``recovered_scrape_ms``, ``recovered_pending``: the broker once back
  (``--no-restart`` skips this).

    python bench/scale_bench.py --axis txns --steps 10000
    python bench/scale_bench.py --axis txns --steps 10000,100000 --cpu-window 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from figures import ProcessMeter, percentile
from load import create_topics
from scale_common import Step, proc_facts, run

from apogee.client import (
    Message,
    QueueReader,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
)
from apogee.testkit.waiting import eventually

TOPIC = "ScaleTxnTopic"
QUEUES = 8
BODY = b"p" * 256
#: the pending producer's sends at a time
IN_FLIGHT = 256
DEFAULT_STEPS = [10_000, 1_000_000]
#: the checker of this axis: a round every second, a first check 1 s after a half is stored
CHECKER_ENV = {
    "APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": "1",
    "APOGEE_TXN_CHECKER_IMMUNITY_S": "1",
}
#: most seconds the fresh transactions beside scrapes may take (scrapes hold the broker's loop)
SCRAPING_BOUND_S = 30.0
_ROUND = re.compile(r"round: (.*)$")
_PENDING = re.compile(rb"^apogee_broker_txn_half_pending (\S+)$", re.MULTILINE)


async def unknown(m: TransactionMessage, arg: object) -> TransactionDecision:
    return TransactionDecision.UNKNOWN


async def unknown_check(m: TransactionCheckMessage) -> TransactionDecision:
    return TransactionDecision.UNKNOWN


async def commit(m: TransactionMessage, arg: object) -> TransactionDecision:
    return TransactionDecision.COMMIT


async def send_pending(producer: TransactionProducer, n: int) -> tuple[float, int]:
    """``n`` halves left pending, :data:`IN_FLIGHT` at a time: seconds, and the sends that
    failed or were not left pending."""
    turn = iter(range(n))
    errors = 0

    async def worker() -> None:
        nonlocal errors
        for _ in turn:
            try:
                r = await producer.send_in_transaction(Message(TOPIC, BODY), unknown)
            except Exception:
                errors += 1
                continue
            if r.committed:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
    return time.perf_counter() - t0, errors


def scrape(url: str) -> tuple[float, bytes]:
    """One ``GET`` of ``url``: seconds, and the body."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as answer:
        body: bytes = answer.read()
    return time.perf_counter() - t0, body


def pending_gauge(body: bytes) -> float | str:
    m = _PENDING.search(body)
    return float(m[1]) if m else "absent"


async def scrapes(url: str, times: int, broker: ProcessMeter) -> dict[str, Any]:
    """``times`` scrapes of ``url``, one after another (on a thread: the producers' loop goes
    on answering checks)."""
    took = []
    body = b""
    cpu0 = broker.cpu_s()
    for _ in range(times):
        s, body = await asyncio.to_thread(scrape, url)
        took.append(s)
    cpu = broker.cpu_s() - cpu0
    return {
        "scrape_ms": round(statistics.median(took) * 1000, 1),
        "scrape_max_ms": round(max(took) * 1000, 1),
        "scrape_broker_cpu_ms": round(cpu / times * 1000, 1),
        "scrape_pending": pending_gauge(body),
    }


async def fresh(
    producer: TransactionProducer, count: int, within_s: float = float("inf")
) -> tuple[list[float], int]:
    """``count`` transactions committed one after another, or as many as start within
    ``within_s``: the seconds of each one committed (sorted), and how many failed (not stored
    within the producer's send timeout, or not committed)."""
    lat: list[float] = []
    failed = 0
    end = time.perf_counter() + within_s
    for _ in range(count):
        if time.perf_counter() > end:
            break
        t0 = time.perf_counter()
        try:
            r = await producer.send_in_transaction(Message(TOPIC, b"fresh"), commit)
        except Exception:
            failed += 1
            continue
        if r.committed:
            lat.append(time.perf_counter() - t0)
        else:
            failed += 1
    return sorted(lat), failed


async def visible(namesrv: str, wanted: int, timeout: float) -> tuple[int, float]:
    """Messages a reader reads back from the topic once it has ``wanted`` (or at the
    deadline), and the seconds that took."""
    t0 = time.perf_counter()
    seen = 0
    async with QueueReader(namesrv) as reader:

        async def count() -> bool:
            nonlocal seen
            got = 0
            for q in await reader.queues(TOPIC):
                bounds = await reader.offsets(q)
                async for _ in reader.read(q, bounds.min_offset, bounds.max_offset):
                    got += 1
            seen = got
            return got >= wanted

        with contextlib.suppress(AssertionError, TimeoutError):  # what was read is reported
            await eventually(count, timeout, f"{wanted} committed messages read", every=0.1)
    return seen, time.perf_counter() - t0


def log_size(log: Path) -> int:
    return log.stat().st_size


def round_lines(log: Path, since: int) -> list[str]:
    """The checker's round summaries logged after byte ``since`` of its log."""
    with log.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    return [m[1] for line in text.splitlines() if (m := _ROUND.search(line))]


async def pending_step(step: Step, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """What the step measures with the pending producer connected (everything but the
    restart)."""
    row: dict[str, Any] = {}
    window = float(getattr(args, "cpu_window", 10.0))
    count = int(getattr(args, "fresh", 300))
    times = int(getattr(args, "scrapes", 5))
    url = f"http://{step.broker.metrics}/metrics"
    broker = ProcessMeter(step.pid)
    checker = step.state.txn_checker[0] if step.state.txn_checker else None
    await create_topics(step.namesrv, [TOPIC], QUEUES)
    async with (
        TransactionProducer(step.namesrv, "scale-pending", check_listener=unknown_check) as stuck,
        TransactionProducer(step.namesrv, "scale-fresh", check_listener=unknown_check) as new,
    ):
        _, failed = await fresh(new, 1)  # routes and sessions first; not counted
        if failed:
            raise RuntimeError("the first transaction of the fresh producer failed")
        send_s, errors = await send_pending(stuck, n)
        row["send_s"] = round(send_s, 2)
        row["sends_per_s"] = round(n / send_s)
        row["send_errors"] = errors
        row |= {f"broker_{k}": v for k, v in proc_facts(step.pid).items()}
        if checker is not None:
            meter = ProcessMeter(checker.pid)
            log = Path(checker.log)
            at = log_size(log)
            cpu0, b0 = meter.cpu_s(), broker.cpu_s()
            rss = meter.rss_mb()
            t0 = time.perf_counter()
            await asyncio.sleep(window)  # measuring over a fixed window, not synchronisation
            seconds = time.perf_counter() - t0
            cpu, bcpu = meter.cpu_s() - cpu0, broker.cpu_s() - b0
            rounds = round_lines(log, at)
            row["window_s"] = round(seconds, 1)
            row["checker_rss_mb"] = round(max(rss, meter.rss_mb()), 1)
            row["checker_cpu_s"] = round(cpu, 2)
            row["checker_rounds"] = len(rounds)
            row["checker_cpu_per_round_s"] = round(cpu / len(rounds), 3) if rounds else None
            row["broker_window_cpu_s"] = round(bcpu, 2)
            row["checker_last_round"] = rounds[-1] if rounds else "(no round logged)"
        row |= await scrapes(url, times, broker)
        lat, failed = await fresh(new, count)
        row["fresh_p50_ms"] = round(percentile(lat, 0.5) * 1000, 2)
        row["fresh_p99_ms"] = round(percentile(lat, 0.99) * 1000, 2)
        row["fresh_failed"] = failed
        seen, seen_s = await visible(step.namesrv, 1 + len(lat), 60)
        row["fresh_visible"] = seen - 1
        row["fresh_visible_s"] = round(seen_s, 2)

        done = asyncio.Event()

        async def scrape_on() -> int:
            got = 0
            while not done.is_set():
                await asyncio.to_thread(scrape, url)
                got += 1
            return got

        scraper = asyncio.create_task(scrape_on())
        try:
            lat, failed = await fresh(new, count, SCRAPING_BOUND_S)
        finally:
            done.set()
            row["scrapes_meanwhile"] = await scraper
        row["fresh_scraping"] = len(lat)
        row["fresh_scraping_failed"] = failed
        row["fresh_scraping_p50_ms"] = round(percentile(lat, 0.5) * 1000, 2)
        row["fresh_scraping_p99_ms"] = round(percentile(lat, 0.99) * 1000, 2)
    return row


def axis_txns(base: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"axis": "txns", "step": n}
    checking = not getattr(args, "no_checker", False)
    with Step(
        base, f"txns-{n}", txn_checker=checking, service_env=CHECKER_ENV if checking else None
    ) as step:
        row["checker"] = checking
        row |= run(pending_step(step, n, args))
        if getattr(args, "no_restart", False):
            return row
        try:
            row["recovery_s"] = round(step.restart_broker_after_kill(), 2)
        except Exception as exc:  # a wall: the broker does not come back
            row["recovery_failed"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
            return row
        row["recovered_rss_mb"] = proc_facts(step.pid)["rss_mb"]
        s, body = scrape(f"http://{step.broker.metrics}/metrics")
        row["recovered_scrape_ms"] = round(s * 1000, 1)
        row["recovered_pending"] = pending_gauge(body)
    return row
