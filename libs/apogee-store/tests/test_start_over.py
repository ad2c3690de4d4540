"""A follower whose log ends below its leader's first offset (retention deleted the rest there)
discards everything with ``start_over`` and copies the leader's log from that offset: every
queue then reads as on the leader, from each queue's first kept message, also after a reopen,
and after a crash at any step of the start over."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from apogee.common.errors import CorruptRecordError, InvalidArgumentError, OffsetDeletedError
from apogee.store import (
    AppendResult,
    FlushMode,
    GetStatus,
    Message,
    MessageStore,
    StoreConfig,
    StoredMessage,
)
from apogee.testkit.processes import kill_child_when_stopped
from apogee.testkit.store import OpenStore, dispatched

pytestmark = pytest.mark.unit

KiB = 1024
FILE_SIZE = 64 * KiB
ENTRIES_PER_FILE = 16
CONFIG = StoreConfig(
    commitlog_file_size=FILE_SIZE,
    max_message_size=8 * KiB,
    consume_queue_entries_per_file=ENTRIES_PER_FILE,
    index_slots=31,
    index_entries_per_file=128,
    files_deleted_per_round=3,
)
TOPICS = ("SoA", "SoB")
QUEUES = 3
ALL_QUEUES = [(t, q) for t in TOPICS for q in range(QUEUES)]
#: a queue written only at first: retention deletes every record of it on the leader
GONE = "Gone"


def fill(store: MessageStore, count: int, first: int = 0) -> list[AppendResult]:
    """``count`` messages over two topics and three queues, bodies of 0.5 to 6 KiB (64 KiB files
    roll every dozen or so)."""
    out: list[AppendResult] = []
    for i in range(first, first + count):
        out += store.append(
            Message(
                topic=TOPICS[i % 2],
                queue_id=i % QUEUES,
                body=bytes([i % 251]) * (512 + (i * 1543) % (6 * KiB)),
                keys=[f"k{i}"],
                tags=f"t{i % 2}",
            )
        )
    dispatched(store)
    return out


def replicate(leader: MessageStore, follower: MessageStore, max_bytes: int = 20 * KiB) -> None:
    while data := leader.read_log(follower.commitlog.end, max_bytes):
        follower.append_replica(follower.commitlog.end, data)
    dispatched(follower)


def log_files(store: MessageStore) -> dict[str, bytes]:
    return {mf.path.name: bytes(mf.mm) for mf in store.commitlog.files.files}


def queue_view(store: MessageStore) -> dict[tuple[str, int], tuple[int, int, list[StoredMessage]]]:
    """Per queue: min offset, max offset and every message a consumer reads from the min."""
    out = {}
    for t, q in ALL_QUEUES:
        lo = store.min_offset(t, q)
        got = store.get(t, q, lo, max_count=10_000)
        out[(t, q)] = (lo, store.max_offset(t, q), got.messages)
    return out


def retained_leader(open_store: OpenStore, root: Path, cfg: StoreConfig) -> MessageStore:
    """A leader whose retention deleted its first CommitLog files (the disk reads as full);
    queue ``Gone``/0 had five messages, all of them in those files."""
    leader = open_store(cfg, root=root, disk_usage=lambda: 1.0)
    leader.append([Message(topic=GONE, queue_id=0, body=b"early") for _ in range(5)])
    fill(leader, 90)
    deleted = leader.retention.run_once()
    assert deleted.commitlog_files == cfg.files_deleted_per_round
    assert leader.commitlog.min_offset == cfg.files_deleted_per_round * FILE_SIZE
    return leader


def assert_reads_as(follower: MessageStore, leader: MessageStore, tables: bool = True) -> None:
    """Every message of every queue is readable on the follower at the leader's offsets; with
    ``tables``, every queue's min and max offsets (those without records too) are the same."""
    view = queue_view(follower)
    assert view == queue_view(leader)
    for (t, q), (lo, hi, msgs) in view.items():
        assert [m.queue_offset for m in msgs] == list(range(lo, hi)), (t, q)
        assert msgs, (t, q)  # every queue still holds messages on the leader
        if lo > 0:  # a consumer below the first kept message is sent to it
            below = follower.get(t, q, 0)
            assert (below.status, below.next_offset) == (GetStatus.OFFSET_TOO_SMALL, lo)
    if tables:
        assert follower.queue_max_offsets() == leader.queue_max_offsets()
        assert follower.queue_min_offsets() == leader.queue_min_offsets()


@pytest.fixture(params=[FlushMode.ASYNC, FlushMode.SYNC], ids=["async", "sync"])
def cfg(request: pytest.FixtureRequest) -> StoreConfig:
    return dataclasses.replace(CONFIG, flush_mode=request.param)


def test_a_follower_behind_retention_starts_over_and_copies_the_rest(
    open_store: OpenStore, tmp_path: Path, cfg: StoreConfig
) -> None:
    leader = open_store(cfg, root=tmp_path / "leader", disk_usage=lambda: 1.0)
    follower = open_store(cfg, root=tmp_path / "follower")
    early = leader.append([Message(topic=GONE, queue_id=0, body=b"early") for _ in range(5)])
    early += fill(leader, 15)
    replicate(leader, follower)  # the follower had the start, then was down for long
    held = follower.commitlog.end
    fill(leader, 75, first=15)
    assert leader.retention.run_once().commitlog_files == cfg.files_deleted_per_round
    first = leader.commitlog.min_offset
    assert first == 3 * FILE_SIZE > held

    with pytest.raises(OffsetDeletedError) as caught:
        leader.read_log(held, 1 << 20)
    assert caught.value.details["earliest"] == first

    assert leader.log_start() == (first, leader.queue_min_offsets())
    starts = leader.queue_min_offsets()
    assert starts[(GONE, 0)] == leader.max_offset(GONE, 0) == 5  # none of its records is left
    assert follower.start_over(first, starts) == held

    assert follower.commitlog.min_offset == follower.commitlog.end == first
    assert follower.queue_max_offsets() == starts
    assert follower.by_unique_id(early[0].unique_id) is None
    assert not (tmp_path / "follower" / "start-over").exists()
    replicate(leader, follower)

    assert log_files(follower) == log_files(leader)
    assert_reads_as(follower, leader)
    # queues begin past 0, some inside a ConsumeQueue file (entries before them never written)
    mins = [follower.min_offset(t, q) for t, q in ALL_QUEUES]
    assert all(m > 0 for m in mins)
    assert any(m % ENTRIES_PER_FILE for m in mins)
    some = leader.get("SoA", 0, leader.min_offset("SoA", 0), 1).messages[0]
    assert follower.by_unique_id(some.unique_id) == some
    assert follower.by_key("SoA", some.keys[0]) == [some]

    follower.close()
    again = open_store(cfg, root=tmp_path / "follower")
    assert again.recovery.last_valid_offset == leader.commitlog.end
    assert_reads_as(again, leader)
    # further copies go on; so do the follower's own appends once it leads
    fill(leader, 20, first=90)
    replicate(leader, again)
    assert log_files(again) == log_files(leader)
    assert_reads_as(again, leader)
    [own] = again.append(Message(topic="SoB", queue_id=1, body=b"own"))
    assert own.phys_offset == leader.commitlog.end
    assert own.queue_offset == leader.max_offset("SoB", 1)
    [gone] = again.append(Message(topic=GONE, queue_id=0, body=b"late"))
    assert gone.queue_offset == 5  # the queue goes on where the leader's had got to


def test_a_replica_with_the_whole_log_follows_one_that_started_over(
    open_store: OpenStore, tmp_path: Path
) -> None:
    """After a change of leader, a replica that kept everything copies from one that started
    over: the queues it knows continue on both, none begins again at 0."""
    old = open_store(CONFIG, root=tmp_path / "old", disk_usage=lambda: 1.0)
    whole = open_store(CONFIG, root=tmp_path / "whole")
    old.append([Message(topic=GONE, queue_id=0, body=b"early") for _ in range(5)])
    fill(old, 90)
    replicate(old, whole)
    assert old.retention.run_once().commitlog_files == 3
    restarted = open_store(CONFIG, root=tmp_path / "restarted")
    restarted.start_over(old.commitlog.min_offset, old.queue_min_offsets())
    replicate(old, restarted)
    # the restarted replica leads now; a queue of the old leader's with no records left, too
    restarted.append(Message(topic=GONE, queue_id=0, body=b"late"))
    fill(restarted, 10, first=200)

    replicate(restarted, whole)

    assert whole.commitlog.end == restarted.commitlog.end
    late = whole.get(GONE, 0, 5).messages
    assert [(m.queue_offset, m.body) for m in late] == [(5, b"late")]
    for t, q in ALL_QUEUES:
        ours = restarted.get(t, q, restarted.min_offset(t, q), 10_000).messages
        assert whole.get(t, q, restarted.min_offset(t, q), 10_000).messages == ours


def test_a_queue_start_from_an_older_table_is_anchored_by_its_first_record(
    open_store: OpenStore, tmp_path: Path
) -> None:
    """The leader's table may be a retention round older than its log start: a queue's first
    record may then lie past its start; one below it is refused."""
    leader = retained_leader(open_store, tmp_path / "leader", CONFIG)
    first = leader.commitlog.min_offset
    older = {k: max(0, v - 2) for k, v in leader.queue_min_offsets().items()}
    follower = open_store(CONFIG, root=tmp_path / "follower")
    follower.start_over(first, older)
    replicate(leader, follower)
    assert_reads_as(follower, leader, tables=False)
    assert follower.max_offset(GONE, 0) == 3  # no record of its came to correct it

    newer = {k: v + 1 for k, v in leader.queue_min_offsets().items()}
    refusing = open_store(CONFIG, root=tmp_path / "refusing")
    refusing.start_over(first, newer)
    with pytest.raises(CorruptRecordError, match="does not continue its queue here"):
        refusing.append_replica(first, leader.read_log(first, 1 << 20))
    assert refusing.commitlog.end == first


def test_queues_rebuilt_from_the_log_begin_where_the_log_does(
    open_store: OpenStore, tmp_path: Path
) -> None:
    leader = retained_leader(open_store, tmp_path / "leader", CONFIG)
    follower = open_store(CONFIG, root=tmp_path / "follower")
    follower.start_over(leader.commitlog.min_offset, leader.queue_min_offsets())
    replicate(leader, follower)
    follower.close()
    shutil.rmtree(tmp_path / "follower" / "consumequeue")

    again = open_store(CONFIG, root=tmp_path / "follower")

    assert again.recovery.rebuilt_consume_queues
    assert_reads_as(again, leader)
    replicate(leader, again)  # nothing more to copy, and nothing refused
    fill(leader, 6, first=90)
    replicate(leader, again)
    assert_reads_as(again, leader)


def test_start_over_inside_its_own_log_leaves_nothing_of_it(
    open_store: OpenStore, tmp_path: Path, cfg: StoreConfig
) -> None:
    store = open_store(cfg, root=tmp_path / "store")
    results = fill(store, 50)
    end = store.commitlog.end
    assert end > 2 * FILE_SIZE

    assert store.start_over(FILE_SIZE) == end  # a file of that name held old records

    assert [mf.start for mf in store.commitlog.files.files] == [FILE_SIZE]
    assert bytes(store.commitlog.files.files[0].mm).count(0) == FILE_SIZE
    assert store.commitlog.end == FILE_SIZE
    assert all(store.by_unique_id(r.unique_id) is None for r in results[::5])
    assert store.get("SoA", 0, 0).status is GetStatus.NO_SUCH_QUEUE
    assert not any((tmp_path / "store" / "consumequeue").iterdir())
    assert not any((tmp_path / "store" / "index").iterdir())
    # a store of its own after that: its queues begin at 0 again
    [r] = store.append(Message(topic="SoA", queue_id=0, body=b"x"))
    assert (r.phys_offset, r.queue_offset) == (FILE_SIZE, 0)
    store.close()
    again = open_store(cfg, root=tmp_path / "store")
    assert again.get("SoA", 0, 0).messages[0].unique_id == r.unique_id
    assert again.commitlog.min_offset == FILE_SIZE


def test_start_over_refuses_an_offset_that_is_not_a_file_start(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store(CONFIG, root=tmp_path / "store")
    fill(store, 5)
    end = store.commitlog.end
    for offset in (-FILE_SIZE, FILE_SIZE + 1, 100):
        with pytest.raises(InvalidArgumentError) as caught:
            store.start_over(offset)
        assert str(caught.value) == (
            f"offset: must be a non-negative multiple of the CommitLog file size ({FILE_SIZE}): "
            f"where a file of the leader's log begins; got {offset}"
        )
    assert store.commitlog.end == end
    assert store.max_offset("SoA", 0) == 1
    assert not (tmp_path / "store" / "start-over").exists()


# -- a crash in the middle of a start over --------------------------------------------------------

STEPS = ["marked", "log removed", "queues removed", "log begun", "checkpoint written"]

CHILD = """
import json, sys, threading
import apogee.store.store as store_module
from apogee.store import MessageStore, StoreConfig, FlushMode

args = json.loads(sys.argv[1])
def hook(step):
    if step == args["stop_at"]:
        print("STOPPED " + step, flush=True)
        threading.Event().wait()  # killed here by the parent
store_module.START_OVER_HOOK = hook
cfg = StoreConfig(**{**args["config"], "flush_mode": FlushMode(args["flush_mode"])})
store = MessageStore.open(args["path"], cfg, start_retention=False)
print("OPEN", flush=True)
store.start_over(args["offset"], {(t, q): o for t, q, o in args["starts"]})
print("FINISHED", flush=True)
"""


def kill_child_at(
    path: Path, cfg: StoreConfig, offset: int, starts: dict[tuple[str, int], int], stop_at: str
) -> None:
    """Run a start over in a child process and kill it with SIGKILL at step ``stop_at``."""
    names = (
        "commitlog_file_size",
        "max_message_size",
        "consume_queue_entries_per_file",
        "index_slots",
        "index_entries_per_file",
    )
    args = {
        "path": str(path),
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k in names},
        "flush_mode": cfg.flush_mode.value,
        "offset": offset,
        "starts": [[t, q, o] for (t, q), o in starts.items()],
        "stop_at": stop_at,
    }
    kill_child_when_stopped(CHILD, args, f"{stop_at!r}")


@pytest.mark.integration
@pytest.mark.parametrize("stop_at", STEPS)
def test_a_start_over_killed_midway_is_done_again_at_open(
    open_store: OpenStore, tmp_path: Path, cfg: StoreConfig, stop_at: str
) -> None:
    leader = retained_leader(open_store, tmp_path / "leader", cfg)
    first = leader.commitlog.min_offset
    root = tmp_path / "victim"
    victim = open_store(cfg, root=root)
    old = fill(victim, 70, first=1000)  # a log of its own, with files past ``first``
    assert victim.commitlog.end > first + FILE_SIZE
    victim.close()

    starts = leader.queue_min_offsets()
    kill_child_at(root, cfg, first, starts, stop_at)
    assert (root / "start-over").exists()

    again = open_store(cfg, root=root)
    # empty, and beginning at ``first``: nothing of the old log, its queues or index is left
    report = again.recovery
    assert report.start_over_redone_at == first
    assert f"redid an interrupted start over at {first}" in report.summary()
    assert not report.clean_shutdown
    assert not (root / "start-over").exists()
    assert [mf.start for mf in again.commitlog.files.files] == [first]
    assert again.commitlog.min_offset == again.commitlog.end == first
    assert again.queue_max_offsets() == starts
    assert not (root / "queue-starts.next").exists()
    assert all(again.by_unique_id(r.unique_id) is None for r in old[::3])
    assert again.get("SoA", 0, 0).status is GetStatus.NO_SUCH_QUEUE

    replicate(leader, again)
    assert log_files(again) == log_files(leader)
    assert_reads_as(again, leader)
    again.close()
    third = open_store(cfg, root=root)
    assert third.recovery.start_over_redone_at is None
    assert_reads_as(third, leader)
