"""apogee.store: the broker's storage engine.

A pure library (no gRPC, no event loop): :class:`MessageStore` appends messages to the CommitLog,
a dispatcher builds ConsumeQueue and index entries from it, and recovery brings all three back to
one consistent state after a clean stop or a crash. See each module's docstring for its on-disk
format.
"""

from apogee.codec import Message, StoredMessage
from apogee.store.commitlog import AppendResult
from apogee.store.config import FlushMode, StoreConfig
from apogee.store.dispatcher import Watch
from apogee.store.epochs import EpochEntry, EpochFile, consistent_point
from apogee.store.reading import PropertyFilter
from apogee.store.records import tag_hash
from apogee.store.recovery import RecoveryReport
from apogee.store.store import GetResult, GetStatus, MessageStore, RecordsResult

__all__ = [
    "AppendResult",
    "EpochEntry",
    "EpochFile",
    "FlushMode",
    "GetResult",
    "GetStatus",
    "Message",
    "MessageStore",
    "PropertyFilter",
    "RecordsResult",
    "RecoveryReport",
    "StoreConfig",
    "StoredMessage",
    "Watch",
    "consistent_point",
    "tag_hash",
]
