"""A replica group's record and its leader's claim kept in one Kubernetes Lease
(``coordination.k8s.io/v1``): :class:`KubeLeaseCoordination`.

One group is one Lease, ``<prefix>-<broker_name>`` (:func:`group_lease_name`) in the brokers'
namespace::

    metadata.annotations["apogee.io/replica-group"]   GroupRecord.to_json(): the record
    spec.holderIdentity                               the leading replica's id ("": none)
    spec.leaseDurationSeconds                         lease_s, rounded up
    spec.renewTime                                    changed at every renewal

The record's version is the Lease's ``resourceVersion`` ("" when there is no Lease), and every
write names the resourceVersion it read: the API server answers 409 Conflict when someone wrote
in between, which is a lost compare-and-set. A campaign is one write too, record and claim
together: the Lease still at the version read **and** its claim not alive, then this replica
as holder and the new record in one update (or the Lease created, when there is none). Two
replicas campaigning at once cannot both win.

A renewal rewrites the same object as the record, so it moves the resourceVersion although
the record stays as it was. An update therefore also succeeds when the Lease moved since
``version`` by renewals only (the record, the holder and the Lease's identity as this replica
saw them at ``version``): as with etcd, where keep-alives do not touch the record key, only a
write of the record or a change of holder makes an update at an older version lose.

**When a claim is alive.** Machines' clocks are never compared: ``renewTime`` is only a value
that changes. As client-go's leader election does (and :mod:`apogee.service.lease`), a replica
notes on its own ``time.monotonic()`` when it first saw the Lease's current (holder,
renewTime), right after the answer that showed it; the claim is alive while it has a holder
and less than its ``leaseDurationSeconds`` has passed since. A holder that stops renewing is
thus seen expired ``leaseDurationSeconds`` after each replica last saw it renew, never sooner.
A replica that has only just started sees any held claim as alive for a whole duration.

**The claim is not a fence.** A leader paused past its lease (a long GC, SIGSTOP, cut off
from the API server) still believes it leads until it next asks. The fence is the record's
**epoch**: a campaign that wins writes ``epoch + 1``, every replication call carries the epoch
and the brokers and nameservers refuse a lower one (:mod:`apogee.service.replica_group`).

So that the leader lets go in time on its own, :meth:`~KubeLeaseCoordination.renew` answers
True while the API server cannot be reached only until ``lease_s`` seconds have passed since
the last renewal that succeeded, counted from before that renewal was sent: another replica
saw its renewTime only after the API server stored it, so the leader gives up no later than
anyone else may see the claim expired, as far as the machines' clocks run at the same rate.

Calls run on a small thread pool of their own (the ``kubernetes`` client is synchronous; the
``apogee-service[kubernetes]`` extra), each cut after ``timeout_s`` and then raising
:class:`~apogee.common.errors.UnavailableError`; keep ``timeout_s`` well below ``lease_s``.
The service account needs ``get``, ``create`` and ``update`` on ``coordination.k8s.io``
leases in the namespace (a 401 or 403 raises
:class:`~apogee.common.errors.PermissionDeniedError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import math
import re
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    PermissionDeniedError,
    UnavailableError,
)
from apogee.service.kube import KubeCalls, KubeError, missing_client_error
from apogee.service.replica_group import GroupRecord, ReplicaCoordination, Versioned

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

__all__ = ["RECORD_ANNOTATION", "KubeLeaseCoordination", "group_lease_name"]

#: the annotation of the Lease that holds the group's record
RECORD_ANNOTATION = "apogee.io/replica-group"

JSON = dict[str, Any]

#: a Kubernetes object name (DNS subdomain) and a namespace (DNS label)
_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
#: how many resourceVersions this replica remembers what it saw at (for updates: see above)
_REMEMBERED = 32


def _object_name(value: str, field: str) -> str:
    if len(value) > 253 or not _SUBDOMAIN_RE.fullmatch(value):
        raise InvalidArgumentError(
            field=field,
            rule=f"{value!r} is not a Kubernetes name (lower case a-z, 0-9, - and ., at most "
            "253 characters)",
        )
    return value


def group_lease_name(prefix: str, broker_name: str) -> str:
    """The Lease of the group ``broker_name``: ``<prefix>-<broker_name>`` (the Helm release's
    name, say); :class:`InvalidArgumentError` when that is not a Kubernetes name."""
    if not prefix or not broker_name:
        raise InvalidArgumentError(
            field="prefix" if not prefix else "broker_name", rule="must be non-empty"
        )
    name = f"{prefix}-{broker_name}"
    if len(name) > 253 or not _SUBDOMAIN_RE.fullmatch(name):
        raise InvalidArgumentError(
            field="broker_name",
            rule=f"{name!r} ({prefix!r} and {broker_name!r}) is not a Kubernetes Lease name "
            "(lower case a-z, 0-9, - and ., at most 253 characters)",
        )
    return name


def _resource_version(version: int | str) -> str:
    """The resourceVersion a version stands for ("" for none: no Lease yet)."""
    if isinstance(version, str):
        return version
    if isinstance(version, int) and not isinstance(version, bool) and version == 0:
        return ""
    raise InvalidArgumentError(
        field="version",
        rule=f"must be the Lease's resourceVersion (a string; '' or 0 when there is no Lease), "
        f"got {version!r}",
    )


def _meta(lease: JSON) -> JSON:
    meta = lease.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _spec(lease: JSON) -> JSON:
    spec = lease.get("spec")
    return spec if isinstance(spec, dict) else {}


def _rv(lease: JSON) -> str:
    return str(_meta(lease).get("resourceVersion") or "")


def _holder(lease: JSON) -> str:
    holder = _spec(lease).get("holderIdentity")
    return holder if isinstance(holder, str) else ""


def _annotation(lease: JSON) -> str | None:
    annotations = _meta(lease).get("annotations")
    if not isinstance(annotations, dict):
        return None
    value = annotations.get(RECORD_ANNOTATION)
    return value if isinstance(value, str) else None


def _fingerprint(lease: JSON) -> tuple[object, ...]:
    """What an update at an older version needs unchanged: all but the renewals."""
    spec = _spec(lease)
    return (
        _meta(lease).get("uid"),
        _annotation(lease),
        _holder(lease),
        spec.get("acquireTime"),
        spec.get("leaseTransitions"),
    )


def _micro_time(after: object) -> str:
    """Now, as a Kubernetes MicroTime, and later than ``after`` (the renewTime written last),
    so that a renewal always changes it, whatever the wall clock did meanwhile."""
    now = datetime.now(UTC)
    if isinstance(after, str):
        with contextlib.suppress(ValueError):
            before = datetime.fromisoformat(after.replace("Z", "+00:00"))
            if before.tzinfo is not None and now <= before:
                now = before + timedelta(microseconds=1)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubeLeaseCoordination(ReplicaCoordination):
    """Replica ``replica_id``'s view of the group whose Lease is ``namespace/lease_name``
    (:func:`group_lease_name`), reached with ``api_client`` (a ``kubernetes.client.ApiClient``;
    it stays the caller's). Its claim lapses ``lease_s`` seconds (at least 1; the Lease
    records it rounded up) after its last renewal; every call is cut after ``timeout_s``.
    :meth:`close` gives up the claim and lets the call threads go.

    Holding the claim does not make a replica the only one that acts as leader (it may have
    lapsed while this replica was paused); the epoch its campaign wrote into the record does,
    since every replication call carries it and a lower one is refused."""

    def __init__(
        self,
        api_client: ApiClient,
        namespace: str,
        lease_name: str,
        replica_id: str,
        lease_s: float = 3.0,
        timeout_s: float = 1.0,
    ) -> None:
        if len(namespace) > 63 or not _LABEL_RE.fullmatch(namespace):
            raise InvalidArgumentError(
                field="namespace",
                rule=f"{namespace!r} is not a namespace (lower case a-z, 0-9 and -, at most 63 "
                "characters)",
            )
        _object_name(lease_name, "lease_name")
        if not replica_id:
            raise InvalidArgumentError(field="replica_id", rule="must be non-empty")
        if not lease_s >= 1:
            raise InvalidArgumentError(
                field="lease_s",
                rule=f"must be at least 1 second (leaseDurationSeconds), got {lease_s}",
            )
        if not 0 < timeout_s < lease_s:
            raise InvalidArgumentError(
                field="timeout_s",
                rule=f"must be above 0 and below lease_s ({lease_s:g}), got {timeout_s}",
            )
        try:
            from kubernetes import client  # noqa: PLC0415
        except ImportError as err:  # pragma: no cover - the extra is missing
            raise missing_client_error("the Kubernetes Lease coordination") from err
        self._api: Any = client.CoordinationV1Api(api_client)
        self.namespace = namespace
        self.lease_name = lease_name
        self.replica_id = replica_id
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.duration_s = math.ceil(lease_s)
        # a call cut by its timeout keeps its thread until the socket gives up (the client's
        # GETs and PUTs are retried within it): a few threads, so that the next call need not
        # wait for that
        self._calls = KubeCalls(timeout_s=timeout_s, threads=4, name="lease-group")
        #: whether this replica holds the claim, as far as it knows
        self._held = False
        #: time.monotonic() before the last renewal (or the campaign) that succeeded was sent
        self._renewed_at = 0.0
        #: the Lease as last seen (read or written), None when unknown or missing
        self._seen: JSON | None = None
        #: the claim (holder, renewTime) last seen, and when it was first seen so (monotonic)
        self._observed: tuple[tuple[str, object], float] = (("", None), 0.0)
        #: resourceVersion -> the Lease's fingerprint there, for the latest ones seen
        self._fingerprints: dict[str, tuple[object, ...]] = {}

    @property
    def where(self) -> str:
        return f"Lease {self.namespace}/{self.lease_name}"

    # -- the group ----------------------------------------------------------------------------

    async def read(self) -> Versioned:
        """The record in the Lease's annotation (an empty record, version "", when there is no
        Lease; an empty one at the Lease's version when it has no annotation) and whether its
        claim is alive. An annotation that does not hold a record raises
        :class:`InvalidArgumentError` naming the Lease and the annotation."""
        try:
            lease = await self._get()
        except KubeError as err:
            raise self._error(err) from None
        if lease is None:
            return Versioned(GroupRecord(), "", leader_alive=False)
        return self._versioned(lease, self._record_of(lease))

    async def update(self, record: GroupRecord, version: int | str) -> Versioned | None:
        """Write ``record`` into the annotation if the Lease is still at ``version`` (""
        or 0: there is none, and it is created without a holder) or moved since only by
        renewals (see the module docstring); the claim is left as it is. None when the record
        moved or the holder changed meanwhile."""
        rv = _resource_version(version)
        try:
            if rv == "":
                created = await self._create(self._new_lease(record, holder=""))
                return None if created is None else self._versioned(created, record)
            current = await self._at(rv)
            for _ in range(3):  # a renewal may slip in between: then the same check again
                if current is None or not self._same_record(current, rv):
                    return None
                body = copy.deepcopy(current)
                self._annotate(body, record)
                try:
                    written = await self._replace(body)
                except KubeError as err:
                    if not (err.conflict or err.not_found):
                        raise
                    current = await self._get()
                    continue
                return self._versioned(written, record)
            return None
        except KubeError as err:
            raise self._error(err) from None

    async def campaign(self, record: GroupRecord, version: int | str) -> Versioned | None:
        """Take the claim and write ``record`` in one write: create the Lease when there is
        none (``version`` "" or 0), else replace its spec and annotation if it is still at
        ``version`` and its claim is not alive (no holder, or expired as this replica sees
        it). None when it lost: the Lease moved, someone holds the claim, or another
        campaign wrote first."""
        rv = _resource_version(version)
        asked = time.monotonic()
        try:
            if rv == "":
                won = await self._create(self._new_lease(record, holder=self.replica_id))
            else:
                current = await self._at(rv)
                if current is None or _rv(current) != rv or self._alive(current):
                    return None
                body = copy.deepcopy(current)
                self._annotate(body, record)
                spec = body.setdefault("spec", {})
                stamp = _micro_time(spec.get("renewTime"))
                if _holder(current) != self.replica_id:  # as client-go counts them
                    transitions = spec.get("leaseTransitions")
                    spec["leaseTransitions"] = (
                        transitions + 1 if isinstance(transitions, int) else 1
                    )
                spec.update(
                    holderIdentity=self.replica_id,
                    leaseDurationSeconds=self.duration_s,
                    acquireTime=stamp,
                    renewTime=stamp,
                )
                try:
                    won = await self._replace(body)
                except KubeError as err:
                    if not (err.conflict or err.not_found):
                        raise
                    return None
        except KubeError as err:
            raise self._error(err) from None
        if won is None:
            return None
        self._held, self._renewed_at = True, asked
        return self._versioned(won, record)

    async def renew(self) -> bool:
        """Write a new ``renewTime``, carrying the resourceVersion of the Lease as last seen;
        on 409 read it again and, if this replica still holds it (its own :meth:`update` may
        have moved it), write once more at the new version. False when this replica holds no
        claim, or the Lease names another holder or is gone (then it holds none until its next
        campaign wins). When the API server cannot be reached: True until ``lease_s`` seconds
        have passed since the last renewal that succeeded, then
        :class:`~apogee.common.errors.UnavailableError` at every try until it answers again:
        the claim may have lapsed, and only the caller knows whether it may go on
        (docs/replication.md). When it answers again it tells: still held (True) or not."""
        if not self._held:
            return False
        asked = time.monotonic()
        try:
            base = self._seen
            for _ in range(2):
                if base is None or _holder(base) != self.replica_id:
                    base = await self._get()
                    if base is None or _holder(base) != self.replica_id:
                        self._held = False
                        return False
                body = copy.deepcopy(base)
                spec = body.setdefault("spec", {})
                spec["renewTime"] = _micro_time(spec.get("renewTime"))
                try:
                    await self._replace(body)
                except KubeError as err:
                    if not (err.conflict or err.not_found):
                        raise
                    base = None  # read it again: who holds it now?
                    continue
                self._renewed_at = asked
                return True
            # still ours, but other writes came first twice: not renewed this time
            failed: ApogeeError = UnavailableError(
                what=self.where, detail="not renewed: other writes to it came first twice"
            )
        except KubeError as err:
            failed = self._error(err)
            if not isinstance(failed, UnavailableError):
                raise failed from None
        if time.monotonic() - self._renewed_at < self.lease_s:
            return True
        raise failed

    async def resign(self) -> None:
        """Clear the holder and set ``leaseDurationSeconds`` to 1 (as
        :meth:`~apogee.service.lease.LeaseLeadership.release` does), so a follower may
        campaign at once; the record stays. Errors are no errors here: an unreachable API
        server lets the claim lapse instead."""
        if not self._held:
            return
        self._held = False
        base = self._seen
        with contextlib.suppress(ApogeeError, KubeError):
            for _ in range(3):  # a renewal in flight may have moved the version on
                if base is None or _holder(base) != self.replica_id:
                    base = await self._get()
                    if base is None or _holder(base) != self.replica_id:
                        return
                body = copy.deepcopy(base)
                spec = body.setdefault("spec", {})
                stamp = _micro_time(spec.get("renewTime"))
                spec.pop("holderIdentity", None)
                spec.update(leaseDurationSeconds=1, acquireTime=stamp, renewTime=stamp)
                try:
                    await self._replace(body)
                except KubeError as err:
                    if not err.conflict:
                        return
                    base = None
                    continue
                return

    async def close(self) -> None:
        """Give up the claim, then let the call threads go: the object is done with."""
        try:
            await self.resign()
        finally:
            self._calls.close()

    # -- what was seen ------------------------------------------------------------------------

    def _see(self, lease: JSON) -> JSON:
        """Note ``lease`` as just seen: the last Lease, its fingerprint at its version, and
        when its claim was first seen as it is now."""
        claim = (_holder(lease), _spec(lease).get("renewTime"))
        if claim != self._observed[0]:
            self._observed = (claim, time.monotonic())
        self._seen = lease
        rv = _rv(lease)
        self._fingerprints.pop(rv, None)
        self._fingerprints[rv] = _fingerprint(lease)
        while len(self._fingerprints) > _REMEMBERED:
            del self._fingerprints[next(iter(self._fingerprints))]
        return lease

    def _alive(self, lease: JSON) -> bool:
        """Whether ``lease`` (the last one seen) has a holder whose claim has not expired."""
        if not _holder(lease):
            return False
        duration = _spec(lease).get("leaseDurationSeconds")
        if not isinstance(duration, int) or isinstance(duration, bool) or duration <= 0:
            duration = self.duration_s
        return time.monotonic() < self._observed[1] + duration

    def _same_record(self, lease: JSON, rv: str) -> bool:
        """Whether ``lease`` is at ``rv``, or moved since only by renewals (as seen at ``rv``)."""
        if _rv(lease) == rv:
            return True
        before = self._fingerprints.get(rv)
        return before is not None and before == _fingerprint(lease)

    def _record_of(self, lease: JSON) -> GroupRecord:
        text = _annotation(lease)
        if text is None:
            if RECORD_ANNOTATION in (_meta(lease).get("annotations") or {}):
                raise InvalidArgumentError(
                    field=f"annotation {RECORD_ANNOTATION} of {self.where}",
                    rule="must be a string holding a replica group record in JSON",
                )
            return GroupRecord()
        return GroupRecord.from_json(text, f"annotation {RECORD_ANNOTATION} of {self.where}")

    def _versioned(self, lease: JSON, record: GroupRecord) -> Versioned:
        alive = self._alive(lease)
        extra = {"claim_holder": _holder(lease)} if alive else {}
        return Versioned(record, _rv(lease), leader_alive=alive, extra=extra)

    def _new_lease(self, record: GroupRecord, holder: str) -> JSON:
        spec: JSON = {"leaseDurationSeconds": self.duration_s}
        if holder:
            stamp = _micro_time(None)
            spec.update(
                holderIdentity=holder, acquireTime=stamp, renewTime=stamp, leaseTransitions=0
            )
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.lease_name,
                "namespace": self.namespace,
                "annotations": {RECORD_ANNOTATION: record.to_json()},
            },
            "spec": spec,
        }

    @staticmethod
    def _annotate(body: JSON, record: GroupRecord) -> None:
        meta = body.setdefault("metadata", {})
        annotations = meta.get("annotations")
        if not isinstance(annotations, dict):
            annotations = meta["annotations"] = {}
        annotations[RECORD_ANNOTATION] = record.to_json()

    # -- calls --------------------------------------------------------------------------------

    async def _at(self, rv: str) -> JSON | None:
        """The Lease at ``rv`` as last seen, else as it is now (None: there is none)."""
        if self._seen is not None and _rv(self._seen) == rv:
            return self._seen
        return await self._get()

    async def _get(self) -> JSON | None:
        try:
            lease = await self._call(
                "reading", self._api.read_namespaced_lease, self.lease_name, self.namespace
            )
        except KubeError as err:
            if err.not_found:
                self._seen = None
                return None
            raise
        return self._see(lease)

    async def _create(self, body: JSON) -> JSON | None:
        """The Lease created, or None when there is one already."""
        try:
            lease = await self._call(
                "creating", self._api.create_namespaced_lease, self.namespace, body
            )
        except KubeError as err:
            if err.conflict:  # AlreadyExists
                return None
            raise
        return self._see(lease)

    async def _replace(self, body: JSON) -> JSON:
        """Write ``body`` over the Lease if it is still at the resourceVersion ``body``
        carries; :class:`KubeError` 409 when it moved, 404 when it is gone."""
        lease = await self._call(
            "writing",
            self._api.replace_namespaced_lease,
            self.lease_name,
            self.namespace,
            body,
        )
        return self._see(lease)

    async def _call(self, action: str, method: Any, *args: Any) -> JSON:
        """``method(*args)`` on a pool thread, its answer as JSON (kept as the API server sent
        it, so that a replace writes back every field); :class:`KubeError` when it fails or
        does not answer within ``timeout_s``."""
        what = f"{action} {self.where}"

        def go(*, _request_timeout: float) -> JSON:
            answer = method(*args, _preload_content=False, _request_timeout=_request_timeout)
            try:
                doc = json.loads(answer.data)
            finally:
                answer.release_conn()
            if not isinstance(doc, dict):
                raise ValueError(f"the answer is not a JSON object: {str(doc)[:200]}")
            return doc

        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._calls.call(what, go, timeout=self.timeout_s)
        except TimeoutError:
            raise KubeError(what, 0, "Timeout", f"no answer within {self.timeout_s:g}s") from None

    def _error(self, err: KubeError) -> ApogeeError:
        """A failed call as an Apogee error: unreachable or failing (no answer, 408, 429,
        5xx) is :class:`UnavailableError`; refused for who we are, PermissionDeniedError; any
        other refusal names the Lease as the argument at fault."""
        if err.forbidden:
            return PermissionDeniedError(
                what=self.where,
                rule="the service account needs get, create and update on coordination.k8s.io "
                f"leases in namespace {self.namespace} ({err})",
            )
        if err.status in (0, 408, 429) or err.status >= 500:
            return UnavailableError(what="the Kubernetes API server", detail=str(err))
        return InvalidArgumentError(field=self.where, rule=f"refused by the API server: {err}")
