"""A replica group's state as records in its CommitLog: one replication path for everything.

A lone broker keeps its topic configs in ``topics.json``, its consumer offsets in
``consumerOffset.json``, the schedule service's progress in ``scheduleProgress.json`` and the
transaction checker's in ``transactionProgress.json``. A replica group's leader writes each of
them as it always did, and also appends the same JSON, whole, as a record of the system topic
``APOGEE_SYS_STATE`` (queue 0, property ``APOGEE_STATE`` naming the kind): at every change of
the topic table, at every persistence of the offsets, and at every progress the schedule service
or the checker commits (their commit is answered once the record is replicated). The records
travel to the followers with the messages and are acknowledged like them, so a new leader holds
every snapshot the group acknowledged
(RocketMQ #4771 traces failover bugs to state with a replication path of its own; #1094 to
stale offsets taking over after one).

Followers turn the records back into the files (:class:`StateApplier`): after each copy from
the leader, the newest snapshot of each kind read since the last time is written to its file,
and ``state.applied`` remembers how far the records were read. A leader does the same at the
start of its term, before it loads the files. The files are caches: a replica whose log was cut
below ``state.applied`` reads the records again from the start, so a snapshot it holds no more
cannot outlive the cut.

Snapshots are whole, not deltas: the last one is the state, whatever came before (and whatever
retention removed). Offsets committed since the last persistence (``offset_persist_interval_s``)
are not in any snapshot: after a failure of the leader the group consumes them again
(at-least-once, as after a restart of a lone broker); a handoff persists them first. The POP
journal and the recalled delay messages (``recalled.log``) are not replicated yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from apogee.common.errors import ApogeeError, InternalError, NotLeaderError
from apogee.common.topics import STATE_TOPIC
from apogee.store import GetStatus, Message, MessageStore
from apogee.store.metadata import read_json, write_json_atomic
from apogee_broker.core.consume.offsets import FILE_NAME as OFFSETS_FILE
from apogee_broker.core.schedule.progress import PROGRESS_FILE as SCHEDULE_FILE
from apogee_broker.core.storage.writer import StoreWriter
from apogee_broker.core.topics import FILE_NAME as TOPICS_FILE
from apogee_broker.core.txn.state import PROGRESS_FILE as TRANSACTIONS_FILE

log = logging.getLogger(__name__)

#: The property naming what a state record holds.
PROP_STATE_KIND: Final = "APOGEE_STATE"
TOPICS: Final = "topics"
OFFSETS: Final = "offsets"
SCHEDULE: Final = "schedule"
TRANSACTIONS: Final = "transactions"
#: Each kind of state and the file it is the content of.
FILES: Final = {
    TOPICS: TOPICS_FILE,
    OFFSETS: OFFSETS_FILE,
    SCHEDULE: SCHEDULE_FILE,
    TRANSACTIONS: TRANSACTIONS_FILE,
}
APPLIED_FILE: Final = "state.applied"
_READ_BATCH: Final = 64


class StateLog:
    """The leader's side: appends snapshots (through the broker's writer, so they wait for the
    in-sync set like any message)."""

    def __init__(self, writer: StoreWriter) -> None:
        self.writer = writer
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self._pending: dict[str, Callable[[], dict[str, Any]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def write(self, kind: str, snapshot: dict[str, Any]) -> None:
        """Append ``snapshot`` of ``kind``; raises the writer's error when it is not stored
        and acknowledged."""
        body = json.dumps(snapshot, sort_keys=True, separators=(",", ":")).encode()
        msg = Message(STATE_TOPIC, body, queue_id=0, properties={PROP_STATE_KIND: kind})
        async with self._lock:
            (outcome,) = await self.writer.append_internal([msg])
        if outcome.error is not None:
            raise outcome.error

    def changed(self, kind: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        """``kind`` changed: append its snapshot soon (from any thread). Changes that come
        while one is being appended are written as one, the newest."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if not on_loop:
            self._loop.call_soon_threadsafe(self.changed, kind, snapshot)
            return
        first = kind not in self._pending
        self._pending[kind] = snapshot
        if first:
            task = self._loop.create_task(self._flush(kind))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _flush(self, kind: str) -> None:
        for attempt in range(50):
            snapshot = self._pending.get(kind)
            if snapshot is None:
                return
            try:
                await self.write(kind, snapshot())
            except NotLeaderError:
                self._pending.pop(kind, None)
                return  # the term ended: the next leader writes its own
            except ApogeeError as exc:
                log.warning(
                    "the %s snapshot was not replicated (attempt %d): %s", kind, attempt, exc
                )
                await asyncio.sleep(0.2)  # a pause before the next attempt, not a wait for state
                continue
            if self._pending.get(kind) is snapshot:
                del self._pending[kind]
                return
        log.error("the %s snapshot could not be replicated; the next change writes it", kind)
        self._pending.pop(kind, None)

    async def close(self) -> None:
        """Stop appending (the term ends); what is pending is written by the next term's
        first snapshot."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._pending.clear()

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until the pending snapshots are appended."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


class StateApplier:
    """Brings ``topics.json`` and ``consumerOffset.json`` of ``data_dir`` up to the state
    records of ``store`` (see the module docstring). Runs on a worker thread."""

    def __init__(self, store: MessageStore, data_dir: Path) -> None:
        self.store = store
        self.dir = Path(data_dir)
        self._applied: int | None = None

    def _read_applied(self) -> int:
        if self._applied is None:
            try:
                data = read_json(self.dir / APPLIED_FILE)
                self._applied = int(data["offset"]) if isinstance(data, dict) else 0
            except (ApogeeError, KeyError, TypeError, ValueError) as exc:
                log.warning("%s is unreadable (%s): reading every state record", APPLIED_FILE, exc)
                self._applied = 0
        return self._applied

    def behind(self) -> bool:
        """Whether state records arrived since the last :meth:`catch_up` (cheap: one look at
        the state queue's end, fit for the event loop)."""
        return self._applied is None or self.store.max_offset(STATE_TOPIC, 0) != self._applied

    def catch_up(self) -> int:
        """Apply the records written since the last call; returns how many files it wrote."""
        applied = self._read_applied()
        end = self.store.max_offset(STATE_TOPIC, 0)
        if end == applied:
            return 0
        if end < applied:  # the log was cut under the files: read it all again
            applied = 0
        newest: dict[str, bytes] = {}
        offset = applied
        while offset < end:
            got = self.store.get(STATE_TOPIC, 0, offset, _READ_BATCH)
            if got.status is GetStatus.OFFSET_TOO_SMALL:
                offset = got.next_offset  # removed by retention: newer snapshots follow
                continue
            if got.status is not GetStatus.FOUND:
                break
            for m in got.messages:
                kind = (m.properties or {}).get(PROP_STATE_KIND, "")
                if kind in FILES:
                    newest[kind] = m.body
            offset = got.next_offset
        for kind, body in newest.items():
            try:
                write_json_atomic(self.dir / FILES[kind], json.loads(body))
            except ValueError as exc:
                raise InternalError(detail=f"a {kind} state record is not JSON: {exc}") from exc
        write_json_atomic(self.dir / APPLIED_FILE, {"offset": offset})
        self._applied = offset
        if newest:
            log.info(
                "state records read to offset %d: %s written", offset, ", ".join(sorted(newest))
            )
        return len(newest)
