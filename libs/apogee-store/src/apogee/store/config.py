"""Settings of one message store."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from apogee.common.errors import StoreConfigError

GiB = 1 << 30
MiB = 1 << 20


class FlushMode(enum.Enum):
    """When an append is acknowledged."""

    SYNC = "sync"
    """After its bytes are fsynced; concurrent appends share one fsync (group commit)."""
    ASYNC = "async"
    """Once written to the mapped file; a background loop fsyncs every ``flush_interval_s``."""


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Every setting has a production default; tests shrink the file sizes."""

    commitlog_file_size: int = GiB
    consume_queue_entries_per_file: int = 300_000
    index_slots: int = 5_000_000
    index_entries_per_file: int = 20_000_000
    flush_mode: FlushMode = FlushMode.ASYNC
    flush_interval_s: float = 0.5
    sync_flush_timeout_s: float = 5.0
    max_message_size: int = 4 * MiB
    max_properties_size: int = 32_767
    max_topic_length: int = 127
    max_queues_per_topic: int = 1024
    verify_crc_on_read: bool = True
    retention_hours: float = 72.0
    retention_check_interval_s: float = 10.0
    retention_delete_hours: tuple[int, ...] = field(default_factory=lambda: tuple(range(24)))
    disk_high_water_ratio: float = 0.75
    files_deleted_per_round: int = 10
    dispatch_backlog_max: int = 4096
    recovery_verify_files_after_clean_stop: int = 3

    def __post_init__(self) -> None:
        _min("commitlog_file_size", self.commitlog_file_size, 4096)
        _min("consume_queue_entries_per_file", self.consume_queue_entries_per_file, 16)
        _min("index_slots", self.index_slots, 1)
        _min("index_entries_per_file", self.index_entries_per_file, 16)
        _min("max_message_size", self.max_message_size, 1)
        _min("max_queues_per_topic", self.max_queues_per_topic, 1)
        _min("dispatch_backlog_max", self.dispatch_backlog_max, 1)
        _min("files_deleted_per_round", self.files_deleted_per_round, 1)
        _min("recovery_verify_files_after_clean_stop", self.recovery_verify_files_after_clean_stop, 1)
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
