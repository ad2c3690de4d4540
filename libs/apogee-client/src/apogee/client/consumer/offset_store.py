"""Where a consumer keeps how far it got in each queue (RocketMQ's OffsetStore).

An offset is the queue offset of the next message to consume. The consumer keeps offsets in
memory as listeners finish messages (:meth:`OffsetStore.update`, cheap, many times a second)
and persists them every few seconds, at rebalance and at close (:meth:`OffsetStore.persist_all`).
Two stores:

- :class:`RemoteOffsetStore` (clustering): offsets live at the brokers, per group, so any member
  of the group can continue a queue where another left it. Persisting sends one
  ``Consumer.CommitOffsets`` per broker with the queues of that broker whose offset moved since
  its last acknowledged commit (every queue at least once a minute); loading asks
  ``Consumer.QueryOffsets``. A broker that cannot be reached is logged and tried again at the
  next persist; persisting never raises.
- :class:`LocalOffsetStore` (broadcasting): every consumer reads every queue, so offsets are its
  own and live in one JSON file (:func:`default_offset_dir`), written atomically: temp file,
  fsync, rename, the previous file kept as ``.bak``
  (:func:`apogee.common.files.write_json_atomic`). A damaged file is reported with its path
  and read from its backup; when both are damaged, the file is moved aside and the consumer
  starts as if it had no offsets.

Both stores keep a queue's commits in order: one commit per broker (one write of the file) at a
time, with the offsets held when it goes out, and a persist that is cancelled (the periodic
commit stopping) lets the commit it started run to its end before the next one goes. A broker
applies whatever arrives last: an older commit arriving after a newer one would take the
queue's offset back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from apogee.client._rpc import ChannelPool, rpc
from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import ApogeeError, NotFoundError, UnavailableError
from apogee.common.files import write_json_atomic
from apogee.v1 import consumer_pb2

__all__ = [
    "OFFSETS_FILE",
    "LocalOffsetStore",
    "OffsetStore",
    "QueueOffsets",
    "RemoteOffsetStore",
    "default_offset_dir",
]

log = logging.getLogger(__name__)

#: The local store's file name inside :func:`default_offset_dir`.
OFFSETS_FILE: Final = "offsets.json"
FORMAT_VERSION: Final = 1
#: seconds between two commits of every queue of a broker, moved or not (RemoteOffsetStore)
FULL_COMMIT_S: Final = 60.0


class OffsetStore(Protocol):
    """Offsets of one consumer group's queues: in memory, and persisted somewhere."""

    async def load(self, mq: MessageQueue) -> int | None:
        """The persisted offset of ``mq`` (None: nothing stored), which also becomes the
        in-memory one."""
        ...

    def update(self, mq: MessageQueue, offset: int, increase_only: bool = True) -> None:
        """Set the in-memory offset of ``mq``; with ``increase_only`` a lower offset than the
        one held is ignored."""
        ...

    def read(self, mq: MessageQueue) -> int | None:
        """The in-memory offset of ``mq``, None when there is none."""
        ...

    async def persist_all(self, mqs: Collection[MessageQueue]) -> None:
        """Persist the in-memory offsets of ``mqs`` (those that have one); failures are logged
        and retried at the next call, never raised."""
        ...

    async def persist(self, mq: MessageQueue) -> None:
        """Persist the in-memory offset of one queue (as :meth:`persist_all`)."""
        ...

    def remove(self, mq: MessageQueue) -> None:
        """Forget the in-memory offset of ``mq`` (it is no longer this consumer's)."""
        ...


class _MemoryTable:
    """The in-memory half both stores share."""

    def __init__(self) -> None:
        self._table: dict[MessageQueue, int] = {}

    def update(self, mq: MessageQueue, offset: int, increase_only: bool = True) -> None:
        if increase_only:
            held = self._table.get(mq)
            if held is not None and held >= offset:
                return
        self._table[mq] = offset

    def read(self, mq: MessageQueue) -> int | None:
        return self._table.get(mq)

    def remove(self, mq: MessageQueue) -> None:
        self._table.pop(mq, None)

    def snapshot(self, mqs: Iterable[MessageQueue]) -> dict[MessageQueue, int]:
        table = self._table
        return {mq: table[mq] for mq in mqs if mq in table}


@dataclass(frozen=True, slots=True)
class QueueOffsets:
    """A queue's committed offset at its broker (None: nothing committed), and the earliest and
    max offsets the broker keeps, for choosing where a queue without one starts."""

    committed: int | None
    min_offset: int
    max_offset: int


class RemoteOffsetStore(_MemoryTable):
    """Offsets at the brokers (clustering). ``address_of(broker_name)`` gives a broker's
    address from the consumer's routes (None when unknown)."""

    def __init__(
        self,
        group: str,
        client_id: str,
        pool: ChannelPool,
        address_of: Callable[[str], str | None],
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.group = group
        self.client_id = client_id
        self._pool = pool
        self._address_of = address_of
        self.timeout = timeout
        self._failing: set[str] = set()  # brokers whose last commit failed (logged once)
        #: held while a commit to the broker is out: the next waits for its answer
        self._sending: dict[str, asyncio.Lock] = {}
        self._commits: set[asyncio.Task[None]] = set()
        #: the offset of each queue its broker last acknowledged (or reported): a persist
        #: sends only the queues whose offset moved since, and every queue again once per
        #: FULL_COMMIT_S per broker (a broker that lost a commit, a new leader after a crash,
        #: has it again within that time). An idle consumer sent every queue every 5 s.
        self._acked: dict[MessageQueue, int] = {}
        self._full_due: dict[str, float] = {}
        self._clock = clock

    def remove(self, mq: MessageQueue) -> None:
        super().remove(mq)
        self._acked.pop(mq, None)

    def _address(self, broker_name: str) -> str:
        address = self._address_of(broker_name)
        if not address:
            raise UnavailableError(
                what=f"broker {broker_name}", detail="its address is not in the routes"
            )
        return address

    async def query(self, mq: MessageQueue) -> QueueOffsets:
        """The committed, earliest and max offsets of ``mq`` at its broker. Raises when the
        broker cannot be asked or does not have the queue."""
        address = self._address(mq.broker_name)
        resp = await rpc(
            f"broker {mq.broker_name} at {address}",
            self._pool.consumer(address).QueryOffsets(
                consumer_pb2.QueryOffsetsRequest(
                    group=self.group, topic=mq.topic, queue_ids=[mq.queue_id]
                ),
                timeout=self.timeout,
            ),
        )
        for q in resp.queues:
            if q.queue_id == mq.queue_id:
                committed = q.committed if q.committed >= 0 else None
                return QueueOffsets(committed, q.min_offset, q.max_offset)
        raise NotFoundError(
            what=f"queue {mq.topic}/{mq.queue_id}",
            detail=f"broker {mq.broker_name} did not report it",
        )

    async def load(self, mq: MessageQueue) -> int | None:
        """The group's committed offset of ``mq`` at its broker (None: nothing committed).
        Raises when the broker cannot be asked: the caller tries again later."""
        committed = (await self.query(mq)).committed
        if committed is not None:
            self.update(mq, committed, increase_only=False)
            self._acked[mq] = committed
        return committed

    async def persist_all(self, mqs: Collection[MessageQueue]) -> None:
        by_broker: dict[str, list[MessageQueue]] = defaultdict(list)
        for mq in self.snapshot(mqs):
            by_broker[mq.broker_name].append(mq)
        if not by_broker:
            return
        # each commit runs to its answer even when this persist is cancelled: one cut short
        # could still reach its broker after the next one
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._commit(b, queues)) for b, queues in by_broker.items()]
        self._commits.update(tasks)
        for t in tasks:
            t.add_done_callback(self._commits.discard)
        await asyncio.shield(asyncio.gather(*tasks))

    async def persist(self, mq: MessageQueue) -> None:
        await self.persist_all((mq,))

    async def _commit(self, broker_name: str, mqs: list[MessageQueue]) -> None:
        """Commit the offsets of ``mqs`` (all of ``broker_name``) once the previous commit to
        that broker was answered, as they are then."""
        lock = self._sending.setdefault(broker_name, asyncio.Lock())
        async with lock:
            await self._commit_locked(broker_name, mqs)

    async def _commit_locked(self, broker_name: str, mqs: list[MessageQueue]) -> None:
        now = self._clock()
        full = now >= self._full_due.get(broker_name, 0.0)
        acked = self._acked
        moved = {
            mq: offset
            for mq, offset in self.snapshot(mqs).items()
            if full or acked.get(mq) != offset
        }
        entries = [
            consumer_pb2.QueueOffset(topic=mq.topic, queue_id=mq.queue_id, offset=offset)
            for mq, offset in moved.items()
        ]
        if not entries:
            return
        request = consumer_pb2.CommitOffsetsRequest(
            group=self.group, client_id=self.client_id, offsets=entries
        )
        try:
            address = self._address(broker_name)
            await rpc(
                f"broker {broker_name} at {address}",
                self._pool.consumer(address).CommitOffsets(request, timeout=self.timeout),
            )
        except ApogeeError as err:
            if broker_name not in self._failing:
                self._failing.add(broker_name)
                log.warning(
                    "committing %d offsets of group %s to broker %s failed (%s; tried again at "
                    "the next persist): %s",
                    len(entries),
                    self.group,
                    broker_name,
                    "retriable" if err.retriable else "refused",
                    err,
                )
            else:
                log.debug("committing offsets to broker %s failed again: %s", broker_name, err)
            return
        acked.update(moved)
        if full:
            self._full_due[broker_name] = now + FULL_COMMIT_S
        if broker_name in self._failing:
            self._failing.discard(broker_name)
            log.info(
                "committing offsets of group %s to broker %s works again", self.group, broker_name
            )


def default_offset_dir(group: str, client_id: str) -> Path:
    """``$APOGEE_HOME/offsets/<client id>/<group>`` (``~/.apogee`` without ``APOGEE_HOME``):
    the folder of a broadcasting consumer's :data:`OFFSETS_FILE`."""
    home = Path(os.environ.get("APOGEE_HOME") or Path.home() / ".apogee")
    return home / "offsets" / _path_part(client_id) / _path_part(group)


def _path_part(text: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_.@%|" else "_" for c in text)
    return safe if safe.strip(".") else "_"


class LocalOffsetStore(_MemoryTable):
    """Offsets in one JSON file (broadcasting). The file keeps the offsets of queues this
    consumer no longer reads, so they are still there if the queues come back."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._stored: dict[MessageQueue, int] | None = None  # the file's content, once read
        self._lock = asyncio.Lock()
        self._failing = False
        self._writes: set[asyncio.Task[None]] = set()

    async def load(self, mq: MessageQueue) -> int | None:
        stored = await self._read_file()
        offset = stored.get(mq)
        if offset is not None:
            self.update(mq, offset, increase_only=False)
        return offset

    async def _read_file(self) -> dict[MessageQueue, int]:
        if self._stored is None:
            async with self._lock:
                if self._stored is None:
                    self._stored = await asyncio.to_thread(self._read_file_blocking)
        return self._stored

    def _read_file_blocking(self) -> dict[MessageQueue, int]:
        """The file's offsets, else its backup's (a write interrupted between its two renames
        leaves only the backup); {} when neither exists or both are damaged."""
        backup = self.path.with_name(self.path.name + ".bak")
        problems: list[str] = []
        for candidate in (self.path, backup):
            try:
                raw = candidate.read_bytes()
            except FileNotFoundError:
                continue
            except OSError as exc:
                problems.append(f"{candidate}: {exc}")
                continue
            try:
                offsets = _parse_offsets(json.loads(raw))
            except (ValueError, UnicodeDecodeError) as exc:
                problems.append(f"{candidate}: {exc}")
                continue
            if problems:
                log.warning(
                    "the offset file %s is damaged (%s); using its backup %s",
                    self.path,
                    "; ".join(problems),
                    candidate,
                )
                self._move_aside()
            return offsets
        if problems:
            self._move_aside()
            log.warning(
                "the offset file %s is damaged (%s); the consumer starts as if it had no "
                "offsets (each queue starts where consume_from says)",
                self.path,
                "; ".join(problems),
            )
        return {}

    def _move_aside(self) -> None:
        """Keep a damaged file for inspection rather than overwrite it at the next write."""
        if not self.path.exists():
            return
        aside = self.path.with_name(f"{self.path.name}.damaged-{time.time_ns() // 1_000_000}")
        try:
            os.replace(self.path, aside)
        except OSError as exc:
            log.warning("could not move the damaged offset file %s aside: %s", self.path, exc)
        else:
            log.warning("the damaged offset file %s was moved to %s", self.path, aside.name)

    async def persist_all(self, mqs: Collection[MessageQueue]) -> None:
        queues = list(self.snapshot(mqs))
        if not queues:
            return
        await self._read_file()
        # the write runs to its end even when this persist is cancelled (its thread would go
        # on anyway): the next one waits for it
        task = asyncio.get_running_loop().create_task(self._write(queues))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        await asyncio.shield(task)

    async def _write(self, mqs: list[MessageQueue]) -> None:
        """Write the offsets of ``mqs`` as they are once the previous write is done."""
        async with self._lock:
            changes = self.snapshot(mqs)
            stored = self._stored or {}
            merged = {**stored, **changes}
            if merged == stored and self.path.exists():
                return
            try:
                await asyncio.to_thread(self._write_blocking, merged)
            except OSError as exc:
                if not self._failing:
                    self._failing = True
                    log.warning(
                        "writing the offset file %s failed (tried again at the next persist): %s",
                        self.path,
                        exc,
                    )
                return
            self._stored = merged
            if self._failing:
                self._failing = False
                log.info("writing the offset file %s works again", self.path)

    async def persist(self, mq: MessageQueue) -> None:
        await self.persist_all((mq,))

    def _write_blocking(self, offsets: dict[MessageQueue, int]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, _dump_offsets(offsets))


def _dump_offsets(offsets: dict[MessageQueue, int]) -> dict[str, Any]:
    rows = [
        {"topic": mq.topic, "broker_name": mq.broker_name, "queue_id": mq.queue_id, "offset": off}
        for mq, off in sorted(
            offsets.items(), key=lambda kv: (kv[0].topic, kv[0].broker_name, kv[0].queue_id)
        )
    ]
    return {"version": FORMAT_VERSION, "offsets": rows}


def _parse_offsets(content: Any) -> dict[MessageQueue, int]:
    """The offsets of a file's JSON content; ValueError naming what is wrong."""
    if not isinstance(content, dict) or not isinstance(content.get("offsets"), list):
        raise ValueError('expected an object with an "offsets" list')
    if content.get("version") != FORMAT_VERSION:
        raise ValueError(f"format version {content.get('version')!r} is not {FORMAT_VERSION}")
    out: dict[MessageQueue, int] = {}
    for i, row in enumerate(content["offsets"]):
        ok = (
            isinstance(row, dict)
            and isinstance(row.get("topic"), str)
            and isinstance(row.get("broker_name"), str)
            and _is_int(row.get("queue_id"))
            and _is_int(row.get("offset"))
            and row["offset"] >= 0
            and row["queue_id"] >= 0
        )
        if not ok:
            raise ValueError(
                f"offsets[{i}] = {row!r} is not "
                '{"topic": str, "broker_name": str, "queue_id": int >= 0, "offset": int >= 0}'
            )
        out[MessageQueue(row["topic"], row["broker_name"], row["queue_id"])] = row["offset"]
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
