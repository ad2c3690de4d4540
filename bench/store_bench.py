"""Benchmark of apogee.store: appends, reads and crash recovery, on real files.

Prints one JSON object per line:
``case, messages, msg_bytes, seconds, msgs_per_s, mb_per_s, p50_us, p99_us, rss_mb`` and, for
appends, ``readable_s``: the time until every appended message was readable through its
ConsumeQueue (dispatch included). Throughput counts that time, not just the append calls.

    python bench/store_bench.py            # full run (about two minutes)
    python bench/store_bench.py --quick    # under 30 s
    python bench/store_bench.py --case append_1k_async   # one case
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from figures import emit

from apogee.common.aio import LoopBridge
from apogee.store import FlushMode, Message, MessageStore, StoreConfig

MiB = 1 << 20
GiB = 1 << 30


@contextmanager
def temp_store(config: StoreConfig, base: Path) -> Iterator[MessageStore]:
    path = Path(tempfile.mkdtemp(prefix="store-bench-", dir=base))
    store = MessageStore.open(path, config, start_retention=False)
    try:
        yield store
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)


def bench_config(**kw: Any) -> StoreConfig:
    return StoreConfig(commitlog_file_size=256 * MiB, index_entries_per_file=4_000_000, **kw)


def warm_up(store: MessageStore) -> None:
    """Create the first CommitLog file (zero-filled in SYNC mode) and let the background
    preparation of the next one finish, so the timed part measures appends, not file creation
    (which happens once per file: once per GiB in production)."""
    store.append(Message("WarmUp", b"x"))
    store.commitlog.files.wait_prepared(120)


def make_batches(count: int, size: int, batch: int, topic: str, queues: int) -> list[list[Message]]:
    body = os.urandom(size)
    out = []
    for start in range(0, count, batch):
        out.append(
            [
                Message(
                    topic, body, queue_id=(start // batch) % queues, tags="TagA", keys=(f"k{i}",)
                )
                for i in range(start, min(count, start + batch))
            ]
        )
    return out


def case_append_async(name: str, count: int, size: int, base: Path) -> None:
    batches = make_batches(count, size, 32, "BenchAsync", 8)
    with temp_store(bench_config(), base) as store:
        lat: list[float] = []
        t0 = time.perf_counter()
        for b in batches:
            t = time.perf_counter()
            store.append(b)
            lat.append(time.perf_counter() - t)
        appended = time.perf_counter() - t0
        if not store.wait_dispatched(120):
            raise RuntimeError("dispatch did not finish")
        readable = time.perf_counter() - t0
        emit(
            name,
            count,
            size,
            readable,
            lat,
            batch=32,
            append_s=round(appended, 4),
            readable_s=round(readable, 4),
            latency_of="one append of 32",
        )


def case_append_sync_concurrent(count: int, size: int, writers: int, base: Path) -> None:
    cfg = bench_config(flush_mode=FlushMode.SYNC)
    body = os.urandom(size)
    per = count // writers
    with temp_store(cfg, base) as store:
        warm_up(store)
        lats: list[list[float]] = [[] for _ in range(writers)]
        start = threading.Barrier(writers + 1)

        def writer(i: int) -> None:
            msgs = [
                Message("BenchSync", body, queue_id=i % 8, keys=(f"w{i}-{n}",)) for n in range(per)
            ]
            start.wait(30)
            out = lats[i]
            for m in msgs:
                t = time.perf_counter()
                store.append(m)
                out.append(time.perf_counter() - t)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
        for th in threads:
            th.start()
        start.wait(30)
        t0 = time.perf_counter()
        for th in threads:
            th.join(300)
        appended = time.perf_counter() - t0
        store.wait_dispatched(60)
        readable = time.perf_counter() - t0
        emit(
            "append_1k_sync_64_threads",
            per * writers,
            size,
            readable,
            [x for lst in lats for x in lst],
            writers=writers,
            writer_kind="threads",
            append_s=round(appended, 4),
            readable_s=round(readable, 4),
            latency_of="one durable append",
        )


def case_append_sync_asyncio(count: int, size: int, writers: int, base: Path) -> None:
    """64 concurrent writers as the broker has them: tasks on one event loop, each awaiting
    the durability of its own append (``append_async`` + a future)."""
    cfg = bench_config(flush_mode=FlushMode.SYNC)
    body = os.urandom(size)
    per = count // writers
    with temp_store(cfg, base) as store:
        warm_up(store)

        async def run() -> tuple[float, list[float]]:
            loop = asyncio.get_running_loop()
            lat: list[float] = []

            bridge = LoopBridge(loop)

            async def append(msg: Message) -> None:
                fut: asyncio.Future[None] = loop.create_future()
                store.append_async(msg, lambda err: bridge.post(fut, err))
                await fut

            async def writer(i: int) -> None:
                for n in range(per):
                    t = time.perf_counter()
                    await append(Message("BenchSyncAio", body, queue_id=i % 8, keys=(f"w{i}-{n}",)))
                    lat.append(time.perf_counter() - t)

            t0 = time.perf_counter()
            await asyncio.gather(*(writer(i) for i in range(writers)))
            return time.perf_counter() - t0, lat

        appended, lat = asyncio.run(run())
        gc = store._group_commit
        flushes = gc.flushes if gc is not None else 0
        emit(
            "append_1k_sync_64_writers",
            per * writers,
            size,
            appended,
            lat,
            writers=writers,
            writer_kind="asyncio tasks",
            fsyncs=flushes,
            msgs_per_fsync=round(per * writers / max(1, flushes), 1),
            latency_of="one durable append",
        )


def case_read_sequential(count: int, size: int, base: Path, verify_crc: bool) -> None:
    batches = make_batches(count, size, 256, "BenchRead", 1)
    with temp_store(bench_config(verify_crc_on_read=verify_crc), base) as store:
        for b in batches:
            store.append(b)
        store.wait_dispatched(120)
        lat: list[float] = []
        got = 0
        offset = 0
        t0 = time.perf_counter()
        while True:
            t = time.perf_counter()
            r = store.get("BenchRead", 0, offset, 256)
            lat.append(time.perf_counter() - t)
            if not r.messages:
                break
            got += len(r.messages)
            offset = r.next_offset
        seconds = time.perf_counter() - t0
        if got != count:
            raise RuntimeError(f"read {got} of {count}")
        emit(
            "read_sequential_1k" if verify_crc else "read_sequential_1k_no_crc",
            got,
            size,
            seconds,
            lat,
            latency_of="one get of 256",
            verify_crc=verify_crc,
        )


_CHILD = """
import os, signal, sys
from apogee.store import Message, MessageStore, StoreConfig
path, total, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = StoreConfig(commitlog_file_size=int(sys.argv[4]), index_entries_per_file=4_000_000)
store = MessageStore.open(path, cfg, start_retention=False)
body = os.urandom(size)
n = 0
while n < total:
    q = (n // 64) % 8
    store.append([Message("BenchRecover", body, queue_id=q, keys=(str(n + i),)) for i in range(64)])
    n += 64
store.wait_dispatched(120)
os.kill(os.getpid(), signal.SIGKILL)
"""


def case_recovery(log_bytes: int, base: Path) -> None:
    size = 1024
    per = 1024 + 112 + 12 + 60
    total = log_bytes // per - 64
    path = Path(tempfile.mkdtemp(prefix="store-bench-recover-", dir=base))
    try:
        file_size = max(log_bytes, 64 * MiB)
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path), str(total), str(size), str(file_size)],
            timeout=600,
            check=False,
        )
        if child.returncode != -signal.SIGKILL:
            raise RuntimeError(f"writer exited with {child.returncode}, expected SIGKILL")
        t0 = time.perf_counter()
        store = MessageStore.open(
            path,
            StoreConfig(commitlog_file_size=file_size, index_entries_per_file=4_000_000),
            start_retention=False,
        )
        seconds = time.perf_counter() - t0
        rep = store.recovery
        try:
            if rep.clean_shutdown or rep.records_checked < total:
                raise RuntimeError(f"unexpected recovery: {rep.summary()}")
        finally:
            store.close()
        emit(
            "recovery_after_crash",
            rep.records_checked,
            size,
            seconds,
            [seconds],
            log_mib=round(rep.last_valid_offset / MiB, 1),
            records_checked=rep.records_checked,
            entries_redispatched=rep.entries_redispatched,
            latency_of="whole recovery",
        )
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller runs, under 30 s in all")
    ap.add_argument("--case", help="run only this case (prefix match)")
    ap.add_argument("--dir", default=None, help="where to put the stores (default: a temp dir)")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.gettempdir())
    k = 1 if args.quick else 4
    cases: list[tuple[str, Callable[[], None]]] = [
        ("append_1k_async", lambda: case_append_async("append_1k_async", 100_000 * k, 1024, base)),
        ("append_1k_sync_64_writers", lambda: case_append_sync_asyncio(20_000 * k, 1024, 64, base)),
        (
            "append_1k_sync_64_threads",
            lambda: case_append_sync_concurrent(5_000 * k, 1024, 64, base),
        ),
        (
            "append_128b_async",
            lambda: case_append_async("append_128b_async", 200_000 * k, 128, base),
        ),
        ("read_sequential_1k", lambda: case_read_sequential(100_000 * k, 1024, base, True)),
        ("read_sequential_1k_no_crc", lambda: case_read_sequential(100_000 * k, 1024, base, False)),
        ("recovery_after_crash", lambda: case_recovery(256 * MiB if args.quick else GiB, base)),
    ]
    for name, run in cases:
        if args.case is None or name.startswith(args.case):
            run()


if __name__ == "__main__":
    main()
