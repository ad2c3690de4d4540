"""Writing rows as messages: ``df.write.format("apogee")`` and ``writeStream.format("apogee")``.

Input columns (only ``body`` is required):

=================  ========================================  ===================================
column             type                                      what
=================  ========================================  ===================================
``topic``          string                                    the topic (else the option ``topic``)
``body``           binary or string                          the body (a string is sent as UTF-8)
``keys``           string or array<string>                   the message's keys
``tags``           string                                    its tag
``properties``     map<string,string>                        user properties
``sharding_key``   string                                    rows with one key go to one queue,
                                                             in row order (ordered messages)
=================  ========================================  ===================================

Exactly once on replay: every row gets an id made of the streaming query's id, the micro-batch,
the partition and the row's place in it (a batch write: a random id of the write instead of the
query and batch), sent as the property ``APOGEE_DEDUP_ID``. A broker that stored a message with
that id in the topic within its ``dedup_window_s`` drops another copy, so a micro-batch that
Spark runs again after a failure (or a task it retries) stores nothing twice. The queue of a
row is chosen from its id (or its ``sharding_key``), so a replayed row goes to the same broker
as before, where its id is known. This holds for inputs whose partitions hold the same rows in
the same order when run again (a stream read from ``apogee`` or Kafka, a file); ``dedup=false``
sends without ids (at least once).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, StringType, StructType

from apogee.client import Message, Producer
from apogee.common.errors import InvalidArgumentError
from apogee.spark.queues import process_loop

log = logging.getLogger(__name__)

#: the property a message's dedup id travels in (the broker's ``apogee_broker.core.send.dedup``)
DEDUP_PROPERTY: Final = "APOGEE_DEDUP_ID"
#: the local properties Spark sets on the tasks of a micro-batch
QUERY_ID_KEY: Final = "sql.streaming.queryId"
BATCH_ID_KEY: Final = "streaming.sql.batchId"
#: sends in flight at once per task
WINDOW: Final = 512

_KNOWN: Final = ("topic", "body", "keys", "tags", "properties", "sharding_key")


@dataclass(frozen=True, slots=True)
class WriteOptions:
    namesrv: str
    topic: str
    dedup: bool
    timeout_s: float

    @classmethod
    def parse(cls, options: Any) -> WriteOptions:
        namesrv = str(options.get("namesrv") or "").strip()
        if not namesrv:
            raise InvalidArgumentError(
                field="namesrv", rule="is required: the nameservers, host:port;host:port"
            )
        dedup = str(options.get("dedup", "true")).strip().lower()
        if dedup not in ("true", "false"):
            raise InvalidArgumentError(field="dedup", rule=f"must be true or false, got {dedup!r}")
        timeout = str(options.get("timeoutMs", "10000")).strip()
        if not timeout.isdigit() or int(timeout) < 1:
            raise InvalidArgumentError(
                field="timeoutMs", rule=f"must be an int >= 1, got {timeout!r}"
            )
        return cls(
            namesrv=namesrv,
            topic=str(options.get("topic") or "").strip(),
            dedup=dedup == "true",
            timeout_s=int(timeout) / 1000.0,
        )


def check_input(schema: StructType, opts: WriteOptions) -> None:
    names = set(schema.fieldNames())
    if "body" not in names:
        raise InvalidArgumentError(
            field="body", rule="a column body (binary or string) is required"
        )
    if not isinstance(schema["body"].dataType, BinaryType | StringType):
        raise InvalidArgumentError(
            field="body", rule=f"must be binary or string, got {schema['body'].dataType}"
        )
    if "topic" not in names and not opts.topic:
        raise InvalidArgumentError(
            field="topic", rule="give the option topic, or a column topic with each row's"
        )
    unknown = sorted(names - set(_KNOWN))
    if unknown:
        raise InvalidArgumentError(
            field="columns", rule=f"{unknown} are not among {list(_KNOWN)}; select what to send"
        )


@dataclass
class SentMessages(WriterCommitMessage):
    partition: int
    messages: int


def _message(row: dict[str, Any], default_topic: str, dedup_id: str) -> Message:
    body = row["body"]
    if isinstance(body, str):
        body = body.encode()
    keys = row.get("keys") or ()
    if isinstance(keys, str):
        keys = (keys,)
    props = dict(row.get("properties") or ())
    if dedup_id:
        props[DEDUP_PROPERTY] = dedup_id
    return Message(
        row.get("topic") or default_topic,
        bytes(body) if body is not None else b"",
        tags=row.get("tags") or "",
        keys=tuple(keys),
        properties=props,
    )


async def _send_all(opts: WriteOptions, batches: Iterator[pa.RecordBatch], id_prefix: str) -> int:
    sent = 0
    async with Producer(opts.namesrv, send_timeout=opts.timeout_s) as producer:
        pending: list[asyncio.Future[Any]] = []
        for batch in batches:
            rows = batch.to_pylist()
            for row in rows:
                dedup_id = f"{id_prefix}:{sent}" if opts.dedup else ""
                msg = _message(row, opts.topic, dedup_id)
                grouped = row.get("sharding_key")
                key = grouped or dedup_id
                if key:  # a dedup id only keeps a replayed row on its broker: not FIFO
                    sent_to = producer.send_ordered(msg, key, fifo=bool(grouped))
                    pending.append(asyncio.ensure_future(sent_to))
                else:
                    pending.append(asyncio.ensure_future(producer.send(msg)))
                sent += 1
                if len(pending) >= WINDOW:
                    await asyncio.gather(*pending)
                    pending = []
        await asyncio.gather(*pending)
    return sent


def _write(opts: WriteOptions, batches: Iterator[pa.RecordBatch], id_prefix: str) -> int:
    return process_loop().run(_send_all(opts, batches, id_prefix))


class BatchWriter(DataSourceArrowWriter):
    """``df.write.format("apogee")``: ids are ``<write id>:<partition>:<row>``, so a task Spark
    retries stores nothing twice."""

    def __init__(self, opts: WriteOptions, schema: StructType) -> None:
        check_input(schema, opts)
        self.opts = opts
        self.write_id = uuid.uuid4().hex

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else 0
        n = _write(self.opts, iterator, f"{self.write_id}:{partition}")
        return SentMessages(partition, n)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        total = sum(m.messages for m in messages if isinstance(m, SentMessages))
        log.info("write %s: %d messages sent", self.write_id, total)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        log.warning("write %s aborted; the messages sent stay sent", self.write_id)


class StreamWriter(DataSourceStreamArrowWriter):
    """``writeStream.format("apogee")``: ids are ``<query id>:<batch id>:<partition>:<row>``,
    so a micro-batch run again after a restart stores nothing twice."""

    def __init__(self, opts: WriteOptions, schema: StructType) -> None:
        check_input(schema, opts)
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else 0
        query = (ctx.getLocalProperty(QUERY_ID_KEY) if ctx is not None else None) or "query"
        batch = (ctx.getLocalProperty(BATCH_ID_KEY) if ctx is not None else None) or "0"
        n = _write(self.opts, iterator, f"{query}:{batch}:{partition}")
        return SentMessages(partition, n)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        total = sum(m.messages for m in messages if isinstance(m, SentMessages))
        log.info("micro-batch %d: %d messages sent", batchId, total)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning("micro-batch %d aborted; Spark runs it again (no copies stored)", batchId)
