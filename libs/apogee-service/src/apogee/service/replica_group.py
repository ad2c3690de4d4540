"""Who leads a broker's replica group, decided by an existing coordination engine.

A broker name is a group of replicas; one leads, the others follow it. The group's small record
(:class:`GroupRecord`: leader, its addresses, the epoch, the in-sync set) lives in the engine and
changes only by compare-and-set against the version read with it. Beside the record the leader
holds a liveness claim that lapses when it stops renewing (an etcd lease on a key, a Kubernetes
Lease's renew time, a ``flock`` held by its process): a follower may campaign only when the
claim is gone.

The claim is not a fence: a paused leader may still believe it leads. The **epoch** is the
fence: a campaign that wins writes ``epoch + 1``; every replication call carries the epoch, and
the brokers and nameservers refuse a lower one.

:class:`ReplicaCoordination` is the seam; :class:`FileCoordination` keeps the record in a JSON
file beside the replicas (one machine: ``apogee cluster up --replicas``); the etcd
implementation is in :mod:`apogee.service.etcd_group`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apogee.common.errors import InvalidArgumentError
from apogee.common.files import fsync_dir


@dataclass(frozen=True, slots=True)
class GroupRecord:
    """A replica group's record, as the engine keeps it.

    ``leader`` is a replica id ("" when nobody leads yet); ``leader_address`` the leader's
    replication address (host:port) and ``client_address`` the one clients use; ``in_sync`` the
    replica ids that have everything the leader acknowledged (the leader included)."""

    epoch: int = 0
    leader: str = ""
    leader_address: str = ""
    client_address: str = ""
    in_sync: tuple[str, ...] = ()
    #: replicas known to the group (ids), in the order they first joined
    members: tuple[str, ...] = ()
    #: the in-sync follower a leader hands leadership to (graceful handoff): it campaigns
    #: first once the claim is free; "" otherwise
    successor: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "epoch": self.epoch,
                "leader": self.leader,
                "leader_address": self.leader_address,
                "client_address": self.client_address,
                "in_sync": list(self.in_sync),
                "members": list(self.members),
                "successor": self.successor,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> GroupRecord:
        """Parse a record; raises :class:`InvalidArgumentError` naming ``where`` and the field."""
        try:
            raw: Any = json.loads(text)
        except ValueError as exc:
            raise InvalidArgumentError(
                field=where, rule=f"must hold a replica group record in JSON ({exc})"
            ) from None
        if not isinstance(raw, dict):
            raise InvalidArgumentError(field=where, rule="must hold a JSON object")

        def text_of(name: str) -> str:
            value = raw.get(name, "")
            if not isinstance(value, str):
                raise InvalidArgumentError(field=f"{where}.{name}", rule="must be a string")
            return value

        def ids_of(name: str) -> tuple[str, ...]:
            value = raw.get(name, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise InvalidArgumentError(
                    field=f"{where}.{name}", rule="must be a list of replica ids"
                )
            return tuple(value)

        epoch = raw.get("epoch", 0)
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise InvalidArgumentError(
                field=f"{where}.epoch", rule=f"must be a non-negative integer, got {epoch!r}"
            )
        return cls(
            epoch=epoch,
            leader=text_of("leader"),
            leader_address=text_of("leader_address"),
            client_address=text_of("client_address"),
            in_sync=ids_of("in_sync"),
            members=ids_of("members"),
            successor=text_of("successor"),
        )


@dataclass(frozen=True, slots=True)
class Versioned:
    """A record with the engine's version of it (etcd's ``mod_revision``, a Lease's
    ``resourceVersion``, a counter in a file): a compare-and-set names the version it read."""

    record: GroupRecord
    version: int | str = 0
    #: whether the leader's liveness claim is held by someone now, as the engine tells it
    leader_alive: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class ReplicaCoordination(abc.ABC):
    """One replica's view of its group in the engine. Every call is bounded in time and raises
    :class:`~apogee.common.errors.UnavailableError` when the engine cannot be reached."""

    #: how long a leader that stops renewing keeps its claim (seconds)
    lease_s: float = 3.0

    @abc.abstractmethod
    async def read(self) -> Versioned:
        """The record (an empty one, version 0, when the group has none yet)."""

    @abc.abstractmethod
    async def update(self, record: GroupRecord, version: int | str) -> Versioned | None:
        """Write ``record`` if the stored one is still at ``version``; the new version, or None
        when it moved (someone else wrote). Only the leader changes the in-sync set."""

    @abc.abstractmethod
    async def campaign(self, record: GroupRecord, version: int | str) -> Versioned | None:
        """Take the liveness claim and write ``record`` (naming this replica as leader, at a
        higher epoch) in one step, if the record is still at ``version`` and nobody holds the
        claim; the new version, or None when it lost."""

    @abc.abstractmethod
    async def renew(self) -> bool:
        """Renew the claim this replica holds; False when it is lost (lapsed or taken)."""

    @abc.abstractmethod
    async def resign(self) -> None:
        """Give up the claim at once (handoff, stop), so a follower need not wait it out."""

    async def close(self) -> None:
        """Release what the coordination holds (the claim included)."""
        await self.resign()


class FileCoordination(ReplicaCoordination):
    """The record in ``<dir>/record.json`` (rewritten whole, fsynced, under an exclusive lock
    on ``<dir>/record.lock``; its version is a counter in it), the claim an exclusive ``flock``
    on ``<dir>/leader.lock`` held by the leading process, so it lapses the moment that process
    dies, ``kill -9`` included. For replicas on one machine only."""

    lease_s = 0.0

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self._claim_fd: int | None = None

    def _locked_read(self) -> tuple[GroupRecord, int]:
        path = self.dir / "record.json"
        try:
            raw = path.read_text()
        except FileNotFoundError:
            return GroupRecord(), 0
        data = json.loads(raw)
        return GroupRecord.from_json(json.dumps(data["record"]), str(path)), int(data["version"])

    def _write(self, record: GroupRecord, version: int) -> None:
        path = self.dir / "record.json"
        tmp = path.with_suffix(".tmp")
        body = json.dumps({"version": version, "record": json.loads(record.to_json())})
        with open(tmp, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(self.dir)

    def _claim_free(self) -> bool:
        """Whether nobody (another process) holds the claim."""
        if self._claim_fd is not None:
            return False
        fd = os.open(self.dir / "leader.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        return True

    def _with_record_lock(self, fn: Any) -> Any:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / "record.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return fn()
        finally:
            os.close(fd)

    async def read(self) -> Versioned:
        def go() -> Versioned:
            record, version = self._locked_read()
            held = self._claim_fd is not None or not self._claim_free()
            return Versioned(record, version, leader_alive=held)

        result: Versioned = await asyncio.to_thread(self._with_record_lock, go)
        return result

    async def update(self, record: GroupRecord, version: int | str) -> Versioned | None:
        def go() -> Versioned | None:
            _, now = self._locked_read()
            if now != version:
                return None
            self._write(record, now + 1)
            return Versioned(record, now + 1, leader_alive=True)

        result: Versioned | None = await asyncio.to_thread(self._with_record_lock, go)
        return result

    async def campaign(self, record: GroupRecord, version: int | str) -> Versioned | None:
        def go() -> Versioned | None:
            _, now = self._locked_read()
            if now != version:
                return None
            fd = os.open(self.dir / "leader.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            self._claim_fd = fd
            self._write(record, now + 1)
            return Versioned(record, now + 1, leader_alive=True)

        result: Versioned | None = await asyncio.to_thread(self._with_record_lock, go)
        return result

    async def renew(self) -> bool:
        return self._claim_fd is not None

    async def resign(self) -> None:
        fd, self._claim_fd = self._claim_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
