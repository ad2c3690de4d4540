"""A short tour of the store: ``python -m apogee.store.demo DIR``.

Appends a few messages, reads them back through their queue, looks one up by key and by unique
id, then closes and reopens the store and prints what recovery found.
"""

from __future__ import annotations

import sys
from pathlib import Path

from apogee.store import Message, MessageStore, StoreConfig

MiB = 1 << 20


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else ".apogee/demo-store")
    config = StoreConfig(commitlog_file_size=64 * MiB, index_entries_per_file=100_000)
    with MessageStore.open(root, config) as store:
        print(f"store at {root}: {store.recovery.summary()}")
        batch = [
            Message(
                "DemoOrders",
                f"order {n} placed".encode(),
                queue_id=n % 2,
                tags="created",
                keys=[f"order-{n}"],
                properties={"source": "demo"},
            )
            for n in range(6)
        ]
        results = store.append(batch)
        for r in results:
            print(
                f"appended {r.unique_id} to {r.topic}/{r.queue_id} at queue offset "
                f"{r.queue_offset} (physical offset {r.phys_offset})"
            )
        store.wait_dispatched(10)
        first = results[0].queue_offset
        got = store.get("DemoOrders", 0, first, max_count=10, tags={"created"})
        print(f"read {len(got.messages)} from queue 0: {[m.body.decode() for m in got.messages]}")
        by_key = store.by_key("DemoOrders", f"order-{len(results) - 1}")
        print(f"by key order-{len(results) - 1}: {[m.body.decode() for m in by_key]}")
        found = store.by_unique_id(results[2].unique_id)
        print(f"by unique id {results[2].unique_id}: {found.body.decode() if found else None}")
    with MessageStore.open(root, config) as store:
        print(f"reopened: {store.recovery.summary()}")
        print(f"queue max offsets: {store.queue_max_offsets()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
