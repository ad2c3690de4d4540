"""A client of the compose stack: create a topic, send messages to it and consume them all as a
consumer group, through the nameserver it is given and the addresses the brokers advertise.

The compose tests run it on the host (``await round_trip(...)``) and in a container on the
compose network (``python compose_client.py NAMESRV TOPIC GROUP COUNT``, with the SDK's source
on ``PYTHONPATH`` in a service image, which holds everything else the SDK needs); the latter
prints the summary as one JSON line. It imports nothing but the SDK and the standard library.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import TypedDict

from apogee.client import AdminClient, Message, Producer, PullConsumer, SendResult

#: seconds the whole round trip may take
DEADLINE_S = 180.0
BODY = b"x" * 100
#: messages in flight at once, and the seconds each may take (batching and retries included)
CHUNK = 1000
SEND_TIMEOUT_S = 15.0


class Summary(TypedDict):
    sent: int
    received: int
    missing: int
    brokers: list[str]
    send_seconds: float
    consume_seconds: float


async def round_trip(namesrv: str, topic: str, group: str, count: int) -> Summary:
    """Send ``count`` messages to ``topic`` (created with 4 queues on every broker) and consume
    them as ``group`` from the earliest offset until every one has arrived or the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    async with AdminClient(namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=4)
    start = time.monotonic()
    results: list[SendResult] = []
    async with Producer(namesrv, group=f"{group}-senders", send_timeout=SEND_TIMEOUT_S) as producer:
        for first in range(0, count, CHUNK):
            chunk = range(first, min(first + CHUNK, count))
            results += await asyncio.gather(
                *(producer.send_nowait(Message(topic, BODY, keys=f"k{i}")) for i in chunk)
            )
    sent = {r.message_id for r in results}
    send_seconds = time.monotonic() - start
    start = time.monotonic()
    seen: set[str] = set()
    async with PullConsumer(
        namesrv, group, consume_from="earliest", rebalance_interval=1.0, long_poll_timeout=1.0
    ) as consumer:
        consumer.subscribe(topic)
        await consumer.start()
        while not sent <= seen and time.monotonic() < deadline:
            seen.update(m.unique_id for m in await consumer.poll(timeout=1.0))
    return Summary(
        sent=len(sent),
        received=len(seen & sent),
        missing=len(sent - seen),
        brokers=sorted({r.broker_name for r in results}),
        send_seconds=round(send_seconds, 2),
        consume_seconds=round(time.monotonic() - start, 2),
    )


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: compose_client.py NAMESRV TOPIC GROUP COUNT", file=sys.stderr)
        return 2
    namesrv, topic, group, count = argv
    print(json.dumps(asyncio.run(round_trip(namesrv, topic, group, int(count)))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
