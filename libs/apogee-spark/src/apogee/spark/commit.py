"""``commitGroup``: a stream's progress committed to the brokers as a consumer group's offsets,
so that ``apogee group describe`` shows the query's lag. Spark's checkpoint stays the source of
truth: the query never reads these offsets back, and a failed commit is logged, not raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from apogee.client._rpc import ChannelPool, NameServerClient, parse_addresses, rpc
from apogee.client.consumer.rebalance import fetch_route
from apogee.common.errors import ApogeeError
from apogee.spark.options import Offsets, ReadOptions
from apogee.v1 import consumer_pb2

log = logging.getLogger(__name__)


async def _commit(opts: ReadOptions, offsets: Offsets) -> None:
    pool = ChannelPool()
    try:
        names = NameServerClient(parse_addresses(opts.namesrv), pool, opts.timeout_s)
        by_broker: dict[str, list[consumer_pb2.QueueOffset]] = defaultdict(list)
        addresses: dict[str, str] = {}
        for topic, brokers in offsets.items():
            route = await fetch_route(names, topic)
            addresses.update(route.addresses)
            for broker, queues in brokers.items():
                for queue_id, offset in queues.items():
                    by_broker[broker].append(
                        consumer_pb2.QueueOffset(topic=topic, queue_id=queue_id, offset=offset)
                    )
        for broker, entries in by_broker.items():
            address = addresses.get(broker)
            if address is None:
                continue
            request = consumer_pb2.CommitOffsetsRequest(
                group=opts.commit_group, client_id="apogee-spark", offsets=entries
            )
            try:
                await rpc(
                    f"broker {broker} ({address})",
                    pool.consumer(address).CommitOffsets(request, timeout=opts.timeout_s),
                )
            except ApogeeError as err:
                log.warning("committing group %s to %s failed: %s", opts.commit_group, broker, err)
    finally:
        await pool.close()


def commit_group(opts: ReadOptions, offsets: Offsets) -> None:
    try:
        asyncio.run(_commit(opts, offsets))
    except ApogeeError as err:
        log.warning("committing group %s failed: %s", opts.commit_group, err)
