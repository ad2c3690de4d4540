"""What a consumer pays to decode the records of a pull (apogee.client.consumer.records).

Prints one JSON object per line (see figures.py): ``seconds`` and ``us_per_msg`` of the best of
``--runs`` runs, and as ``p50_us``/``p99_us`` the median and worst run's cost per message.
Cases: decoding alone, with and without the CRC check; decoding and reading the body; decoding
and reading body, tags, keys, unique id and properties (parsed lazily, on first use).

    python bench/decode_bench.py                # 1 KiB bodies, 32 records per pull
    python bench/decode_bench.py --per-pull 256 --body 4096
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from figures import emit

from apogee.client.consumer.records import ReceivedMessage, decode_records
from apogee.codec import encode_record


def touch_body(m: ReceivedMessage) -> None:
    _ = m.body


def touch_all(m: ReceivedMessage) -> None:
    _ = (m.body, m.tags, m.keys, m.unique_id, m.properties)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--per-pull", type=int, default=32)
    parser.add_argument("--body", type=int, default=1024, help="body bytes")
    parser.add_argument("--messages", type=int, default=64_000, help="per run")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    body = bytes(range(256)) * (args.body // 256) + bytes(args.body % 256)
    buf = b"".join(
        encode_record(
            "Orders",
            3,
            1000 + i,
            body,
            tags="created",
            keys=("order-17",),
            unique_id="0A0B0C0D" * 4,
            properties={"region": "eu"},
            born_host="10.0.0.1:5000",
            store_host="10.0.0.2:10911",
        )
        for i in range(args.per_pull)
    )
    pulls = max(1, args.messages // args.per_pull)
    cases: list[tuple[str, bool, Callable[[ReceivedMessage], None] | None]] = [
        ("decode_no_crc", False, None),
        ("decode_crc", True, None),
        ("decode_crc_body", True, touch_body),
        ("decode_crc_all_fields", True, touch_all),
    ]
    for name, crc, touch in cases:
        runs: list[float] = []
        for _ in range(args.runs):
            started = time.perf_counter()
            for _ in range(pulls):
                msgs = decode_records(buf, "broker-a", "Orders", 3, 1000, crc)
                if touch is not None:
                    for m in msgs:
                        touch(m)
            runs.append(time.perf_counter() - started)
        n = pulls * args.per_pull
        best = min(runs)
        emit(
            name,
            n,
            len(buf) // args.per_pull,
            best,
            [r / n for r in runs],
            per_pull=args.per_pull,
            us_per_msg=round(best / n * 1e6, 2),
        )


if __name__ == "__main__":
    main()
