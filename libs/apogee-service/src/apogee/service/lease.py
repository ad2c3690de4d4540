"""Leadership by a Kubernetes Lease (``coordination.k8s.io/v1``), behind the
:class:`~apogee.service.leadership.Leadership` seam; client-go's leader election, in asyncio.

Every candidate names the same Lease and its own identity (its pod's name). The Lease's spec
says who holds it (``holderIdentity``), for how long a holder that stops renewing keeps it
(``leaseDurationSeconds``), when it was last renewed, and how often it changed hands.

- **Acquire** (:meth:`LeaseLeadership.try_acquire`): read the Lease; create it when missing;
  take it when it has no holder (released), when its holder is this candidate (a restarted
  process of the same pod), or when it has not changed for ``leaseDurationSeconds`` (the
  record's own duration) since this candidate first saw it as it is - time measured on this
  candidate's monotonic clock from its own observations, never by comparing another machine's
  timestamps with ours. Every write carries the resourceVersion read, so of two candidates
  taking an expired Lease at once, one gets 409 Conflict and stays a standby.
- **Renew**: while held, every ``retry_period_s`` the holder writes ``renewTime`` (again with
  the resourceVersion of its last write). The term counts from when the last successful renewal
  was *sent*; when no renewal succeeds within ``renew_deadline_s`` of that, or a write finds
  another holder (409, then a read that names someone else), leadership is lost:
  :meth:`~LeaseLeadership.wait_lost` returns and the service stops its work. As
  ``renew_deadline_s`` < ``leaseDurationSeconds``, the work has stopped before any standby may
  see the Lease as expired; the difference is what stopping the work may take.
- **Release** (:meth:`~LeaseLeadership.release`, on shutdown): ``holderIdentity`` cleared and
  ``leaseDurationSeconds`` set to 1, so a standby takes over at its next try instead of waiting
  the Lease out. A holder killed with ``kill -9`` releases nothing: a standby takes over once
  the Lease has gone ``leaseDurationSeconds`` without a renewal.

Every call to the API server runs on a thread of its own pool (the client is synchronous) and
is cut after half the renew deadline (and within what is left of it, when renewing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.service.kube import KubeCalls, KubeError, missing_client_error
from apogee.service.leadership import Leadership

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """A Lease as read or written: its spec and the resourceVersion that goes with it."""

    holder: str
    duration_s: int
    acquire_time: datetime | None
    renew_time: datetime | None
    transitions: int
    resource_version: str = ""


class LeaseStore:
    """Reads and writes one Lease through the ``kubernetes`` client's CoordinationV1Api."""

    def __init__(
        self,
        api_client_factory: Callable[[], ApiClient],
        namespace: str,
        name: str,
        calls: KubeCalls,
    ) -> None:
        try:
            from kubernetes import client  # noqa: PLC0415
        except ImportError as err:  # pragma: no cover - the extra is missing
            raise missing_client_error("leadership = lease") from err
        self._client = client
        self._factory = api_client_factory
        self._api_instance: Any = None
        self.namespace = namespace
        self.name = name
        self.calls = calls

    @property
    def _api(self) -> Any:
        """The client, configured at first use; OSError when it cannot be (no kubeconfig
        outside a pod, say), which fails a service's start."""
        if self._api_instance is None:
            try:
                api_client = self._factory()
            except Exception as err:
                raise OSError(f"cannot configure the Kubernetes client: {err}") from err
            self._api_instance = self._client.CoordinationV1Api(api_client)
        return self._api_instance

    @property
    def where(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    async def get(self, timeout: float) -> LeaseRecord | None:
        """The Lease, or None when there is none."""
        try:
            lease = await self.calls.call(
                f"reading {self.where}",
                self._api.read_namespaced_lease,
                self.name,
                self.namespace,
                timeout=timeout,
            )
        except KubeError as err:
            if err.not_found:
                return None
            raise
        return self._record(lease)

    async def create(self, record: LeaseRecord, timeout: float) -> LeaseRecord:
        lease = await self.calls.call(
            f"creating {self.where}",
            self._api.create_namespaced_lease,
            self.namespace,
            self._lease(record),
            timeout=timeout,
        )
        return self._record(lease)

    async def replace(self, record: LeaseRecord, timeout: float) -> LeaseRecord:
        """Write ``record`` over the Lease if it is still at ``record.resource_version``;
        :class:`KubeError` 409 when someone wrote it meanwhile."""
        lease = await self.calls.call(
            f"writing {self.where}",
            self._api.replace_namespaced_lease,
            self.name,
            self.namespace,
            self._lease(record),
            timeout=timeout,
        )
        return self._record(lease)

    def _lease(self, record: LeaseRecord) -> Any:
        c = self._client
        return c.V1Lease(
            api_version="coordination.k8s.io/v1",
            kind="Lease",
            metadata=c.V1ObjectMeta(
                name=self.name,
                namespace=self.namespace,
                resource_version=record.resource_version or None,
            ),
            spec=c.V1LeaseSpec(
                holder_identity=record.holder or None,
                lease_duration_seconds=record.duration_s,
                acquire_time=record.acquire_time,
                renew_time=record.renew_time,
                lease_transitions=record.transitions,
            ),
        )

    @staticmethod
    def _record(lease: Any) -> LeaseRecord:
        spec = lease.spec
        return LeaseRecord(
            holder=(spec.holder_identity if spec is not None else None) or "",
            duration_s=int((spec.lease_duration_seconds if spec is not None else None) or 0),
            acquire_time=spec.acquire_time if spec is not None else None,
            renew_time=spec.renew_time if spec is not None else None,
            transitions=int((spec.lease_transitions if spec is not None else None) or 0),
            resource_version=str(lease.metadata.resource_version or ""),
        )


class LeaseLeadership(Leadership):
    """One candidate for the Lease ``store`` names, as ``identity`` (see the module
    docstring). ``held`` says whether it leads now."""

    def __init__(
        self,
        store: LeaseStore,
        identity: str,
        lease_duration_s: int = 15,
        renew_deadline_s: float = 10.0,
        retry_period_s: float = 2.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not 0 < retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError(
                "the retry period must be shorter than the renew deadline, and that shorter "
                f"than the lease duration (got {retry_period_s}, {renew_deadline_s}, "
                f"{lease_duration_s})"
            )
        if not identity:
            raise ValueError("a lease candidate needs an identity")
        self.store = store
        self.identity = identity
        self.lease_duration_s = int(lease_duration_s)
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self.poll_s = retry_period_s
        self.clock = clock
        self._call_timeout = renew_deadline_s / 2
        self._held = False
        self._record: LeaseRecord | None = None
        #: when the last successful write of this term was sent (monotonic)
        self._renewed_at = 0.0
        self._lost = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None
        #: the resourceVersion last seen, and when it was first seen (monotonic)
        self._observed: tuple[str, float] = ("", 0.0)
        self._last_holder = ""
        self._failing = False

    @property
    def held(self) -> bool:
        return self._held

    def holder(self) -> str:
        return f"the holder of {self.store.where} ({self._last_holder or 'unknown'})"

    async def try_acquire(self) -> bool:
        if self._held:
            return True
        now = self.clock.monotonic()
        try:
            record = await self.store.get(self._call_timeout)
            if record is None:
                record = await self.store.create(self._taken(None), self._call_timeout)
            else:
                self._observe(record, now)
                if record.holder and record.holder != self.identity and not self._expired(record):
                    self._last_holder = record.holder
                    self._failing = False
                    return False
                record = await self.store.replace(self._taken(record), self._call_timeout)
        except KubeError as err:
            if err.forbidden:
                raise PermissionError(
                    f"{err} (the service account needs get, create and update on "
                    "coordination.k8s.io leases in this namespace)"
                ) from err
            if not err.conflict and not self._failing:
                log.warning("%s: trying again every %.1fs", err, self.retry_period_s)
                self._failing = True
            return False
        self._failing = False
        self._won(record, now)
        return True

    async def wait_lost(self) -> None:
        await self._lost.wait()

    async def release(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.cancel()
            await asyncio.wait({renewer}, timeout=self._call_timeout + 1.0)
        if not self._held:
            return
        self._held = False
        self._lost.set()
        record = self._record
        for _ in range(3):  # a renewal in flight when cancelled may have moved the version on
            if record is None:
                return
            released = replace(
                record, holder="", duration_s=1, renew_time=self._now(), acquire_time=self._now()
            )
            try:
                await self.store.replace(released, self._call_timeout)
            except KubeError as err:
                if not err.conflict:
                    log.warning(
                        "could not release %s (%s): a standby takes over when it expires",
                        self.store.where,
                        err,
                    )
                    return
                with contextlib.suppress(KubeError):
                    record = await self.store.get(self._call_timeout)
                    if record is not None and record.holder == self.identity:
                        continue
                return
            log.info("released %s", self.store.where)
            return

    # -- one term -----------------------------------------------------------------------------

    def _won(self, record: LeaseRecord, sent_at: float) -> None:
        self._held = True
        self._record = record
        self._renewed_at = sent_at
        self._last_holder = self.identity
        self._lost = asyncio.Event()
        self._renewer = asyncio.create_task(self._renew(), name=f"renew {self.store.where}")
        log.info("active: holding %s as %s", self.store.where, self.identity)

    async def _renew(self) -> None:
        failing = False
        while self._held:
            left = self._renewed_at + self.renew_deadline_s - self.clock.monotonic()
            await asyncio.sleep(max(0.0, min(self.retry_period_s, left)))
            sent = self.clock.monotonic()
            left = self._renewed_at + self.renew_deadline_s - sent
            if left <= 0:
                self._lose(f"not renewed within the renew deadline ({self.renew_deadline_s:g}s)")
                return
            assert self._record is not None
            renewal = replace(self._record, holder=self.identity, renew_time=self._now())
            try:
                async with asyncio.timeout(left):
                    self._record = await self.store.replace(renewal, min(self._call_timeout, left))
            except TimeoutError:
                continue  # the deadline is checked at the top
            except KubeError as err:
                if err.conflict:
                    other = await self._current_holder(left)
                    if other is not None and other != self.identity:
                        self._lose(f"{other or 'nobody'} holds it now")
                        return
                    continue
                if not failing:
                    log.warning("renewing %s failed: %s (will retry)", self.store.where, err)
                    failing = True
                continue
            if failing:
                log.info("renewing %s works again", self.store.where)
                failing = False
            self._renewed_at = sent

    async def _current_holder(self, left: float) -> str | None:
        """After a conflict: the holder the API server has now ("" for none), None when it
        cannot be read (the next renewal will tell); our record follows it when it is ours."""
        try:
            async with asyncio.timeout(left):
                record = await self.store.get(min(self._call_timeout, left))
        except (TimeoutError, KubeError):
            return None
        if record is None:
            return ""
        if record.holder == self.identity:
            self._record = record
        return record.holder

    def _lose(self, why: str) -> None:
        self._held = False
        self._lost.set()
        self._renewer = None
        log.warning("lost %s: %s", self.store.where, why)

    # -- records ------------------------------------------------------------------------------

    def _observe(self, record: LeaseRecord, now: float) -> None:
        if record.resource_version != self._observed[0]:
            self._observed = (record.resource_version, now)

    def _expired(self, record: LeaseRecord) -> bool:
        duration = record.duration_s if record.duration_s > 0 else self.lease_duration_s
        return self.clock.monotonic() >= self._observed[1] + duration

    def _taken(self, previous: LeaseRecord | None) -> LeaseRecord:
        now = self._now()
        if previous is None:
            return LeaseRecord(self.identity, self.lease_duration_s, now, now, 0)
        ours = previous.holder == self.identity
        return LeaseRecord(
            holder=self.identity,
            duration_s=self.lease_duration_s,
            acquire_time=previous.acquire_time if ours else now,
            renew_time=now,
            transitions=previous.transitions + (0 if ours else 1),
            resource_version=previous.resource_version,
        )

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock.time_ms() / 1000, UTC)


def lease_leadership(
    namespace: str,
    name: str,
    identity: str,
    lease_duration_s: int,
    renew_deadline_s: float,
    retry_period_s: float,
    kubeconfig: str = "",
    api_client_factory: Callable[[], ApiClient] | None = None,
) -> LeaseLeadership:
    """A candidate for Lease ``namespace/name``, with the client
    :func:`~apogee.service.kube.new_api_client` builds at the first attempt (or
    ``api_client_factory``)."""
    from apogee.service.kube import new_api_client  # noqa: PLC0415

    factory = api_client_factory or (lambda: new_api_client(kubeconfig))
    calls = KubeCalls(timeout_s=renew_deadline_s / 2, name="lease")
    store = LeaseStore(factory, namespace, name, calls)
    return LeaseLeadership(store, identity, lease_duration_s, renew_deadline_s, retry_period_s)
