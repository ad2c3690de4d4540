"""kill -9 at random moments: every acknowledged message survives and recovery leaves one store.

Each round starts ``crash_child.py`` as a real process on the same store directory. The child
appends a random mix of single messages and batches from 1-4 threads and prints one line per
message once ``append`` has returned (see its docstring for the line format). The parent reads the
lines on a thread and kills the child with SIGKILL either a random time after its first
acknowledgement, or as soon as it reports a CommitLog roll-over (its test-only hook pauses a few
milliseconds around creating the next file, before or after it, so the kill lands mid-roll).

After each kill the parent takes the lines still in the pipe, reopens the store and checks:

* recovery reports a crash, not a clean stop;
* the CommitLog walked record by record from its first offset (a blank end marker ends a file)
  ends exactly at ``recovery.last_valid_offset``, which is the log's end, with only zero bytes
  after it in its file;
* each queue's entries run from 0 to its max offset without a gap and point at exactly the
  records of that queue in the log, in log order; the table of next queue offsets agrees;
* every message ever acknowledged, in any round, reads back through its ConsumeQueue with the
  same bytes, unique id, physical offset, key and tag; ``by_unique_id`` finds a sample of them;
* appends after recovery continue each queue's offsets and read back.

The store keeps growing across rounds (64 KiB CommitLog files, 50-entry queue files, a small
index), so later rounds also recover over many files. The seed is printed; set
``APOGEE_CRASH_SEED`` to repeat a run's choices (kill timing itself stays real-time).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

import pytest

from apogee.codec import BLANK, BLANK_MAGIC, MESSAGE_MAGIC
from apogee.store import FlushMode, GetStatus, Message, MessageStore, StoreConfig, tag_hash

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHILD = Path(__file__).with_name("crash_child.py")

#: StoreConfig of the child and of the parent's reopen (flush mode added per test).
CONFIG: dict[str, Any] = {
    "commitlog_file_size": 64 * 1024,
    "max_message_size": 8 * 1024,
    "consume_queue_entries_per_file": 50,
    "index_slots": 64,
    "index_entries_per_file": 256,
    "flush_interval_s": 0.2,
}

#: Upper bounds of every wait on the child: its READY line and then the acknowledgement or
#: roll-over a round waits for must all come within START_TIMEOUT_S of its start; exiting after
#: the kill and closing its pipe within REAP_TIMEOUT_S.
START_TIMEOUT_S = 30.0
REAP_TIMEOUT_S = 10.0
#: The child exits on its own after this long, should the parent never kill it.
CHILD_LIFETIME_S = 120.0
#: A timed kill comes this long (at most) after the first acknowledgement.
MAX_KILL_DELAY_S = 0.35
UNIQUE_ID_SAMPLE = 40


class Acked(NamedTuple):
    """One acknowledged message, as the child reported it."""

    phys: int
    unique_id: str
    size: int
    sha256: str
    key: str
    tag: str | None


QueueKey = tuple[str, int]
MsgKey = tuple[str, int, int]


@dataclass
class RoundResult:
    acked: dict[MsgKey, Acked] = field(default_factory=dict)
    rolls_seen: int = 0
    killed_in_roll_window: bool = False


class LineReader:
    """Reads a pipe on a daemon thread so that every wait for a line has a deadline."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, args=(stream,), name="crash-reader", daemon=True
        )
        self._thread.start()

    def _run(self, stream: IO[bytes]) -> None:
        try:
            for line in iter(stream.readline, b""):
                self._lines.put(line)
        finally:
            self._lines.put(None)

    def next(self, deadline: float) -> bytes | None:
        """The next line (``None`` at end of stream); raises TimeoutError at ``deadline``."""
        try:
            return self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None

    def rest(self, deadline: float) -> list[bytes]:
        """Every line up to the end of the stream (the writer must be gone)."""
        out: list[bytes] = []
        while (line := self.next(deadline)) is not None:
            out.append(line)
        return out

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def _config(mode: FlushMode) -> StoreConfig:
    return StoreConfig(**CONFIG, flush_mode=mode)


def _open(path: Path, mode: FlushMode) -> MessageStore:
    # disk_usage pinned low: retention must not delete files on a crowded test machine
    return MessageStore.open(path, _config(mode), disk_usage=lambda: 0.0)


def _parse(lines: Iterable[bytes], res: RoundResult) -> None:
    for raw in lines:
        if not raw.endswith(b"\n"):
            continue  # cut by the kill: the message was acknowledged but we cannot tell which
        parts = raw.decode().split()
        kind = parts[0]
        if kind == "A":
            topic, qid, qoff, phys, uid, size, digest, key, tag = parts[1:]
            mkey = (topic, int(qid), int(qoff))
            assert mkey not in res.acked, f"queue offset acknowledged twice: {mkey}"
            res.acked[mkey] = Acked(
                int(phys), uid, int(size), digest, key, None if tag == "-" else tag
            )
        else:
            assert kind in ("READY", "ROLL", "ROLLED"), f"unexpected line from the child: {raw!r}"


def _run_child(
    path: Path, mode: FlushMode, kind: str, rng: random.Random, err_path: Path
) -> tuple[RoundResult, str]:
    """One round: start the child, kill it with SIGKILL at the chosen moment, collect its lines."""
    threads = rng.randint(1, 4)
    max_batch = rng.choice((2, 8, 24))
    spec = {
        "path": str(path),
        "config": CONFIG,
        "flush_mode": mode.value,
        "seed": rng.getrandbits(64),
        "threads": threads,
        "max_batch": max_batch,
        "roll_hook": kind.removeprefix("roll-") if kind.startswith("roll-") else "none",
        "lifetime_s": CHILD_LIFETIME_S,
    }
    kill_delay = rng.uniform(0.0, MAX_KILL_DELAY_S)
    kill_at_roll = rng.randint(1, 3)
    res = RoundResult()
    lines: list[bytes] = []
    with err_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    assert proc.stdout is not None
    reader = LineReader(proc.stdout)

    def child_failed(what: str) -> AssertionError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)  # it may be exiting: give it a moment to report its status
        if proc.poll() is None:
            proc.kill()
            proc.wait(REAP_TIMEOUT_S)
        return AssertionError(
            f"child {what} (exit status {proc.returncode}); its stderr:\n{err_path.read_text()}"
        )

    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        first = reader.next(deadline)
        if first is None or not first.startswith(b"READY "):
            raise child_failed(f"did not start: first line {first!r}")
        lines.append(first)
        kill_time = float("inf")
        killed_on = b""
        while time.monotonic() < kill_time:
            try:
                line = reader.next(min(deadline, kill_time))
            except TimeoutError:
                if time.monotonic() >= kill_time:
                    break  # the random moment has come
                waited = "a roll-over" if kind != "time" else "an acknowledgement"
                raise child_failed(f"sent no {waited} within {START_TIMEOUT_S}s") from None
            if line is None:
                raise child_failed("stopped before it was killed")
            lines.append(line)
            if kind == "time":
                if kill_time == float("inf") and line.startswith(b"A "):
                    kill_time = time.monotonic() + kill_delay
            elif line.startswith(b"ROLL ") and int(line.split()[1]) > 0:
                res.rolls_seen += 1
                if res.rolls_seen == kill_at_roll:
                    killed_on = line.replace(b"ROLL", b"ROLLED")
                    break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(REAP_TIMEOUT_S)
        if proc.returncode != -signal.SIGKILL:
            raise child_failed("was not ended by our SIGKILL")
        lines += reader.rest(time.monotonic() + REAP_TIMEOUT_S)
        if killed_on:
            res.killed_in_roll_window = killed_on not in lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(REAP_TIMEOUT_S)
        reader.join(REAP_TIMEOUT_S)
        proc.stdout.close()
    _parse(lines, res)
    return res, f"threads={threads} batch<={max_batch:2d}"


# -- checks on the reopened store ----------------------------------------------------------------


def _walk_log(store: MessageStore) -> dict[QueueKey, list[tuple[int, int, int]]]:
    """Walk the CommitLog record by record; returns each queue's (phys, size, tag code) in log
    order, checking queue offsets run 0, 1, 2, ... and the walk ends where recovery said."""
    cl = store.commitlog
    fsize = cl.files.file_size
    pos = cl.min_offset
    assert pos == 0, "nothing was deleted, the log must start at 0"
    per_queue: dict[QueueKey, list[tuple[int, int, int]]] = {}
    while (mf := cl.files.find(pos)) is not None:
        size, magic = BLANK.unpack(cl.read(pos, BLANK.size))
        if magic == BLANK_MAGIC:
            assert size == mf.start + fsize - pos, f"blank marker at {pos} has size {size}"
            pos = mf.start + fsize
            continue
        if magic != MESSAGE_MAGIC:
            break
        msg = store.message_at(pos)  # checks the CRC
        assert msg.phys_offset == pos, f"record at {pos} says it is at {msg.phys_offset}"
        assert msg.size == size, f"record at {pos}: size {msg.size}, header {size}"
        records = per_queue.setdefault((msg.topic, msg.queue_id), [])
        assert msg.queue_offset == len(records), (
            f"{msg.topic}/{msg.queue_id}: record at {pos} has queue offset {msg.queue_offset}, "
            f"expected {len(records)} (a gap or a repeat in the log)"
        )
        records.append((pos, size, tag_hash(msg.tags)))
        pos += size
    report = store.recovery
    assert pos == report.last_valid_offset, (
        f"walk ended at {pos}, recovery at {report.last_valid_offset}: {report.summary()}"
    )
    assert pos == cl.max_offset, f"walk ended at {pos}, the log at {cl.max_offset}"
    last = cl.files.last
    assert last is not None
    assert last.start <= pos <= last.start + fsize, (
        f"the walk ended at {pos}, outside the last file {last.path.name}"
    )
    tail = cl.read(pos, last.start + fsize - pos)
    assert tail.count(0) == len(tail), (
        f"{len(tail) - tail.count(0)} non-zero bytes after the end of the log at {pos}"
    )
    return per_queue


def _check_queues(
    store: MessageStore, per_queue: dict[QueueKey, list[tuple[int, int, int]]]
) -> None:
    maxes = {k: v for k, v in store.queue_max_offsets().items() if v}
    assert maxes == {k: len(v) for k, v in per_queue.items()}, "queue max offsets != log records"
    nexts = {k: v for k, v in store.commitlog.queue_offsets.items() if v}
    assert nexts == maxes, "next queue offsets do not continue the queues"
    for (topic, qid), records in per_queue.items():
        cq = store.consume_queue(topic, qid)
        assert cq is not None
        assert cq.min_offset == 0, f"{topic}/{qid} starts at {cq.min_offset}"
        entries = cq.entries(0, len(records))
        if entries != records:
            bad = next(i for i, (a, b) in enumerate(zip(entries, records, strict=False)) if a != b)
            raise AssertionError(
                f"{topic}/{qid}: {len(entries)} entries for {len(records)} records; first "
                f"difference at offset {bad}: entry {entries[bad]}, record {records[bad]}"
            )


def _check_acknowledged(store: MessageStore, expected: dict[MsgKey, Acked]) -> None:
    problems: list[str] = []
    for (topic, qid, qoff), a in expected.items():
        got = store.get(topic, qid, qoff, 1)
        if got.status is not GetStatus.FOUND or len(got.messages) != 1:
            problems.append(f"{topic}/{qid}@{qoff}: {got.status.name}, max {got.max_offset}")
            continue
        m = got.messages[0]
        seen = Acked(
            m.phys_offset,
            m.unique_id,
            len(m.body),
            hashlib.sha256(m.body).hexdigest(),
            m.keys[0] if m.keys else "",
            m.tags,
        )
        if m.queue_offset != qoff or seen != a:
            problems.append(f"{topic}/{qid}@{qoff}: read {seen} at {m.queue_offset}, acked {a}")
    assert not problems, (
        f"{len(problems)} of {len(expected)} acknowledged messages lost or changed, e.g.:\n"
        + "\n".join(problems[:10])
    )


def _check_unique_ids(store: MessageStore, acked: Iterable[Acked]) -> None:
    for a in acked:
        m = store.by_unique_id(a.unique_id)
        assert m is not None, f"by_unique_id({a.unique_id}) found nothing; acked at {a.phys}"
        assert m.phys_offset == a.phys, f"by_unique_id({a.unique_id}): {m.phys_offset}, {a}"
        assert hashlib.sha256(m.body).hexdigest() == a.sha256, f"{a.unique_id}: other bytes"


def _append_after_recovery(
    store: MessageStore, expected: dict[MsgKey, Acked], rng: random.Random
) -> None:
    topic, qid = f"Crash{rng.choice('ABC')}", rng.randrange(4)
    before = store.max_offset(topic, qid)
    msgs = [
        Message(topic, rng.randbytes(rng.randint(1, 6 * 1024)), queue_id=qid, keys=[f"p{i}"])
        for i in range(4)
    ]
    results = store.append(msgs[0]) + store.append(msgs[1:])
    assert [r.queue_offset for r in results] == list(range(before, before + 4))
    assert results[0].phys_offset >= store.recovery.last_valid_offset
    assert store.wait_dispatched(10.0), "appends after recovery were not dispatched"
    got = store.get(topic, qid, before, 4)
    assert got.status is GetStatus.FOUND
    assert [m.body for m in got.messages] == [m.body for m in msgs]
    for r, m in zip(results, msgs, strict=True):
        expected[(topic, qid, r.queue_offset)] = Acked(
            r.phys_offset,
            r.unique_id,
            len(m.body),
            hashlib.sha256(m.body).hexdigest(),
            m.keys[0],
            None,
        )


def _verify_after_crash(
    path: Path,
    mode: FlushMode,
    expected: dict[MsgKey, Acked],
    recent: list[Acked],
    rng: random.Random,
) -> str:
    store = _open(path, mode)
    try:
        report = store.recovery
        assert not report.clean_shutdown, f"a kill -9 reported as a clean stop: {report.summary()}"
        per_queue = _walk_log(store)
        _check_queues(store, per_queue)
        _check_acknowledged(store, expected)
        everything = list(expected.values())
        sample = rng.sample(everything, min(UNIQUE_ID_SAMPLE, len(everything)))
        _check_unique_ids(store, sample + rng.sample(recent, min(UNIQUE_ID_SAMPLE, len(recent))))
        _append_after_recovery(store, expected, rng)
        return report.summary()
    finally:
        store.close()


# -- the tests -----------------------------------------------------------------------------------


def _crash_rounds(
    tmp_path: Path, mode: FlushMode, timed: int, rolls_before: int, rolls_after: int
) -> None:
    """``timed`` kills at a random moment and ``rolls_*`` kills mid-roll-over, shuffled; the first
    round is always a timed one."""
    seed = int(os.environ.get("APOGEE_CRASH_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"\ncrash test ({mode.value}) seed {seed}: APOGEE_CRASH_SEED={seed} repeats its choices")
    rng = random.Random(seed)
    kinds = ["roll-before"] * rolls_before + ["roll-after"] * rolls_after + ["time"] * (timed - 1)
    rng.shuffle(kinds)
    kinds.insert(0, "time")
    path = tmp_path / "store"
    expected: dict[MsgKey, Acked] = {}
    in_window = 0
    t0 = time.monotonic()
    for i, kind in enumerate(kinds):
        t_round = time.monotonic()
        res, how = _run_child(path, mode, kind, rng, tmp_path / f"child-{i:02d}.stderr")
        assert kind != "time" or res.acked, "the child acknowledged nothing before the kill"
        for k, a in res.acked.items():
            assert k not in expected, (
                f"{k} acknowledged again in round {i}: {a} after {expected[k]}"
            )
        expected.update(res.acked)
        in_window += res.killed_in_roll_window
        summary = _verify_after_crash(path, mode, expected, list(res.acked.values()), rng)
        print(
            f"round {i:2d} {kind:11s} {how} acked {len(res.acked):4d} (total {len(expected):5d})"
            f"{' killed mid-roll' if res.killed_in_roll_window else ''} "
            f"[{time.monotonic() - t_round:.2f}s] {summary}"
        )
    # a clean reopen at the end sees the same store
    store = _open(path, mode)
    try:
        assert store.recovery.clean_shutdown
        _check_queues(store, _walk_log(store))
        _check_acknowledged(store, expected)
        _check_unique_ids(store, expected.values())
    finally:
        store.close()
    rolls = sum(k != "time" for k in kinds)
    print(
        f"{len(kinds)} kills ({in_window}/{rolls} inside a roll-over window) in "
        f"{time.monotonic() - t0:.1f}s; {len(expected)} acknowledged messages verified"
    )
    assert in_window > 0, "no kill landed inside a roll-over window"


def test_kill9_sync_flush_loses_no_acknowledged_message(tmp_path: Path) -> None:
    _crash_rounds(tmp_path, FlushMode.SYNC, timed=16, rolls_before=4, rolls_after=4)


def test_kill9_async_flush_recovers_a_consistent_store(tmp_path: Path) -> None:
    # The page cache survives a process kill, so with async flush nothing acknowledged is lost
    # either; the checks are the same.
    _crash_rounds(tmp_path, FlushMode.ASYNC, timed=5, rolls_before=2, rolls_after=2)
