"""Settings of one message store."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from apogee.common.configdoc import render_class
from apogee.common.errors import StoreConfigError

GiB = 1 << 30
MiB = 1 << 20


class FlushMode(enum.Enum):
    """When an append is acknowledged."""

    SYNC = "sync"
    """After its bytes are fsynced; concurrent appends share one fsync (group commit)."""
    ASYNC = "async"
    """Once written to the mapped file; a background loop fsyncs every ``flush_interval_s``."""


def _doc(default: Any, doc: str) -> Any:
    """A field with its description, for the generated configuration reference."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Every setting has a production default; tests shrink the file sizes."""

    commitlog_file_size: int = _doc(
        GiB, "Size of each CommitLog file in bytes. Fixed for the life of a store."
    )
    consume_queue_entries_per_file: int = _doc(
        300_000, "Entries (20 bytes each) per ConsumeQueue file. Fixed for the life of a store."
    )
    consume_queue_open_files: int = _doc(
        0,
        "Most ConsumeQueue files open at once; the least recently used closes when another "
        "must open. 0: a quarter of the process's open-file limit, between 64 and 4096.",
    )
    consume_queue_idle_close_s: float = _doc(
        60.0, "A ConsumeQueue file neither read nor written for this long is closed."
    )
    index_slots: int = _doc(5_000_000, "Hash slots per IndexFile.")
    index_entries_per_file: int = _doc(
        20_000_000, "Entries per IndexFile; a full file is followed by a new one."
    )
    flush_mode: FlushMode = field(
        default=FlushMode.ASYNC,
        metadata={
            "doc": "`sync`: an append returns once fsynced (group commit); `async`: once "
            "written, fsynced every `flush_interval_s`."
        },
    )
    flush_interval_s: float = _doc(
        0.5, "Period of the background flush of the CommitLog (async mode), queues and index."
    )
    sync_flush_timeout_s: float = _doc(
        5.0, "How long a sync-mode append waits for its fsync before FLUSH_TIMEOUT."
    )
    max_message_size: int = _doc(4 * MiB, "Largest message body accepted, in bytes.")
    max_properties_size: int = _doc(
        32_767, "Largest encoded properties (tags, keys and unique id included), in bytes."
    )
    max_topic_length: int = _doc(127, "Longest topic name, in characters.")
    max_queues_per_topic: int = _doc(1024, "Queue ids run from 0 to this minus one.")
    verify_crc_on_read: bool = _doc(
        True, "Check each record's CRC when it is read (recovery always checks)."
    )
    retention_hours: float = _doc(72.0, "CommitLog files last written longer ago are deleted.")
    retention_check_interval_s: float = _doc(10.0, "How often retention runs.")
    retention_delete_hours: tuple[int, ...] = _doc(
        tuple(range(24)),
        "Local hours at which expired files may be deleted (RocketMQ deletes at 04 only); a "
        "disk above the high-water mark is cleaned at any hour.",
    )
    disk_high_water_ratio: float = _doc(
        0.75, "Above this share of the disk in use, the oldest files go whatever their age."
    )
    files_deleted_per_round: int = _doc(10, "At most this many CommitLog files per round.")
    dispatch_backlog_max: int = _doc(
        4096, "Appended batches waiting for the dispatcher before appends wait too."
    )
    dispatch_inline_max: int = _doc(
        16,
        "An appended batch of at most this many records, finding the dispatcher idle, is "
        "indexed by the appending thread at once (lower latency for light traffic); 0 sends "
        "every batch to the dispatcher thread.",
    )
    recovery_verify_files_after_clean_stop: int = _doc(
        3, "After a clean stop, recovery checks this many of the newest CommitLog files."
    )

    def __post_init__(self) -> None:
        _min("commitlog_file_size", self.commitlog_file_size, 4096)
        _min("consume_queue_entries_per_file", self.consume_queue_entries_per_file, 16)
        _min("consume_queue_open_files", self.consume_queue_open_files, 0)
        if self.consume_queue_idle_close_s <= 0:
            raise StoreConfigError(field="consume_queue_idle_close_s", rule="must be positive")
        _min("index_slots", self.index_slots, 1)
        _min("index_entries_per_file", self.index_entries_per_file, 16)
        _min("max_message_size", self.max_message_size, 1)
        _min("max_queues_per_topic", self.max_queues_per_topic, 1)
        _min("dispatch_backlog_max", self.dispatch_backlog_max, 1)
        _min("files_deleted_per_round", self.files_deleted_per_round, 1)
        _min("dispatch_inline_max", self.dispatch_inline_max, 0)
        _min(
            "recovery_verify_files_after_clean_stop", self.recovery_verify_files_after_clean_stop, 1
        )
        if not 0 < self.max_topic_length <= 255:
            raise StoreConfigError(field="max_topic_length", rule="must be between 1 and 255")
        if not 0 < self.max_properties_size <= 65_535:
            raise StoreConfigError(field="max_properties_size", rule="must be between 1 and 65535")
        if self.flush_interval_s <= 0 or self.sync_flush_timeout_s <= 0:
            raise StoreConfigError(
                field="flush_interval_s/sync_flush_timeout_s", rule="must be positive"
            )
        if not 0 < self.disk_high_water_ratio <= 1:
            raise StoreConfigError(field="disk_high_water_ratio", rule="must be in (0, 1]")
        if self.retention_hours <= 0:
            raise StoreConfigError(field="retention_hours", rule="must be positive")
        if self.retention_check_interval_s <= 0:
            raise StoreConfigError(field="retention_check_interval_s", rule="must be positive")
        if any(not 0 <= h <= 23 for h in self.retention_delete_hours):
            raise StoreConfigError(field="retention_delete_hours", rule="hours are 0 to 23")
        # A record of the largest allowed size must fit in one file with room for the end marker.
        largest = self.max_message_size + self.max_properties_size + self.max_topic_length + 256
        if largest > self.commitlog_file_size:
            raise StoreConfigError(
                field="commitlog_file_size",
                rule=(
                    f"must hold the largest record ({largest} bytes with max_message_size "
                    f"{self.max_message_size}); raise it or lower max_message_size"
                ),
            )


def _min(name: str, value: int, least: int) -> None:
    if value < least:
        raise StoreConfigError(field=name, rule=f"must be at least {least}, got {value}")


def config_reference() -> str:
    """This package's section of docs/configuration.md."""
    return render_class(
        StoreConfig,
        "Store (`apogee.store.StoreConfig`)",
        "The broker's storage engine. Sizes are in bytes unless named otherwise.",
    )
