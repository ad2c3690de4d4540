"""Reading a queue for consumers: records from an offset, on the event loop when they are hot.

Reads (:meth:`MessageStore.get_records`) of records near the end of the CommitLog (within
:data:`INLINE_READ_WINDOW` bytes of it: in the page cache, where consumers that keep up read) run
on the event loop; older ones run on a worker thread, since they may wait for the disk and the
event loop must not (RocketMQ tells hot reads from cold ones the same way). The hand-over to a
thread costs more than a hot read itself: measured here, it halved the messages pulled per
second. Pulls (:mod:`.pulling`) and push delivery streams (:mod:`.push`) both read this way.
"""

from __future__ import annotations

import asyncio
from typing import Final

from apogee.common.filtering import Selection
from apogee.store import GetStatus, MessageStore, RecordsResult

#: Reads of records at most this many bytes behind the end of the CommitLog run on the event loop.
INLINE_READ_WINDOW: Final = 256 << 20


def read_queue(
    store: MessageStore,
    topic: str,
    queue_id: int,
    offset: int,
    max_count: int,
    max_bytes: int,
    sel: Selection,
) -> RecordsResult:
    """Records of ``topic``/``queue_id`` from ``offset`` that ``sel`` selects; a queue nothing
    was ever stored in reads as empty at 0 and as overflowed past it."""
    got = store.get_records(topic, queue_id, offset, max_count, max_bytes, sel.tags, sel.sql)
    if got.status is GetStatus.NO_SUCH_QUEUE:  # nothing ever stored in this queue
        status = GetStatus.NO_NEW_MESSAGE if offset == 0 else GetStatus.OFFSET_OVERFLOW
        return RecordsResult(status, b"", 0, 0, 0, 0)
    return got


async def read_records(
    store: MessageStore,
    inline_window: int,
    topic: str,
    queue_id: int,
    offset: int,
    max_count: int,
    max_bytes: int,
    sel: Selection,
) -> RecordsResult:
    """:func:`read_queue` on the event loop when the records are at most ``inline_window``
    bytes behind the end of the CommitLog (in the page cache), on a worker thread otherwise,
    and always there with an SQL condition (evaluated on every message scanned, up to
    thousands, it would hold up the loop)."""
    behind = store.bytes_behind(topic, queue_id, offset)
    if sel.sql is None and (behind is None or behind <= inline_window):
        return read_queue(store, topic, queue_id, offset, max_count, max_bytes, sel)
    return await asyncio.to_thread(
        read_queue, store, topic, queue_id, offset, max_count, max_bytes, sel
    )
