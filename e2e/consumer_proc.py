"""A consumer in a process of its own, for the end-to-end tests that kill consumers.

    python -m e2e.consumer_proc --namesrv A --group G --topic T --out FILE [--orderly]

Every message handed to the listener is written to ``FILE`` (one line: client id, unique id,
broker/queue, queue offset, first key, body; flushed before the listener returns), so the file
holds at least every message whose offset the consumer may have committed. The consumer's
assignment is written to ``FILE.assignment`` (atomically) whenever it changes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

from apogee.client.consumer.push import PushConsumer
from apogee.client.consumer.records import ReceivedMessage


async def run(args: argparse.Namespace) -> None:
    out = open(args.out, "a", buffering=1)  # noqa: SIM115, ASYNC230 - for the process's life
    client_id = args.client_id

    def listen(msgs: list[ReceivedMessage]) -> None:
        for m in msgs:
            key = m.keys[0] if m.keys else "-"
            out.write(
                f"{client_id}\t{m.unique_id}\t{m.broker_name}/{m.queue_id}\t{m.queue_offset}"
                f"\t{key}\t{m.body.decode()}\n"
            )
        out.flush()

    consumer = PushConsumer(
        args.namesrv,
        args.group,
        listen,
        client_id=client_id,
        orderly=args.orderly,
        consume_from="earliest",
        rebalance_interval=1.0,
        offset_persist_interval=0.5,
        long_poll_timeout=2.0,
        consume_concurrency=1 if args.orderly else 8,
    )
    consumer.subscribe(args.topic)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    status = Path(args.out + ".assignment")
    await consumer.start()
    last: list[str] = []
    try:
        while not stop.is_set():
            now = [f"{q.broker_name}/{q.queue_id}" for q in consumer.assignment()]
            if now != last:
                tmp = status.with_suffix(".tmp")
                tmp.write_text(json.dumps(now))
                os.replace(tmp, status)
                last = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
    finally:
        await consumer.close()
        out.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--namesrv", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--client-id", required=True)
    p.add_argument("--orderly", action="store_true")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
