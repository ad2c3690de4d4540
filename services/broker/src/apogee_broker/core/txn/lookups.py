"""Reading a transaction's records back from the store; every function here runs on a worker
thread (each may wait for the dispatcher, and read the disk).

- :func:`half_at`: the half copy at an offset of the half queue (what an end by offset and a
  check name);
- :func:`copies_by_id`: every copy of a transaction, by its id (an end by id);
- :func:`decision_by_ops` and :func:`closed_by_ops`: a decision or a closed copy older than what
  the broker remembers (:mod:`.state`), from the op records, found through the IndexFile by the
  keys each carries (:mod:`.records`);
- :func:`find_committed`: where a commit decided before a restart stored its message.
"""

from __future__ import annotations

import logging
from typing import Final

from apogee.codec import StoredMessage
from apogee.common.errors import (
    ApogeeError,
    CorruptRecordError,
    InvalidArgumentError,
    OffsetDeletedError,
)
from apogee.common.topics import TRANS_CHECK_MAX_TIME_TOPIC, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC
from apogee.store import GetStatus, MessageStore
from apogee_broker.core.storage.lookup import DISPATCH_WAIT_S
from apogee_broker.core.txn.records import copy_key, parse_op
from apogee_broker.core.txn.state import Decided, decision_of

log = logging.getLogger(__name__)

#: Most copies of one transaction looked up by its id (each check makes one).
MAX_COPIES: Final = 64


def half_at(store: MessageStore, broker_name: str, offset: int) -> StoredMessage | None:
    """The copy at ``offset`` of the half queue; None when it was removed by retention or
    cannot be read; INVALID_ARGUMENT beyond the end of the queue."""
    if offset >= store.max_offset(TRANS_HALF_TOPIC, 0):
        store.wait_dispatched(DISPATCH_WAIT_S)
    high = store.max_offset(TRANS_HALF_TOPIC, 0)
    if offset >= high:
        raise InvalidArgumentError(
            field="half_offset",
            rule=f"{offset} is beyond the end of {TRANS_HALF_TOPIC} on broker "
            f"{broker_name} (its max offset is {high})",
        )
    try:
        got = store.get(TRANS_HALF_TOPIC, 0, offset, 1)
    except (CorruptRecordError, OffsetDeletedError) as exc:
        log.warning("the half at offset %d cannot be read: %s", offset, exc)
        return None
    if got.status is GetStatus.FOUND and got.messages:
        copy = got.messages[0]
        if copy.queue_offset == offset:
            return copy
    return None


def halves_at(
    store: MessageStore, broker_name: str, offsets: list[int]
) -> list[StoredMessage | ApogeeError | None]:
    """:func:`half_at` of each offset (one pass): the copy, None when it is gone, or the error
    that names why the offset is wrong."""
    found: list[StoredMessage | ApogeeError | None] = []
    for offset in offsets:
        try:
            found.append(half_at(store, broker_name, offset))
        except ApogeeError as err:
            found.append(err)
    return found


def copies_by_id(store: MessageStore, unique_id: str) -> list[StoredMessage]:
    """Every copy of transaction ``unique_id`` still kept (in the half queue and in
    TRANS_CHECK_MAX_TIME_TOPIC), newest first."""
    store.wait_dispatched(DISPATCH_WAIT_S)
    found = store.all_by_unique_id(unique_id, MAX_COPIES)
    # newest first, each record once (recovery may have indexed a record twice)
    copies = {
        m.phys_offset: m for m in found if m.topic in (TRANS_HALF_TOPIC, TRANS_CHECK_MAX_TIME_TOPIC)
    }
    return sorted(copies.values(), key=lambda m: m.phys_offset, reverse=True)


def decision_by_ops(store: MessageStore, unique_id: str) -> Decided | None:
    store.wait_dispatched(DISPATCH_WAIT_S)
    found = store.by_key(TRANS_OP_HALF_TOPIC, unique_id, max_count=MAX_COPIES)
    return decision_of([parse_op(m) for m in found], unique_id)


def closed_by_ops(store: MessageStore, half_offset: int) -> bool:
    store.wait_dispatched(DISPATCH_WAIT_S)
    found = store.by_key(TRANS_OP_HALF_TOPIC, copy_key(half_offset), max_count=8)
    return any(parse_op(m).half_offset == half_offset for m in found)


def find_committed(store: MessageStore, unique_id: str, decided: Decided) -> None:
    """Where a commit decided before the restart stored its message (when still kept): set in
    ``decided``."""
    store.wait_dispatched(DISPATCH_WAIT_S)
    for m in store.all_by_unique_id(unique_id, MAX_COPIES):
        if m.topic == decided.topic:
            decided.queue_id, decided.queue_offset = m.queue_id, m.queue_offset
            return
