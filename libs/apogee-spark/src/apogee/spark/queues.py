"""The SDK's :class:`~apogee.client.QueueReader` for synchronous callers, and the reading of one
partition (one queue, one half-open offset range) as Arrow record batches.

Spark calls the data source from threads and processes of its own: the planning (and, for a
stream, the offsets) in a Python process beside the driver, the partitions in worker processes.
Nothing here is made before it is used there, so the objects Spark pickles carry options only;
:class:`SyncQueues` owns an event loop of its own and runs the reader's coroutines on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa  # type: ignore[import-untyped]

from apogee.client import MessageQueue, QueueBounds, QueueReader, ReadBatch
from apogee.common.errors import ApogeeError, OffsetDeletedError
from apogee.spark.columns import to_record_batch
from apogee.spark.options import EARLIEST, ReadOptions
from apogee.spark.schema import arrow_schema

log = logging.getLogger(__name__)
T = TypeVar("T")


class DataLossError(RuntimeError):
    """Messages a query was to read are gone (removed by retention, or lost by a broker), and
    ``failOnDataLoss`` is true."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"data loss on {what}: {detail}")


class LoopThread:
    """An event loop running on a daemon thread of its own; coroutines are handed to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="apogee-spark-loop", daemon=True
        )
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()


_loop: LoopThread | None = None
_loop_pid = 0
_loop_lock = threading.Lock()


def process_loop() -> LoopThread:
    """One event loop per process, kept while it lives: gRPC's asyncio layer keeps a poller
    bound to the first loop it ran on, so a worker that Spark reuses for many partitions must
    not start a new loop for each. It runs on a thread of its own, so that the next pull is on
    its way while the caller turns the last one into rows."""
    global _loop, _loop_pid  # noqa: PLW0603
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():
            _loop = LoopThread()
            _loop_pid = os.getpid()
        return _loop


class SyncQueues:
    """A :class:`QueueReader` run on the process's loop; :meth:`close` when done."""

    def __init__(self, namesrv: str, timeout_s: float, batch_size: int) -> None:
        self._loop = process_loop()
        self._reader = self.run(self._make(namesrv, timeout_s, batch_size))

    @staticmethod
    async def _make(namesrv: str, timeout_s: float, batch_size: int) -> QueueReader:
        return QueueReader(namesrv, timeout=timeout_s, batch_size=batch_size)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    def prefetch(
        self, queue: MessageQueue, offset: int, count: int, tags: str, sql: str
    ) -> concurrent.futures.Future[ReadBatch]:
        """A pull started now, to be taken with ``.result()`` later."""
        return self._loop.submit(
            self._reader.read_batch(queue, offset, count, tag_expression=tags, sql=sql)
        )

    def queues(self, topic: str) -> list[MessageQueue]:
        return self.run(self._reader.queues(topic))

    def bounds(self, queue: MessageQueue) -> QueueBounds:
        return self.run(self._reader.offsets(queue))

    def offset_for_timestamp(self, queue: MessageQueue, timestamp_ms: int) -> int:
        return self.run(self._reader.offset_for_timestamp(queue, timestamp_ms))

    def read_batch(
        self, queue: MessageQueue, offset: int, count: int, tags: str, sql: str
    ) -> ReadBatch:
        return self.run(self._reader.read_batch(queue, offset, count, tag_expression=tags, sql=sql))

    def close(self) -> None:
        self.run(self._reader.close())


def retrying(what: str, deadline_s: float, call: Any, *args: Any) -> Any:
    """``call(*args)``, tried again while it fails with a retriable error (a broker that was
    killed and is starting again) until ``deadline_s`` seconds have passed."""
    deadline = time.monotonic() + deadline_s
    pause = 0.1
    while True:
        try:
            return call(*args)
        except ApogeeError as err:
            if not err.retriable or time.monotonic() + pause > deadline:
                raise
            log.warning("%s: %s; trying again in %.1f s", what, err, pause)
        # a backoff between attempts at a broker that does not answer, bounded by the deadline
        time.sleep(pause)
        pause = min(pause * 2, 2.0)


@dataclass(frozen=True, slots=True)
class QueueRange:
    """One partition: offsets ``start <= offset < end`` of one queue (``start`` -2: the
    earliest kept, for a queue that appeared after the query started)."""

    topic: str
    broker: str
    queue_id: int
    start: int
    end: int

    @property
    def queue(self) -> MessageQueue:
        return MessageQueue(self.topic, self.broker, self.queue_id)


def read_range(part: QueueRange, opts: ReadOptions) -> Iterator[pa.RecordBatch]:
    """The messages of ``part`` as record batches of the data source's schema."""
    schema = arrow_schema(opts.include_properties)
    queues = SyncQueues(opts.namesrv, opts.timeout_s, opts.batch_size)
    where = f"{part.topic}/{part.broker}/{part.queue_id}"
    try:
        offset = part.start
        if offset == EARLIEST:
            bounds = retrying(where, opts.retry_s, queues.bounds, part.queue)
            offset = bounds.min_offset
        ahead: tuple[int, concurrent.futures.Future[ReadBatch]] | None = None
        while offset < part.end:
            count = min(opts.batch_size, part.end - offset)
            batch: ReadBatch | None = None
            if ahead is not None and ahead[0] == offset:
                try:
                    batch = ahead[1].result()
                except ApogeeError:
                    batch = None  # asked again below, where errors are handled
            ahead = None
            try:
                batch = batch or retrying(
                    where,
                    opts.retry_s,
                    queues.read_batch,
                    part.queue,
                    offset,
                    count,
                    opts.tag_expression,
                    opts.sql,
                )
            except OffsetDeletedError as err:
                earliest = int(err.details.get("earliest", offset + 1))
                if opts.fail_on_data_loss:
                    raise DataLossError(
                        what=where,
                        detail=f"offsets {offset} to {min(earliest, part.end)} were removed by "
                        "retention before they were read (failOnDataLoss=false skips them)",
                    ) from err
                log.warning(
                    "%s: offsets %d to %d were removed by retention before they were read; "
                    "skipping them (failOnDataLoss=false)",
                    where,
                    offset,
                    min(earliest, part.end),
                )
                offset = max(earliest, offset + 1)
                continue
            following = batch.next_offset
            if offset < following < part.end:
                ahead = (
                    following,
                    queues.prefetch(
                        part.queue,
                        following,
                        min(opts.batch_size, part.end - following),
                        opts.tag_expression,
                        opts.sql,
                    ),
                )
            rows = [m for m in batch.messages if m.queue_offset < part.end]
            if rows:
                yield to_record_batch(rows, schema, opts.include_properties)
            if batch.next_offset <= offset:
                if batch.max_offset <= offset:
                    raise DataLossError(
                        what=where,
                        detail=f"the queue ends at {batch.max_offset}, before offset {offset} "
                        f"that was planned to be read up to {part.end}",
                    )
                break
            offset = batch.next_offset
    finally:
        queues.close()
