"""The data source's options, read once and checked with errors that name the option.

Offsets travel as JSON, per topic, broker and queue, as Spark's Kafka source has them per topic
and partition::

    {"Orders": {"broker-a": {"0": 120, "1": 98}, "broker-b": {"0": 131}}}

In ``startingOffsets`` / ``endingOffsets`` an offset may also be ``-2`` (the earliest kept) or
``-1`` (the end of the queue); a queue that such a JSON does not name starts at the earliest
(``startingOffsets``) or ends at the latest (``endingOffsets``). The other forms are
``earliest``, ``latest`` and a time in milliseconds since the epoch (the first message stored at
or after it, on every queue).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from apogee.common.errors import InvalidArgumentError

EARLIEST: Final = -2
LATEST: Final = -1

#: topic -> broker -> queue id -> offset
Offsets = dict[str, dict[str, dict[int, int]]]


@dataclass(frozen=True, slots=True)
class OffsetSpec:
    """Where to start or end: ``kind`` is ``earliest``, ``latest``, ``timestamp`` or ``json``."""

    kind: str
    timestamp_ms: int = 0
    offsets: tuple[tuple[str, str, int, int], ...] = ()

    def for_queue(self, topic: str, broker: str, queue_id: int, default: int) -> int | None:
        """The JSON's offset for one queue (``default`` when it names none); ``None`` for the
        other kinds."""
        if self.kind != "json":
            return None
        for t, b, q, o in self.offsets:
            if (t, b, q) == (topic, broker, queue_id):
                return o
        return default


def parse_offset_spec(option: str, value: str, topics: tuple[str, ...]) -> OffsetSpec:
    text = value.strip()
    if text.lower() in ("earliest", "latest"):
        return OffsetSpec(text.lower())
    if text.isdigit():
        return OffsetSpec("timestamp", timestamp_ms=int(text))
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise InvalidArgumentError(
            field=option,
            rule="must be earliest, latest, a time in ms since the epoch, or JSON "
            f'{{"topic": {{"broker": {{"queue": offset}}}}}}, got {value!r}',
        )
    rows: list[tuple[str, str, int, int]] = []
    for topic, brokers in doc.items():
        if topic not in topics:
            raise InvalidArgumentError(
                field=option, rule=f"names topic {topic!r}, which is not among {list(topics)}"
            )
        if not isinstance(brokers, dict):
            raise InvalidArgumentError(field=option, rule=f"{topic!r} must map brokers to queues")
        for broker, queues in brokers.items():
            if not isinstance(queues, dict):
                raise InvalidArgumentError(
                    field=option, rule=f"{topic}/{broker} must map queue ids to offsets"
                )
            for queue, offset in queues.items():
                if not str(queue).isdigit() or not isinstance(offset, int) or offset < EARLIEST:
                    raise InvalidArgumentError(
                        field=option,
                        rule=f"{topic}/{broker}/{queue}: queue ids are ints >= 0 and offsets "
                        f"ints >= -2 (-2 earliest, -1 latest), got {offset!r}",
                    )
                rows.append((topic, str(broker), int(queue), offset))
    return OffsetSpec("json", offsets=tuple(rows))


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    value = options.get(name)
    if value is None:
        return default
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise InvalidArgumentError(field=name, rule=f"must be true or false, got {value!r}")
    return text == "true"


def _positive_int(options: Mapping[str, str], name: str) -> int | None:
    value = options.get(name)
    if value is None:
        return None
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise InvalidArgumentError(field=name, rule=f"must be an int >= 1, got {value!r}")
    return int(text)


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """What a read needs; pickled to the executors with the partitions' reader."""

    namesrv: str
    topics: tuple[str, ...]
    starting: OffsetSpec
    ending: OffsetSpec
    max_offsets_per_trigger: int | None
    fail_on_data_loss: bool
    include_properties: bool
    tag_expression: str
    sql: str
    batch_size: int
    timeout_s: float
    #: how long a partition keeps retrying a broker that does not answer
    retry_s: float
    commit_group: str

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> ReadOptions:
        namesrv = str(options.get("namesrv") or "").strip()
        if not namesrv:
            raise InvalidArgumentError(
                field="namesrv", rule="is required: the nameservers, host:port;host:port"
            )
        topics = tuple(t.strip() for t in str(options.get("topic") or "").split(",") if t.strip())
        if not topics:
            raise InvalidArgumentError(
                field="topic", rule="is required: one topic, or several separated by commas"
            )
        default_start = "latest" if streaming else "earliest"
        starting = parse_offset_spec(
            "startingOffsets", str(options.get("startingOffsets", default_start)), topics
        )
        if streaming and "endingOffsets" in options:
            raise InvalidArgumentError(
                field="endingOffsets", rule="applies to batch reads only, not to streams"
            )
        ending = parse_offset_spec(
            "endingOffsets", str(options.get("endingOffsets", "latest")), topics
        )
        if ending.kind == "earliest":
            raise InvalidArgumentError(field="endingOffsets", rule="cannot be earliest")
        batch_size = _positive_int(options, "fetchSize") or 1024
        if batch_size > 1024:
            raise InvalidArgumentError(field="fetchSize", rule=f"must be <= 1024, got {batch_size}")
        return cls(
            namesrv=namesrv,
            topics=topics,
            starting=starting,
            ending=ending,
            max_offsets_per_trigger=_positive_int(options, "maxOffsetsPerTrigger"),
            fail_on_data_loss=_bool(options, "failOnDataLoss", True),
            include_properties=_bool(options, "includeProperties", True),
            tag_expression=str(options.get("tagFilter") or "*").strip() or "*",
            sql=str(options.get("sqlFilter") or "").strip(),
            batch_size=batch_size,
            timeout_s=float(_positive_int(options, "timeoutMs") or 5000) / 1000.0,
            retry_s=float(_positive_int(options, "retryTimeoutMs") or 120_000) / 1000.0,
            commit_group=str(options.get("commitGroup") or "").strip(),
        )


def offsets_to_json(offsets: Offsets) -> dict[str, dict[str, dict[str, int]]]:
    """Offsets as Spark keeps them in its checkpoint (JSON keys are strings)."""
    return {
        t: {b: {str(q): o for q, o in sorted(qs.items())} for b, qs in sorted(bs.items())}
        for t, bs in sorted(offsets.items())
    }


def offsets_from_json(doc: Mapping[str, object]) -> Offsets:
    out: Offsets = {}
    for topic, brokers in doc.items():
        assert isinstance(brokers, dict)
        for broker, queues in brokers.items():
            assert isinstance(queues, dict)
            for queue, offset in queues.items():
                out.setdefault(topic, {}).setdefault(broker, {})[int(queue)] = int(offset)
    return out
