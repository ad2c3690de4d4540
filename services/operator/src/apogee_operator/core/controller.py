"""The controller: the resources followed from the API server, reconciled one at a time.

While the replica leads (it is the :class:`~apogee.service.leader_app.LeaderWork`), for each kind
(Topic, ConsumerGroup) a follower lists the objects and then watches them from the list's
resourceVersion, keeping the latest version of each in a cache; a watch that ends is started
again from the last version seen, and one the API server refuses as too old (410 Gone) is
followed by a new list. A new object, a changed spec (its ``metadata.generation``), a deletion
underway, or a missing finalizer puts the object's key on the queue; changes of status alone
(the operator's own writes) do not. Every ``resync_s`` every key is queued again: drift on the
brokers is found that way.

One worker takes keys off the queue (a key is queued once however often it changes) and hands
the cached object to its kind's reconciler, then writes what the reconciler decided: the
finalizer added or removed (a merge patch that names the resourceVersion read, so a stale
object gets 409 and is reconciled again from the newer one), and the status when it changed.
The cache takes new versions from the watch only: an answer to a write may arrive after the
watch delivered a newer version, and must not replace it.
A failure worth retrying queues the key again after ``retry_s``, doubling up to ``resync_s``.

Stop (bounded by ``shutdown_grace_s``): the watches are shut, the reconcile in flight may
finish, the tasks are cancelled, the clients closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from apogee.client.admin import AdminClient
from apogee.common.errors import InvalidArgumentError
from apogee.rpc.security import service_security
from apogee.service.kube import KubeCalls, KubeError, new_api_client, pod_namespace
from apogee_operator.core.groups import GroupReconciler
from apogee_operator.core.kubeapi import CustomResources, Watch, WatchItem
from apogee_operator.core.outcome import Outcome
from apogee_operator.core.resources import (
    CONSUMER_GROUPS,
    FINALIZER,
    KINDS,
    TOPICS,
    Kind,
    key_of,
    parse_topic,
)
from apogee_operator.core.stats import OperatorStats
from apogee_operator.core.topics import TopicReconciler
from apogee_operator.settings import OperatorSettings

log = logging.getLogger(__name__)

JSON = dict[str, Any]
#: (plural, namespace, name)
Key = tuple[str, str, str]


class Controller:
    """``await controller.start()``, ``await controller.stop()``; ``stats`` counts what it
    did. ``api_client_factory`` builds the Kubernetes client (default: in a pod, its service
    account; else the kubeconfig)."""

    def __init__(
        self,
        settings: OperatorSettings,
        stats: OperatorStats | None = None,
        api_client_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.settings = settings
        self.stats = stats or OperatorStats()
        self._factory = api_client_factory or new_api_client
        self._cache: dict[Key, JSON] = {}
        self._reconciled: dict[Key, int] = {}
        self._failures: dict[Key, int] = {}
        self._retries: dict[Key, asyncio.TimerHandle] = {}
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._watches: set[Watch] = set()
        self._stopping = asyncio.Event()
        self._busy = False
        self._calls: KubeCalls | None = None
        self._admin: AdminClient | None = None
        self.synced = {kind.plural: asyncio.Event() for kind in KINDS}

    @property
    def namespace(self) -> str | None:
        ns = self.settings.watch_namespace
        if ns == "*":
            return None
        return ns or os.environ.get("POD_NAMESPACE") or pod_namespace()

    async def start(self) -> None:
        self._calls = KubeCalls(self.settings.kube_timeout_s, threads=4, name="operator")
        resources = CustomResources(
            self._factory, self.namespace, self._calls, self.settings.watch_timeout_s
        )
        self._admin = AdminClient(
            self.settings.nameservers,
            timeout=self.settings.rpc_timeout_s,
            security=service_security(self.settings),
        )
        self._topics = TopicReconciler(self._admin, self._owner_of)
        self._groups = GroupReconciler(self._admin)
        self._resources = resources
        self._tasks = [
            *(
                asyncio.create_task(self._follow(kind), name=f"follow {kind.plural}")
                for kind in KINDS
            ),
            asyncio.create_task(self._resync(), name="resync"),
            asyncio.create_task(self._work(), name="reconcile"),
        ]
        log.info(
            "reconciling Topics and ConsumerGroups of %s with the brokers of %s",
            resources.where,
            self.settings.namesrv,
        )

    async def stop(self) -> None:
        self._stopping.set()
        for watch in list(self._watches):
            watch.stop()
        for handle in self._retries.values():
            handle.cancel()
        self._retries.clear()
        tasks, self._tasks = self._tasks, []
        worker = next((t for t in tasks if t.get_name() == "reconcile"), None)
        if worker is not None and self._busy:  # let a reconcile in flight end, within the grace
            await asyncio.wait({worker}, timeout=self.settings.shutdown_grace_s)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        for watch in list(self._watches):
            await watch.wait_done(1.0)
        if self._admin is not None:
            await self._admin.close()
            self._admin = None
        if self._calls is not None:
            self._calls.close()
            self._calls = None

    # -- following the API server -------------------------------------------------------------

    async def _follow(self, kind: Kind) -> None:
        backoff = self.settings.retry_s
        while not self._stopping.is_set():
            try:
                items, version = await self._resources.list(kind)
                self._relisted(kind, items)
                self.synced[kind.plural].set()
                backoff = self.settings.retry_s
                while version and not self._stopping.is_set():
                    version = await self._watch(kind, version)
            except KubeError as err:
                log.warning("%s; again in %.1fs", err, backoff)
                await self._pause(backoff)
                backoff = min(backoff * 2, self.settings.resync_s)

    def _relisted(self, kind: Kind, items: list[JSON]) -> None:
        seen: set[Key] = set()
        for obj in items:
            key = (kind.plural, *key_of(obj))
            seen.add(key)
            self._cache[key] = obj
            self._enqueue(key)
        for key in [k for k in self._cache if k[0] == kind.plural and k not in seen]:
            self._forget(key)

    async def _watch(self, kind: Kind, version: str) -> str:
        """Watch from ``version`` until the watch ends; the version to go on from ("" when a
        new list is needed)."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[WatchItem] = asyncio.Queue()

        def deliver(item: WatchItem) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                loop.call_soon_threadsafe(items.put_nowait, item)

        watch = self._resources.watch(kind, version, deliver)
        self._watches.add(watch)
        try:
            while True:
                what, payload = await items.get()
                if what == "end":
                    if payload is not None:
                        raise payload
                    return version
                event_type, obj = payload.get("type"), payload.get("object") or {}
                if event_type == "ERROR":
                    log.info(
                        "watch of %s ended: %s; listing again", kind.plural, obj.get("message")
                    )
                    return ""
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if event_type == "BOOKMARK":
                    continue
                key = (kind.plural, *key_of(obj))
                if event_type == "DELETED":
                    self._forget(key)
                    continue
                self._cache[key] = obj
                if self._wants_reconcile(key, obj):
                    self._enqueue(key)
        finally:
            watch.stop()
            self._watches.discard(watch)

    def _wants_reconcile(self, key: Key, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        return (
            bool(meta.get("deletionTimestamp"))
            or FINALIZER not in (meta.get("finalizers") or [])
            or self._reconciled.get(key) != meta.get("generation")
        )

    def _forget(self, key: Key) -> None:
        self._cache.pop(key, None)
        self._reconciled.pop(key, None)
        self._failures.pop(key, None)
        handle = self._retries.pop(key, None)
        if handle is not None:
            handle.cancel()

    async def _resync(self) -> None:
        while not self._stopping.is_set():
            await self._pause(self.settings.resync_s)
            for key in list(self._cache):
                self._enqueue(key)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    # -- reconciling --------------------------------------------------------------------------

    def _enqueue(self, key: Key) -> None:
        if key not in self._queued and not self._stopping.is_set():
            self._queued.add(key)
            self._queue.put_nowait(key)

    async def _work(self) -> None:
        while not self._stopping.is_set():
            key = await self._queue.get()
            self._queued.discard(key)
            obj = self._cache.get(key)
            if obj is None:
                continue
            self._busy = True
            try:
                retry = await self._reconcile(key, obj)
            except KubeError as err:
                log.info("%s/%s %s: %s; trying again", key[1], key[2], key[0], err)
                retry = True
            except Exception:
                log.exception("reconciling %s %s/%s failed", key[0], key[1], key[2])
                retry = True
            finally:
                self._busy = False
            if self._stopping.is_set():
                return
            if retry:
                self._retry_later(key)
            else:
                self._failures.pop(key, None)

    def _retry_later(self, key: Key) -> None:
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        delay = min(self.settings.retry_s * 2 ** (failures - 1), self.settings.resync_s)
        old = self._retries.pop(key, None)
        if old is not None:
            old.cancel()
        self._retries[key] = asyncio.get_running_loop().call_later(delay, self._enqueue, key)

    async def _reconcile(self, key: Key, obj: JSON) -> bool:
        """One reconcile of ``obj`` and its writes; whether to retry it soon."""
        kind = TOPICS if key[0] == TOPICS.plural else CONSUMER_GROUPS
        reconciler = self._topics if kind is TOPICS else self._groups
        outcome: Outcome = await reconciler.reconcile(obj)
        self.stats.count(kind.kind, outcome)
        meta = obj.get("metadata") or {}
        finalizers = list(meta.get("finalizers") or [])
        if outcome.add_finalizer and FINALIZER not in finalizers:
            obj = await self._set_finalizers(kind, obj, [*finalizers, FINALIZER])
        status = outcome.status
        if status is not None and status != obj.get("status"):
            obj = await self._resources.patch(kind, key[1], key[2], {"status": status}, True)
        if outcome.remove_finalizer and FINALIZER in finalizers:
            await self._set_finalizers(kind, obj, [f for f in finalizers if f != FINALIZER])
        if not outcome.retry:
            self._reconciled[key] = int(meta.get("generation") or 0)
        return outcome.retry

    async def _set_finalizers(self, kind: Kind, obj: JSON, finalizers: list[str]) -> JSON:
        ns, name = key_of(obj)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        body = {"metadata": {"finalizers": finalizers, "resourceVersion": version}}
        return await self._resources.patch(kind, ns, name, body)

    def _owner_of(self, topic: str) -> tuple[str, str] | None:
        """The Topic resource that manages ``topic``: the oldest one naming it that is not
        being deleted."""
        best: tuple[str, str, str] | None = None
        for key, obj in self._cache.items():
            if key[0] != TOPICS.plural:
                continue
            meta = obj.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                continue
            try:
                name = parse_topic(obj).name
            except InvalidArgumentError:
                continue
            if name != topic:
                continue
            candidate = (str(meta.get("creationTimestamp") or ""), key[1], key[2])
            if best is None or candidate < best:
                best = candidate
        return (best[1], best[2]) if best is not None else None
