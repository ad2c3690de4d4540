"""Benchmark of the dedup window's rebuild at a broker's start (``apogee_broker.core.send.
dedup_log``): the store is filled, closed and opened again, and the window is read back from
its CommitLog, as a broker does before it takes a send.

Prints one JSON object per line (``bench/figures.py``'s fields, ``messages`` being the records
with a dedup id in the window) and ``store_open_s``, ``rebuild_s``, ``ids`` and ``us_per_id``.

    python bench/dedup_bench.py            # the full run (about a minute)
    python bench/dedup_bench.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from figures import emit

from apogee.common.clock import SystemClock
from apogee.store import Message, MessageStore, StoreConfig
from apogee_broker.core.send.dedup import DEDUP_PROPERTY, DedupWindow
from apogee_broker.core.send.dedup_log import rebuild

MiB = 1 << 20
BODY = 200
BATCH = 256


def fill(store: MessageStore, plain: int, with_ids: int) -> None:
    """``plain`` records without an id, then ``with_ids`` with one, in batches of 256."""
    body = os.urandom(BODY)
    for start in range(0, plain + with_ids, BATCH):
        batch = []
        for i in range(start, min(plain + with_ids, start + BATCH)):
            props = {DEDUP_PROPERTY: f"id-{i}"} if i >= plain else None
            batch.append(Message("Bench", body, queue_id=i % 8, properties=props))
        store.append(batch)


def case(name: str, plain: int, with_ids: int, base: Path, file_mib: int) -> None:
    path = Path(tempfile.mkdtemp(prefix="dedup-bench-", dir=base))
    config = StoreConfig(commitlog_file_size=file_mib * MiB, index_entries_per_file=4_000_000)
    try:
        store = MessageStore.open(path, config, start_retention=False)
        try:
            fill(store, plain, with_ids)
        finally:
            store.close()
        start = time.perf_counter()
        store = MessageStore.open(path, config, start_retention=False)
        opened = time.perf_counter() - start
        try:
            window = DedupWindow(600.0, 1_000_000)
            start = time.perf_counter()
            report = rebuild(window, store, SystemClock().time_ms())
            took = time.perf_counter() - start
        finally:
            store.close()
        assert report.ids == len(window) == min(with_ids, 1_000_000), report.summary()
        emit(
            name,
            with_ids,
            BODY,
            took,
            [],
            store_open_s=round(opened, 3),
            rebuild_s=round(took, 3),
            ids=report.ids,
            us_per_id=round(took / report.ids * 1e6, 2) if report.ids else 0,
            report=report.summary(),
        )
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts: a few seconds")
    parser.add_argument("--dir", type=Path, default=None, help="where the stores are made")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.gettempdir())
    scale = 10 if args.quick else 1
    many, some = 1_000_000 // scale, 100_000 // scale
    case(f"plain_{many}", many, 0, base, 256)
    case(f"ids_{some}", 0, some, base, 256)
    case(f"ids_{some}_after_{many}_plain", many, some, base, 64)
    if not args.quick:
        case("ids_1000000", 0, 1_000_000, base, 256)


if __name__ == "__main__":
    main()
