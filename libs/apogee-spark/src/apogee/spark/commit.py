"""``commitGroup``: a stream's progress committed to the brokers as a consumer group's offsets,
so that ``apogee group describe`` shows the query's lag. Spark's checkpoint stays the source of
truth: the query never reads these offsets back, and a failed commit is logged, not raised.
"""

from __future__ import annotations

import asyncio
import logging

from apogee.client import AdminClient, MessageQueue
from apogee.common.errors import ApogeeError
from apogee.spark.options import Offsets, ReadOptions

log = logging.getLogger(__name__)

#: The client id the commits carry.
CLIENT_ID = "apogee-spark"


async def _commit(opts: ReadOptions, offsets: Offsets) -> None:
    queues = {
        MessageQueue(topic, broker, queue_id): offset
        for topic, brokers in offsets.items()
        for broker, by_queue in brokers.items()
        for queue_id, offset in by_queue.items()
    }
    async with AdminClient(opts.namesrv, timeout=opts.timeout_s) as admin:
        await admin.commit_offsets(opts.commit_group, queues, client_id=CLIENT_ID)


def commit_group(opts: ReadOptions, offsets: Offsets) -> None:
    """Commit ``offsets`` as ``opts.commit_group``'s, on every broker at once; what fails (a
    broker down) is logged, the brokers that answered keep their commit."""
    try:
        asyncio.run(_commit(opts, offsets))
    except ApogeeError as err:
        log.warning("committing group %s failed: %s", opts.commit_group, err)
