"""The data source ``apogee``: batch and streaming reads of topics (writes: :mod:`.sink`).

::

    from apogee.spark import ApogeeDataSource

    spark.dataSource.register(ApogeeDataSource)
    df = spark.read.format("apogee").option("namesrv", "ns:9876").option("topic", "Orders").load()

A batch read plans one partition per queue (and per ``maxOffsetsPerPartition`` offsets) from
``startingOffsets`` (earliest) to ``endingOffsets`` (latest), resolved once when planned. A
stream keeps, per micro-batch, one offset per topic, broker and queue in Spark's checkpoint: a
restarted query resumes where it stopped, new queues and brokers are read from their earliest
kept offset, and a broker that does not answer keeps its offsets until it is back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    EqualTo,
    Filter,
    In,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from apogee.common.errors import ApogeeError
from apogee.spark import planning
from apogee.spark.options import LATEST, Offsets, ReadOptions, offsets_from_json, offsets_to_json
from apogee.spark.queues import QueueRange, SyncQueues, read_range
from apogee.spark.schema import spark_schema

log = logging.getLogger(__name__)

#: the most offsets of one queue that one partition reads
DEFAULT_PARTITION_OFFSETS = 100_000


class RangePartition(InputPartition):
    """A :class:`QueueRange` as Spark's input partition."""

    def __init__(self, value: QueueRange) -> None:
        super().__init__(value)
        self.range = value


def _split(options: dict[str, str] | Any) -> int:
    value = str(options.get("maxOffsetsPerPartition") or DEFAULT_PARTITION_OFFSETS)
    if not value.isdigit() or int(value) < 1:
        from apogee.common.errors import InvalidArgumentError  # noqa: PLC0415

        raise InvalidArgumentError(
            field="maxOffsetsPerPartition", rule=f"must be an int >= 1, got {value!r}"
        )
    return int(value)


def _read(partition: InputPartition, opts: ReadOptions) -> Iterator[pa.RecordBatch]:
    # Spark plans one empty partition (``InputPartition(None)``) when there is nothing to read
    if not isinstance(partition, RangePartition):
        return iter(())
    return read_range(partition.range, opts)


class ApogeeDataSource(DataSource):
    """``spark.read.format("apogee")`` and friends; see the module's docstring."""

    @classmethod
    def name(cls) -> str:
        return "apogee"

    def schema(self) -> StructType:
        return spark_schema(str(self.options.get("includeProperties", "true")).lower() != "false")

    def reader(self, schema: StructType) -> DataSourceReader:
        opts = ReadOptions.parse(self.options, streaming=False)
        if str(self.options.get("filterPushdown", "false")).lower() == "true":
            return FilteringBatchReader(opts, _split(self.options))
        return BatchReader(opts, _split(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return StreamReader(ReadOptions.parse(self.options, streaming=True), _split(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from apogee.spark.sink import BatchWriter, WriteOptions  # noqa: PLC0415

        return BatchWriter(WriteOptions.parse(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from apogee.spark.sink import StreamWriter, WriteOptions  # noqa: PLC0415

        return StreamWriter(WriteOptions.parse(self.options), schema)


def _tag_filter(f: Filter) -> str | None:
    """The tag expression a filter on ``tags`` amounts to, if it is one the broker can apply."""
    if getattr(f, "attribute", None) != ("tags",):
        return None
    if isinstance(f, EqualTo) and isinstance(f.value, str) and "||" not in f.value:
        return f.value
    if isinstance(f, In) and f.value and all(isinstance(v, str) for v in f.value):
        return " || ".join(f.value)
    return None


class BatchReader(DataSourceReader):
    def __init__(self, opts: ReadOptions, split: int) -> None:
        self.opts = opts
        self.split = split

    def partitions(self) -> Sequence[InputPartition]:
        queues = SyncQueues(self.opts.namesrv, self.opts.timeout_s, self.opts.batch_size)
        try:
            mqs = planning.topic_queues(queues, self.opts.topics)
            bounds = {mq: queues.bounds(mq) for mq in mqs}
            start = planning.resolve(self.opts.starting, queues, bounds, missing=-2)
            end = planning.resolve(self.opts.ending, queues, bounds, missing=LATEST)
        finally:
            queues.close()
        for (t, b, q), s in planning.flat(start).items():
            e = planning.get(end, t, b, q)
            if e is not None and e < s:
                planning.put(end, t, b, q, s)
        return [RangePartition(r) for r in planning.ranges(start, end, self.split)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(partition, self.opts)


class FilteringBatchReader(BatchReader):
    """A batch reader that takes Spark's filters on ``tags`` to the broker (with the option
    ``filterPushdown=true``, which needs ``spark.sql.python.filterPushdown.enabled``: Spark
    refuses a Python source that takes filters while that is off)."""

    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:
        # The broker filters by tag; Spark still evaluates every filter after the scan, so a
        # filter pushed here only saves reading messages it would drop.
        for f in filters:
            expression = _tag_filter(f)
            if expression is not None and self.opts.tag_expression == "*":
                self.opts = replace(self.opts, tag_expression=expression)
            yield f


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are ``{"topic": {"broker": {"queue": offset}}}``, the next offset to read."""

    def __init__(self, opts: ReadOptions, split: int) -> None:
        self.opts = opts
        self.split = split
        self._queues: SyncQueues | None = None
        self._target: Offsets | None = None
        self._committed: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "opts": self.opts,
            "split": self.split,
            "_queues": None,
            "_target": None,
            "_committed": None,
        }

    def _client(self) -> SyncQueues:
        if self._queues is None:
            self._queues = SyncQueues(self.opts.namesrv, self.opts.timeout_s, self.opts.batch_size)
        return self._queues

    def initialOffset(self) -> dict[str, Any]:
        queues = self._client()
        bounds = planning.queue_bounds(queues, planning.topic_queues(queues, self.opts.topics))
        return offsets_to_json(planning.resolve(self.opts.starting, queues, bounds, missing=-2))

    def _latest(self, start: Offsets) -> Offsets:
        """Every queue's max offset; a queue whose broker did not answer keeps ``start``."""
        queues = self._client()
        try:
            mqs = planning.topic_queues(queues, self.opts.topics)
        except ApogeeError as err:
            log.warning(
                "no route for %s (%s); trying again at the next trigger", self.opts.topics, err
            )
            mqs = []
        bounds = planning.queue_bounds(queues, mqs)
        latest: Offsets = {}
        for (t, b, q), o in planning.flat(start).items():
            planning.put(latest, t, b, q, o)
        for mq, bound in bounds.items():
            s = planning.get(start, mq.topic, mq.broker_name, mq.queue_id)
            planning.put(
                latest, mq.topic, mq.broker_name, mq.queue_id, max(bound.max_offset, s or 0)
            )
        return latest

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_offsets_per_trigger
        return ReadAllAvailable() if n is None else ReadMaxRows(n)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest({})

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        # Spark asks for the next batch's end only once the batch that ended at ``start`` is
        # done (and at every trigger while idle), and calls commit() for a batch only when it
        # plans the next one with data: a stream that stops, or an AvailableNow query after its
        # last batch, would leave the group a batch behind. Committing ``start`` here too
        # keeps the group's lag true within a trigger.
        self._commit_group(start)
        begin = offsets_from_json(start)
        latest = self._latest(begin)
        if self._target is not None:
            capped: Offsets = {}
            for (t, b, q), o in planning.flat(latest).items():
                s = planning.get(begin, t, b, q)
                target = planning.get(self._target, t, b, q)
                if target is None:
                    if s is not None:
                        planning.put(capped, t, b, q, s)
                    continue
                planning.put(capped, t, b, q, max(min(o, target), s or 0))
            latest = capped
        if isinstance(limit, ReadMaxRows):
            latest = planning.limit_rows(begin, latest, limit.max_rows)
        return offsets_to_json(latest)

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return None

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        ranges = planning.ranges(offsets_from_json(start), offsets_from_json(end), self.split)
        return [RangePartition(r) for r in ranges]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(partition, self.opts)

    def commit(self, end: dict[str, Any]) -> None:
        self._commit_group(end)

    def _commit_group(self, done: dict[str, Any]) -> None:
        """``done`` (the end of a batch Spark finished) as the group's offsets, once."""
        if not self.opts.commit_group or done == self._committed:
            return
        from apogee.spark.commit import commit_group  # noqa: PLC0415

        commit_group(self.opts, offsets_from_json(done))
        self._committed = done

    def stop(self) -> None:
        if self._queues is not None:
            self._queues.close()
            self._queues = None
