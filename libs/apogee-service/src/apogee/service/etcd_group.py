"""A replica group's record and its leader's claim kept in etcd: :class:`EtcdCoordination`.

One group is two keys under ``/apogee/<cluster>/replica-groups/<broker_name>/``::

    .../record   GroupRecord.to_json(), no lease: it stays when every replica is gone
    .../leader   the leading replica's id, attached to a lease of lease_s seconds

The record's version is the ``mod_revision`` of the record key (0 when there is none), so an
update is a compare-and-set on it: a txn that writes the record only if the key was last
written at the version read (or does not exist, for version 0). A campaign is one txn too: the
record still at the version read **and** no ``leader`` key, then the record and the leader key
on a fresh lease, together or not at all; two replicas campaigning at once cannot both win.

The leader key is the liveness claim: the leader renews its lease (:meth:`EtcdCoordination.renew`)
and when it stops, etcd deletes the key ``lease_s`` seconds later and a follower may campaign.
The claim is **not a fence**: a leader paused past its lease (a long GC, SIGSTOP, a partition
from etcd) still believes it leads until it next asks etcd. The fence is the record's
**epoch**: a campaign that wins writes ``epoch + 1``, every replication call carries the epoch
and the brokers and nameservers refuse a lower one (:mod:`apogee.service.replica_group`).

So that the leader lets go in time on its own, :meth:`~EtcdCoordination.renew` answers True
while etcd cannot be reached only until ``lease_s`` seconds have passed since the last
renewal that succeeded, counted on ``time.monotonic()`` from before that renewal was sent:
etcd started counting the lease's TTL (which is at least ``lease_s``) after that moment, so the
leader gives up no later than etcd lets the claim lapse, as far as the two clocks agree. For
that to mean anything the client's ``timeout_s`` should be well below ``lease_s``.
"""

from __future__ import annotations

import contextlib
import math
import time

from apogee.common.errors import ApogeeError, InvalidArgumentError, UnavailableError
from apogee.service.etcd import EtcdClient, Guard, Put
from apogee.service.replica_group import GroupRecord, ReplicaCoordination, Versioned

__all__ = ["EtcdCoordination", "group_prefix"]


def _name(value: str, field: str) -> str:
    if not value or "/" in value:
        raise InvalidArgumentError(
            field=field, rule=f"must be non-empty and without '/', got {value!r}"
        )
    return value


def group_prefix(cluster: str, broker_name: str) -> str:
    """The keys of a group start with this: ``/apogee/<cluster>/replica-groups/<broker>/``."""
    cluster = _name(cluster, "cluster")
    broker_name = _name(broker_name, "broker_name")
    return f"/apogee/{cluster}/replica-groups/{broker_name}/"


def _revision(version: int | str) -> int:
    """The ``mod_revision`` a version stands for."""
    if isinstance(version, str) and version.isdigit():
        return int(version)
    if isinstance(version, int) and not isinstance(version, bool) and version >= 0:
        return version
    raise InvalidArgumentError(
        field="version",
        rule=f"must be the record's etcd mod_revision (an integer >= 0), got {version!r}",
    )


class EtcdCoordination(ReplicaCoordination):
    """Replica ``replica_id``'s view of the group ``broker_name`` of ``cluster``, kept in the
    etcd that ``client`` reaches; its claim lapses ``lease_s`` seconds (at least 1) after its
    last renewal. ``client`` stays the caller's: :meth:`close` gives up the claim only."""

    def __init__(
        self,
        client: EtcdClient,
        cluster: str,
        broker_name: str,
        replica_id: str,
        lease_s: float = 3.0,
    ) -> None:
        if not replica_id:
            raise InvalidArgumentError(field="replica_id", rule="must be non-empty")
        if not lease_s >= 1:
            raise InvalidArgumentError(
                field="lease_s", rule=f"must be at least 1 second (etcd's TTLs), got {lease_s}"
            )
        self.client = client
        self.replica_id = replica_id
        self.lease_s = lease_s
        self.prefix = group_prefix(cluster, broker_name)
        self.record_key = self.prefix + "record"
        self.leader_key = self.prefix + "leader"
        #: the lease of the claim this replica holds (None: it holds none)
        self._lease: int | None = None
        #: time.monotonic() before the last renewal (or the grant) that succeeded was sent
        self._renewed_at = 0.0

    def _record_guard(self, version: int | str) -> Guard:
        revision = _revision(version)
        if revision == 0:
            return Guard.absent(self.record_key)
        return Guard.mod_revision(self.record_key, revision)

    async def read(self) -> Versioned:
        """The record and the claim, read at one revision (one range over the group's keys).
        A record key that does not hold a record raises :class:`InvalidArgumentError` naming
        the key."""
        found = await self.client.get_prefix(self.prefix)
        stored = found.get(self.record_key.encode())
        leader = found.get(self.leader_key.encode())
        if stored is None:
            record, version = GroupRecord(), 0
        else:
            record = GroupRecord.from_json(stored.value, f"etcd key {self.record_key}")
            version = stored.mod_revision
        extra = {} if leader is None else {"claim_holder": leader.value.decode(errors="replace")}
        return Versioned(record, version, leader_alive=leader is not None, extra=extra)

    async def update(self, record: GroupRecord, version: int | str) -> Versioned | None:
        """Write the record if its key is still at ``version`` (0: absent); the claim is left
        as it is (and read in the same txn, for ``leader_alive``)."""
        result = await self.client.txn(
            [self._record_guard(version)],
            [Put(self.record_key, record.to_json())],
            reads=[self.leader_key],
        )
        if not result.succeeded:
            return None
        alive = self.leader_key.encode() in result.found
        return Versioned(record, result.revision, leader_alive=alive)

    async def campaign(self, record: GroupRecord, version: int | str) -> Versioned | None:
        """Grant a lease, then one txn: if the record is at ``version`` and there is no leader
        key, write the record and the leader key (this replica's id) on the lease. A lost
        campaign revokes its lease at once."""
        guard = self._record_guard(version)
        asked = time.monotonic()
        lease = await self.client.grant(math.ceil(self.lease_s))
        try:
            result = await self.client.txn(
                [guard, Guard.absent(self.leader_key)],
                [
                    Put(self.record_key, record.to_json()),
                    Put(self.leader_key, self.replica_id, lease=lease),
                ],
            )
        except ApogeeError:
            # the txn may have been done all the same: without the lease the claim goes, and
            # the epoch it wrote fences whoever campaigns next
            await self._revoke_quietly(lease)
            raise
        if not result.succeeded:
            await self._revoke_quietly(lease)
            return None
        if self._lease is not None and self._lease != lease:
            await self._revoke_quietly(self._lease)  # an earlier claim, lapsed unnoticed
        self._lease, self._renewed_at = lease, asked
        return Versioned(
            record, result.revision, leader_alive=True, extra={"claim_holder": self.replica_id}
        )

    async def renew(self) -> bool:
        """Renew the claim's lease once. False when this replica holds no claim, or etcd says
        the lease is gone (then it holds none until its next campaign wins). When etcd cannot
        be reached: True until ``lease_s`` seconds have passed since the last renewal that
        succeeded (etcd keeps the claim that long at least), then
        :class:`~apogee.common.errors.UnavailableError` at every try until etcd answers again:
        the claim may have lapsed, and only the caller knows whether it may go on (a leader
        whose in-sync followers still fetch at its epoch may; docs/replication.md). When etcd
        answers again it tells: the lease is still there (True) or gone (False)."""
        lease = self._lease
        if lease is None:
            return False
        asked = time.monotonic()
        try:
            ttl = await self.client.keep_alive(lease)
        except UnavailableError:
            if time.monotonic() - self._renewed_at < self.lease_s:
                return True
            raise
        if ttl <= 0:
            self._lease = None
            return False
        self._renewed_at = asked
        return True

    async def resign(self) -> None:
        """Revoke the claim's lease (the leader key goes with it, so a follower may campaign
        at once) and forget it; an unreachable etcd is no error (the lease then lapses)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            await self._revoke_quietly(lease)

    async def _revoke_quietly(self, lease: int) -> None:
        with contextlib.suppress(ApogeeError):
            await self.client.revoke(lease)
