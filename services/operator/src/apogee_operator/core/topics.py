"""A Topic resource kept true on the brokers.

Every reconcile compares what the brokers have (``describe_topic``) with the spec, on every
live broker of the topic's cluster, and puts the topic (``create_or_update_topic``) on the
brokers that lack it or have other queue counts, permissions or message type (``messageType``,
MIXED unless the spec says otherwise): so a topic created, changed, deleted behind the
operator's back, or missing on a broker that joined, is put right, at the latest by the next
resync. ``status.topicName`` remembers the topic the resource manages once it was first put on
the brokers; only that topic is ever deleted, and only under ``deletionPolicy: delete``.

Two resources naming one topic: the older one (by creation time) manages it, the other reports
``Ready=False`` (``Conflict``) and, when deleted, deletes nothing.

``Ready`` reasons: ``Synced``; ``InvalidSpec`` (the spec breaks a rule, names a system topic,
or changed its topic name); ``Conflict``; ``ClusterNotFound`` and ``BrokersUnavailable``
(retried); ``DeleteFailed`` (retried; the finalizer stays).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from apogee.client.admin import AdminClient, BrokerInfo
from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    PermissionDeniedError,
    UnknownTopicError,
)
from apogee.common.topics import perm_text
from apogee_operator.core.outcome import Outcome, status_with
from apogee_operator.core.resources import (
    FINALIZER,
    DeletionPolicy,
    TopicSpec,
    deletion_policy,
    key_of,
    parse_topic,
)

log = logging.getLogger(__name__)

#: Given a topic name and a resource's key: the key of the resource that manages that topic
#: (None when none does).
OwnerOf = Callable[[str], tuple[str, str] | None]


class TopicReconciler:
    def __init__(self, admin: AdminClient, owner_of: OwnerOf) -> None:
        self.admin = admin
        self.owner_of = owner_of

    async def reconcile(self, obj: Mapping[str, Any]) -> Outcome:
        meta = obj.get("metadata") or {}
        has_finalizer = FINALIZER in (meta.get("finalizers") or [])
        if meta.get("deletionTimestamp"):
            return await self._delete(obj) if has_finalizer else Outcome()
        try:
            spec = parse_topic(obj)
        except InvalidArgumentError as err:
            return Outcome(status_with(obj, False, "InvalidSpec", str(err)))
        applied = (obj.get("status") or {}).get("topicName")
        if applied and applied != spec.name:
            return Outcome(
                status_with(
                    obj,
                    False,
                    "InvalidSpec",
                    f"spec.name: changed from {applied!r} to {spec.name!r}; a Topic stays bound "
                    "to the topic it created: delete it and create another",
                )
            )
        owner = self.owner_of(spec.name)
        if owner is not None and owner != key_of(obj):
            return Outcome(
                status_with(
                    obj,
                    False,
                    "Conflict",
                    f"topic {spec.name!r} is managed by Topic {owner[0]}/{owner[1]}",
                ),
                add_finalizer=not has_finalizer,
            )
        outcome = await self._sync(obj, spec)
        if has_finalizer:
            return outcome
        return Outcome(outcome.status, add_finalizer=True, retry=outcome.retry)

    async def _sync(self, obj: Mapping[str, Any], spec: TopicSpec) -> Outcome:
        try:
            targets = await self._targets(obj, spec)
            if isinstance(targets, Outcome):
                return targets
            try:
                described = await self.admin.describe_topic(spec.name)
                have = {b.broker_name: b.topic for b in described.brokers}
            except UnknownTopicError:
                have = {}
            stale = [
                b.broker_name
                for b in targets
                if (t := have.get(b.broker_name)) is None
                or (t.read_queues, t.write_queues, int(t.perm), t.message_type)
                != (spec.queues, spec.queues, int(spec.perm), spec.message_type)
            ]
            if stale:
                await self.admin.create_or_update_topic(
                    spec.name, spec.queues, spec.perm, brokers=stale, message_type=spec.message_type
                )
                self._log_put(obj, spec, stale, have)
        except (InvalidArgumentError, PermissionDeniedError) as err:
            return Outcome(status_with(obj, False, "InvalidSpec", str(err)))
        except ApogeeError as err:
            return Outcome(status_with(obj, False, "BrokersUnavailable", str(err)), retry=True)
        names = sorted(b.broker_name for b in targets)
        message = (
            f"topic {spec.name!r} is on {len(names)} broker(s) ({', '.join(names)}) with "
            f"{spec.queues} queues, perm {perm_text(int(spec.perm))}, "
            f"{spec.message_type.value} messages"
        )
        return Outcome(
            status_with(
                obj,
                True,
                "Synced",
                message,
                topicName=spec.name,
                queues=spec.queues,
                perm=spec.perm_name,
                messageType=spec.message_type.value,
                brokers=names,
            )
        )

    async def _targets(self, obj: Mapping[str, Any], spec: TopicSpec) -> list[BrokerInfo] | Outcome:
        """The live brokers the topic belongs on (its cluster's), or why there are none."""
        live = await self.admin.cluster_info()
        clusters = sorted({b.cluster for b in live})
        if spec.cluster is not None:
            targets = [b for b in live if b.cluster == spec.cluster]
        elif len(clusters) > 1:
            raise InvalidArgumentError(
                field="spec.cluster",
                rule=f"several broker clusters are registered ({', '.join(clusters)}); name one",
            )
        else:
            targets = live
        if targets:
            return targets
        message = (
            f"no live broker of cluster {spec.cluster!r} (live clusters: "
            f"{', '.join(clusters) or 'none'})"
            if spec.cluster
            else "no live broker is registered with the nameservers"
        )
        return Outcome(status_with(obj, False, "ClusterNotFound", message), retry=True)

    def _log_put(
        self, obj: Mapping[str, Any], spec: TopicSpec, stale: list[str], have: Mapping[str, Any]
    ) -> None:
        ns, name = key_of(obj)
        status = obj.get("status") or {}
        generation = (obj.get("metadata") or {}).get("generation")
        if status.get("topicName") and status.get("observedGeneration") == generation:
            log.warning(
                "Topic %s/%s: topic %s had drifted on %s (missing or changed on the brokers); "
                "put back with %d queues",
                ns,
                name,
                spec.name,
                ", ".join(stale),
                spec.queues,
            )
            return
        created = [b for b in stale if b not in have]
        log.info(
            "Topic %s/%s: topic %s put on %s (%d queues, perm %s, %s messages; created on %s)",
            ns,
            name,
            spec.name,
            ", ".join(stale),
            spec.queues,
            spec.perm_name,
            spec.message_type.value,
            ", ".join(created) or "none",
        )

    async def _delete(self, obj: Mapping[str, Any]) -> Outcome:
        ns, name = key_of(obj)
        topic = (obj.get("status") or {}).get("topicName")
        policy = deletion_policy(obj)
        if policy is not DeletionPolicy.DELETE or not topic:
            log.info("Topic %s/%s deleted; topic %s left on the brokers", ns, name, topic or "-")
            return Outcome(remove_finalizer=True)
        if self.owner_of(topic) not in (None, (ns, name)):
            log.info("Topic %s/%s deleted; topic %s has another owner", ns, name, topic)
            return Outcome(remove_finalizer=True)
        try:
            deleted = await self.admin.delete_topic(topic)
        except UnknownTopicError:
            deleted = []
        except ApogeeError as err:
            return Outcome(
                status_with(obj, False, "DeleteFailed", f"deleting topic {topic!r}: {err}"),
                retry=True,
            )
        log.info(
            "Topic %s/%s deleted; topic %s deleted from %s",
            ns,
            name,
            topic,
            ", ".join(deleted) or "no broker (it was gone)",
        )
        return Outcome(remove_finalizer=True)
