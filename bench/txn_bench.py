"""Benchmark of transactional messages: a nameserver, one broker (async flush) and the transaction
checker as separate processes (``apogee.local.cluster``, without the schedule service), a
fresh cluster for each case; producers and check listeners in this process.

Prints one JSON object per line (see ``figures.emit``), plus what each case adds.

Cases:

- ``plain_1k_c64`` and ``commit_1k_c64``: ``--messages`` messages of 1 KiB sent with 64 in
  flight (each send awaited by one of 64 tasks), first with ``Producer.send``, then with
  ``TransactionProducer.send_in_transaction`` and an executor that answers COMMIT at once (a half,
  the executor, the end: three records, the half, the real message and its op record; the
  halves and ends of concurrent transactions share requests). After one uncounted round of
  each. ``commit_vs_plain`` gives the ratio of the two
  rates (target: at least 1/3) and the CPU each took per message in this process and in the
  broker. The checker runs with its defaults (a round a minute).
- ``check_latency``: halves sent at 100 a second for ``--seconds`` with executors answering
  UNKNOWN; the checker scans every second (``check_interval_s`` 1), first checks a half 1 s after
  it is stored (``immunity_s`` 1) and may send 1,000 checks a second to the group (so that the
  rate limit does not bind). Lateness = arrival at the producer's check listener minus (the
  half's store time + 1 s); p50, p90, p99 and max (target: p99 at most 1.5 s).
- ``checker_pending_100k``: ``--pending`` halves (100,000; 20,000 with ``--quick``) of a
  producer group with no producer alive (sent with executors and a check listener answering
  UNKNOWN, the producer then closed), checked every second with the checker's default rate
  limit (100 checks a second to the group, a burst of 200): the checker process's CPU seconds
  (from /proc) and resident memory over ``--rounds`` rounds once all are due, and the broker's
  CPU over the same time; the last round's summary from the checker's log. ``--checker-env``
  changes the checker's settings.

    python bench/txn_bench.py            # about 2.5 minutes
    python bench/txn_bench.py --quick    # about 40 s
    python bench/txn_bench.py --case check_latency
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from figures import ProcessMeter, emit, loop_name, paced, percentile, run_async
from load import create_topics

from apogee.client import (
    Message,
    Producer,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
)
from apogee.local import cluster as local_cluster
from apogee.local.cluster import ClusterState

TOPIC = "BenchTxn"
QUEUES = 8
BODY = 1024
IN_FLIGHT = 64
#: The checker of the latency and 100k cases: a round every second, a first check 1 s after a
#: half is stored.
INTERVAL_S = 1.0
IMMUNITY_S = 1.0


async def commit(m: TransactionMessage, arg: object) -> TransactionDecision:
    return TransactionDecision.COMMIT


async def unknown(m: TransactionMessage, arg: object) -> TransactionDecision:
    return TransactionDecision.UNKNOWN


async def unknown_check(m: TransactionCheckMessage) -> TransactionDecision:
    return TransactionDecision.UNKNOWN


class Cluster:
    """One case's cluster under ``root/name``: ``with Cluster(root, name, checker_env) as c``;
    ``checker_env`` overrides the checker's default settings."""

    def __init__(self, root: Path, name: str, checker_env: dict[str, str]) -> None:
        self.data = root / name
        self.checker_env = checker_env
        self.state: ClusterState | None = None

    def __enter__(self) -> Cluster:
        self.state = local_cluster.up(
            self.data,
            brokers=1,
            nameservers=1,
            flush_mode="async",
            schedule=False,
            txn_checker_env=self.checker_env,
            console=False,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            local_cluster.down(self.data)

    @property
    def namesrv(self) -> str:
        assert self.state is not None
        return self.state.namesrv

    @property
    def broker(self) -> ProcessMeter:
        assert self.state is not None
        return ProcessMeter(self.state.brokers[0].pid)

    @property
    def checker(self) -> ProcessMeter:
        assert self.state is not None
        return ProcessMeter(self.state.txn_checker[0].pid)

    @property
    def checker_log(self) -> Path:
        assert self.state is not None
        return Path(self.state.txn_checker[0].log)


async def concurrently(count: int, send: Callable[[int], Awaitable[Any]]) -> list[float]:
    """``send(i)`` for i in range(count), :data:`IN_FLIGHT` at a time; each one's seconds."""
    lat: list[float] = []
    turn = iter(range(count))

    async def worker() -> None:
        for i in turn:
            t = time.perf_counter()
            await send(i)
            lat.append(time.perf_counter() - t)

    await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
    return lat


# -- committed transactions beside plain sends -----------------------------------------------------


async def case_throughput(c: Cluster, count: int) -> None:
    await create_topics(c.namesrv, [TOPIC], QUEUES)
    body = os.urandom(BODY)
    rows: dict[str, dict[str, float]] = {}

    async with (
        Producer(c.namesrv, group="bench-plain") as plain,
        TransactionProducer(c.namesrv, "bench-txn") as txn,
    ):

        async def send_plain(i: int) -> None:
            await plain.send(Message(TOPIC, body))

        async def send_txn(i: int) -> None:
            r = await txn.send_in_transaction(Message(TOPIC, body), commit)
            if not r.committed:
                raise RuntimeError(f"not committed: {r}")

        for case, send in (("plain_1k_c64", send_plain), ("commit_1k_c64", send_txn)):
            await concurrently(min(count, 2000), send)  # not counted: routes, connections
            broker = c.broker
            cpu0, b0 = time.process_time(), broker.cpu_s()
            start = time.perf_counter()
            lat = await concurrently(count, send)
            seconds = time.perf_counter() - start
            client_cpu, broker_cpu = time.process_time() - cpu0, broker.cpu_s() - b0
            rows[case] = {
                "rate": count / seconds,
                "client_us": client_cpu / count * 1e6,
                "broker_us": broker_cpu / count * 1e6,
            }
            emit(
                case,
                count,
                BODY,
                seconds,
                lat,
                in_flight=IN_FLIGHT,
                client_cpu_s=round(client_cpu, 2),
                broker_cpu_s=round(broker_cpu, 2),
            )
    plain_row, txn_row = rows["plain_1k_c64"], rows["commit_1k_c64"]
    print(
        json.dumps(
            {
                "case": "commit_vs_plain",
                "ratio": round(txn_row["rate"] / plain_row["rate"], 3),
                "target": ">= 0.333",
                "client_cpu_us_per_msg": {k: round(r["client_us"], 1) for k, r in rows.items()},
                "broker_cpu_us_per_msg": {k: round(r["broker_us"], 1) for k, r in rows.items()},
            }
        ),
        flush=True,
    )


# -- from a half's immunity to its check -----------------------------------------------------------


async def case_check_latency(c: Cluster, seconds: float, rate: int) -> None:
    await create_topics(c.namesrv, [TOPIC], QUEUES)
    due: dict[str, float] = {}
    late: dict[str, float] = {}
    all_checked = asyncio.Event()
    total = int(seconds * rate)

    async def listener(m: TransactionCheckMessage) -> TransactionDecision:
        now = time.time()
        uid = m.transaction_id
        if uid in due and uid not in late:
            late[uid] = now - due[uid]
            if len(late) >= total:
                all_checked.set()
        return TransactionDecision.ROLLBACK

    body = os.urandom(BODY)
    async with TransactionProducer(c.namesrv, "bench-checks", check_listener=listener) as p:
        # the producer's route and sessions first: a check must find it connected
        await p.send_in_transaction(Message(TOPIC, body), commit)
        checker, broker = c.checker, c.broker
        cpu0, b0 = checker.cpu_s(), broker.cpu_s()
        start = time.perf_counter()
        tasks: set[asyncio.Task[None]] = set()

        async def one() -> None:
            r = await p.send_in_transaction(Message(TOPIC, body), unknown)
            due[r.transaction_id] = r.store_timestamp_ms / 1000 + IMMUNITY_S

        async for _ in paced(rate, total):
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        await asyncio.wait_for(all_checked.wait(), 30 + IMMUNITY_S + 5 * INTERVAL_S)
        elapsed = time.perf_counter() - start
        checker_cpu, broker_cpu = checker.cpu_s() - cpu0, broker.cpu_s() - b0
    lat = sorted(late.values())
    emit(
        "check_latency",
        len(lat),
        BODY,
        elapsed,
        list(lat),
        sent_per_s=rate,
        p50_ms=round(percentile(lat, 0.50) * 1000),
        p90_ms=round(percentile(lat, 0.90) * 1000),
        p99_ms=round(percentile(lat, 0.99) * 1000),
        max_ms=round(lat[-1] * 1000) if lat else 0,
        early=sum(1 for x in lat if x < 0),
        target_p99_ms=1500,
        checker_cpu_s=round(checker_cpu, 2),
        broker_cpu_s=round(broker_cpu, 2),
    )


# -- the checker with 100,000 halves pending -------------------------------------------------------

_ROUND = re.compile(r"round: (.*)$")


async def case_checker_pending(c: Cluster, pending: int, rounds: int) -> None:
    await create_topics(c.namesrv, [TOPIC], QUEUES)
    body = os.urandom(BODY)
    t = time.perf_counter()
    # checks that come while it sends are answered UNKNOWN
    async with TransactionProducer(c.namesrv, "bench-stuck", check_listener=unknown_check) as p:

        async def send(i: int) -> None:
            await p.send_in_transaction(Message(TOPIC, body), unknown)

        await concurrently(pending, send)
    fill_s = time.perf_counter() - t
    print(f"# {pending} halves sent in {fill_s:.1f}s; the producer is closed", file=sys.stderr)
    # every half due, and a round or two behind us, before measuring
    await asyncio.sleep(IMMUNITY_S + 2 * INTERVAL_S)  # letting rounds run, not synchronisation
    checker, broker = c.checker, c.broker
    log_at = c.checker_log.stat().st_size
    cpu0, b0 = checker.cpu_s(), broker.cpu_s()
    start = time.perf_counter()
    rss = [checker.rss_mb()]
    for _ in range(rounds):
        await asyncio.sleep(INTERVAL_S)  # measuring over rounds: sampling memory once each
        rss.append(checker.rss_mb())
    seconds = time.perf_counter() - start
    checker_cpu, broker_cpu = checker.cpu_s() - cpu0, broker.cpu_s() - b0
    with c.checker_log.open("rb") as f:
        f.seek(log_at)
        summaries = [
            m[1]
            for line in f.read().decode(errors="replace").splitlines()
            if (m := _ROUND.search(line))
        ]
    emit(
        f"checker_pending_{pending // 1000}k",
        pending,
        BODY,
        seconds,
        [],
        fill_s=round(fill_s, 1),
        rounds=rounds,
        checker_cpu_s=round(checker_cpu, 2),
        checker_cpu_per_round_s=round(checker_cpu / rounds, 3),
        checker_rss_mb=round(max(rss), 1),
        broker_cpu_s=round(broker_cpu, 2),
        last_round=summaries[-1] if summaries else "(no round logged)",
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer messages, halves and seconds")
    ap.add_argument("--case", help="run only cases whose name starts with this")
    ap.add_argument("--messages", type=int, default=None, help="per throughput case")
    ap.add_argument("--seconds", type=float, default=None, help="of the check latency case")
    ap.add_argument("--pending", type=int, default=None, help="halves of the checker case")
    ap.add_argument("--rounds", type=int, default=None, help="rounds the checker is measured")
    ap.add_argument(
        "--checker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of the checker case's txn-checker, e.g. "
        "APOGEE_TXN_CHECKER_HALF_SCAN_BATCH=4096 (repeatable)",
    )
    ap.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default=None,
        help="this process's event loop (default: uvloop when installed)",
    )
    ap.add_argument("--dir", default=None, help="where to put the data (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the data and the services' logs")
    args = ap.parse_args()
    loop = loop_name(args.loop)
    messages = args.messages or (5_000 if args.quick else 30_000)
    seconds = args.seconds or (5.0 if args.quick else 20.0)
    pending = args.pending or (20_000 if args.quick else 100_000)
    rounds = args.rounds or (5 if args.quick else 10)

    def wanted(name: str) -> bool:
        return args.case is None or name.startswith(args.case)

    base = Path(args.dir or tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="txn-bench-", dir=base))
    fast = {
        "APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": str(INTERVAL_S),
        "APOGEE_TXN_CHECKER_IMMUNITY_S": str(IMMUNITY_S),
    }
    extra: dict[str, str] = {}
    for item in args.checker_env:
        name, eq, value = item.partition("=")
        if not eq:
            ap.error(f"--checker-env takes NAME=VALUE, got {item!r}")
        extra[name] = value
    try:
        if wanted("plain_1k_c64") or wanted("commit_1k_c64"):
            with Cluster(root, "throughput", {}) as c:
                run_async(case_throughput(c, messages), loop)
        if wanted("check_latency"):
            env = {**fast, "APOGEE_TXN_CHECKER_CHECKS_PER_GROUP_PER_S": "1000"}
            with Cluster(root, "latency", env) as c:
                run_async(case_check_latency(c, seconds, 100), loop)
        if wanted("checker_pending"):
            with Cluster(root, "pending", {**fast, **extra}) as c:
                run_async(case_checker_pending(c, pending, rounds), loop)
    finally:
        if args.keep:
            print(f"data and logs kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
