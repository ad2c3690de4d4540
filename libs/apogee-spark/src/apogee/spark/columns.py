"""A pull's messages as one Arrow record batch of the data source's schema, built column by
column.

A partition's Python worker spends most of its time here, so nothing is done per message in
Python that Arrow can do per column: each message's properties section is taken as stored (one
bytes slice) and the sections are split into names and values by Arrow's string kernels; tags,
keys and the unique id are picked out of them by name, and the user's properties become the map
column without a dict per message. Only the header fields (already unpacked by the pull's
decoding) and the bodies are gathered message by message.

A batch whose properties do not split cleanly (a pair without its name separator: a record no
Apogee or RocketMQ producer writes) is built the slow way, message by message, so what a reader
sees never depends on the path taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from apogee.client import ReceivedMessage
from apogee.codec.properties import NAME_SEP, OWN_FIELDS, PROP_KEYS, PROP_SEP, PROP_TAGS
from apogee.codec.properties import PROP_UNIQ_KEY as PROP_UNIQ

_OWN = pa.array(sorted(OWN_FIELDS), pa.string())


def to_record_batch(
    messages: Sequence[ReceivedMessage], schema: pa.Schema, include_properties: bool
) -> pa.RecordBatch:
    """``messages`` (of one queue, as one pull returns them) as a batch of ``schema``."""
    n = len(messages)
    split = _split_properties([m.properties_bytes for m in messages])
    if split is None:
        return _row_by_row(messages, schema, include_properties)
    names, values, rows, offsets = split
    first = messages[0]
    columns: list[Any] = [
        pa.array([first.topic] * n, pa.string()),
        pa.array([first.broker_name] * n, pa.string()),
        pa.array([m.queue_id for m in messages], pa.int32()),
        pa.array([m.queue_offset for m in messages], pa.int64()),
        _pick(names, values, rows, n, PROP_UNIQ),
        _keys(_pick(names, values, rows, n, PROP_KEYS), schema.field("keys").type),
        _pick(names, values, rows, n, PROP_TAGS),
        pa.array([m.body for m in messages], pa.binary()),
    ]
    if include_properties:
        columns.append(_user_properties(names, values, offsets, schema.field("properties").type))
    columns += [
        _timestamps([m.born_timestamp_ms for m in messages]),
        _timestamps([m.store_timestamp_ms for m in messages]),
        pa.array([m.reconsume_times + 1 for m in messages], pa.int32()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _split_properties(
    sections: list[bytes],
) -> tuple[pa.Array, pa.Array, np.ndarray, np.ndarray] | None:
    """The properties of every message as flat ``names`` and ``values``, the message (row)
    each pair belongs to, and per message the index of its first pair (``n + 1`` offsets);
    None when a pair has no name separator, or a section is not UTF-8."""
    n = len(sections)
    ends = np.cumsum([len(s) for s in sections], dtype=np.int64)
    if n and ends[-1] >= 2**31:
        return None
    offsets = np.zeros(n + 1, dtype=np.int32)
    offsets[1:] = ends
    text = pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(b"".join(sections)))
    try:
        text.validate(full=True)
    except pa.ArrowInvalid:
        return None
    items = pc.split_pattern(text, PROP_SEP)
    flat = items.flatten()
    rows = np.asarray(pc.list_parent_indices(items))
    kept = np.asarray(pc.not_equal(flat, "")).astype(bool)
    if not kept.all():
        flat = flat.filter(pa.array(kept))
        rows = rows[kept]
    pairs = pc.split_pattern(flat, NAME_SEP, max_splits=1)
    if len(pairs) and pc.min(pc.list_value_length(pairs)).as_py() != 2:
        return None
    starts = np.searchsorted(rows, np.arange(n + 1), side="left").astype(np.int32)
    return pc.list_element(pairs, 0), pc.list_element(pairs, 1), rows, starts


def _pick(names: pa.Array, values: pa.Array, rows: np.ndarray, n: int, name: str) -> pa.Array:
    """Per message, the value of property ``name`` (null where it has none; the last one
    where it has several, as the per-message decoding keeps)."""
    at = np.asarray(pc.equal(names, name)).astype(bool)
    found = np.flatnonzero(at)
    where = np.full(n, -1, dtype=np.int64)
    where[rows[found]] = found
    missing = where < 0
    return values.take(pa.array(where, mask=missing)) if len(found) else pa.nulls(n, pa.string())


def _keys(joined: pa.Array, list_type: pa.DataType) -> pa.Array:
    """The space-separated keys as lists (an empty list for a message without keys)."""
    lists = pc.split_pattern(joined, " ")
    flat = lists.flatten()
    offsets = np.asarray(lists.offsets)  # a message without keys: a null, of length 0
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat, type=list_type)


def _user_properties(
    names: pa.Array, values: pa.Array, starts: np.ndarray, map_type: pa.DataType
) -> pa.Array:
    """The properties other than tags, keys and the unique id, as the map column."""
    own = np.asarray(pc.is_in(names, value_set=_OWN)).astype(bool)
    kept_before = np.zeros(len(names) + 1, dtype=np.int32)
    np.cumsum(~own, out=kept_before[1:])
    offsets = pa.array(kept_before[starts], pa.int32())
    keep = pa.array(~own)
    return pa.MapArray.from_arrays(offsets, names.filter(keep), values.filter(keep), type=map_type)


def _timestamps(ms: list[int]) -> pa.Array:
    micros = np.asarray(ms, dtype=np.int64) * 1000
    return pa.array(micros, pa.timestamp("us", tz="UTC"))


def _row_by_row(
    messages: Sequence[ReceivedMessage], schema: pa.Schema, include_properties: bool
) -> pa.RecordBatch:
    columns: list[list[Any]] = [
        [m.topic for m in messages],
        [m.broker_name for m in messages],
        [m.queue_id for m in messages],
        [m.queue_offset for m in messages],
        [m.unique_id or None for m in messages],
        [list(m.keys) for m in messages],
        [m.tags or None for m in messages],
        [m.body for m in messages],
    ]
    if include_properties:
        columns.append([list(m.properties.items()) for m in messages])
    columns += [
        [m.born_timestamp_ms * 1000 for m in messages],
        [m.store_timestamp_ms * 1000 for m in messages],
        [m.reconsume_times + 1 for m in messages],
    ]
    arrays = [pa.array(c, type=f.type) for c, f in zip(columns, schema, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
