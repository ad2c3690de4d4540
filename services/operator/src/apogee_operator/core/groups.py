"""A ConsumerGroup resource: the group declared, and where it starts, applied at the brokers.

Apogee's brokers keep no settings for a consumer group: a group exists at a broker while it
has members online or offsets committed there, and what a consumer does (clustering or
broadcasting, where a queue without a committed offset starts, how often a failed message is
retried) is the consumer's own configuration (``apogee.client`` ``ConsumerConfig``), sent with
its heartbeats and send-backs. What the brokers do keep for a group is its committed offsets,
its ``%RETRY%<group>`` topic and its ``%DLQ%<group>`` topic. So a ConsumerGroup resource:

- **starts the group where ``consumeFrom`` says**, on every topic of ``spec.topics`` in which
  the group has no committed offset yet (clustering only; broadcasting consumers keep their
  offsets themselves): it sets the group's offsets of that topic, on every broker, to the
  earliest message kept, the end of the queues, or the first message stored at or after
  ``consumeTimestamp`` (``ResetOffsets``). Consumers of the group that start later continue
  from there, so messages sent between the declaration and the first consumer are not skipped
  with ``latest``. Each topic is set once (``status.initializedTopics``); a topic that does
  not exist yet is waited for (``Ready=False``, ``TopicNotFound``, retried);
- **reports** the members online and, as ``status.warnings``, members that consume in
  another mode than ``consumeMode`` says;
- **on deletion with ``deletionPolicy: delete``**, deletes the group's ``%RETRY%`` and
  ``%DLQ%`` topics (its pending retries and dead letters). Committed offsets stay at the
  brokers (there is no call that removes them); ``orphan`` leaves everything.

``Ready`` reasons: ``Synced``, ``InvalidSpec``, ``TopicNotFound`` and ``BrokersUnavailable``
(retried), ``DeleteFailed`` (retried; the finalizer stays).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from apogee.client.admin import AdminClient, GroupDescription
from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnknownTopicError,
)
from apogee.common.topics import dlq_topic, retry_topic
from apogee_operator.core.outcome import Outcome, status_with
from apogee_operator.core.resources import (
    FINALIZER,
    ConsumeFrom,
    ConsumeMode,
    DeletionPolicy,
    GroupSpec,
    deletion_policy,
    key_of,
    parse_group,
)

log = logging.getLogger(__name__)

#: At most this many member warnings in a status.
MAX_WARNINGS = 10


class GroupReconciler:
    def __init__(self, admin: AdminClient) -> None:
        self.admin = admin

    async def reconcile(self, obj: Mapping[str, Any]) -> Outcome:
        meta = obj.get("metadata") or {}
        has_finalizer = FINALIZER in (meta.get("finalizers") or [])
        if meta.get("deletionTimestamp"):
            return await self._delete(obj) if has_finalizer else Outcome()
        try:
            spec = parse_group(obj)
        except InvalidArgumentError as err:
            return Outcome(status_with(obj, False, "InvalidSpec", str(err)))
        applied = (obj.get("status") or {}).get("groupName")
        if applied and applied != spec.name:
            return Outcome(
                status_with(
                    obj,
                    False,
                    "InvalidSpec",
                    f"spec.name: changed from {applied!r} to {spec.name!r}; delete the "
                    "ConsumerGroup and create another",
                )
            )
        try:
            outcome = await self._sync(obj, spec)
        except (InvalidArgumentError, PermissionDeniedError) as err:
            outcome = Outcome(status_with(obj, False, "InvalidSpec", str(err)))
        except ApogeeError as err:
            outcome = Outcome(status_with(obj, False, "BrokersUnavailable", str(err)), retry=True)
        if has_finalizer:
            return outcome
        return Outcome(outcome.status, add_finalizer=True, retry=outcome.retry)

    async def _describe(self, group: str) -> GroupDescription | None:
        try:
            return await self.admin.describe_group(group)
        except NotFoundError:
            return None  # no member online, nothing committed

    async def _sync(self, obj: Mapping[str, Any], spec: GroupSpec) -> Outcome:
        ns, name = key_of(obj)
        status = obj.get("status") or {}
        initialized = [t for t in status.get("initializedTopics") or [] if t in spec.topics]
        waiting: list[str] = []
        description = await self._describe(spec.name)
        if spec.consume_mode is ConsumeMode.CLUSTERING:
            committed = {
                q.topic
                for q in (description.queues if description else ())
                if q.consumer_offset is not None
            }
            for topic in spec.topics:
                if topic in initialized:
                    continue
                if topic not in committed:
                    try:
                        await self._start(spec, topic)
                    except UnknownTopicError:
                        waiting.append(topic)
                        continue
                    log.info(
                        "ConsumerGroup %s/%s: group %s starts at %s on topic %s",
                        ns,
                        name,
                        spec.name,
                        spec.consume_from.value,
                        topic,
                    )
                initialized.append(topic)
        members = description.members if description else ()
        warnings = [
            f"member {m.client_id} consumes as {m.mode}, not {spec.consume_mode.value}"
            for m in members
            if m.mode != spec.consume_mode.value
        ][:MAX_WARNINGS]
        fields: dict[str, Any] = {
            "groupName": spec.name,
            "members": len(members),
            "initializedTopics": initialized,
            "warnings": warnings,
        }
        if waiting:
            message = (
                f"waiting for topic(s) {', '.join(waiting)} to exist: the group starts there "
                f"at {spec.consume_from.value} once they do"
            )
            return Outcome(status_with(obj, False, "TopicNotFound", message, **fields), retry=True)
        if spec.consume_mode is ConsumeMode.BROADCASTING:
            message = (
                f"group {spec.name!r} declared, {len(members)} member(s) online; broadcasting "
                "consumers keep their own offsets, so consumeFrom is theirs to apply"
            )
        else:
            message = (
                f"group {spec.name!r} declared, {len(members)} member(s) online; it starts at "
                f"{spec.consume_from.value} on {len(initialized)} topic(s) it had no offset in"
            )
        return Outcome(status_with(obj, True, "Synced", message, **fields))

    async def _start(self, spec: GroupSpec, topic: str) -> None:
        if spec.consume_from is ConsumeFrom.EARLIEST:
            await self.admin.reset_offsets(spec.name, topic, earliest=True)
        elif spec.consume_from is ConsumeFrom.LATEST:
            await self.admin.reset_offsets(spec.name, topic, latest=True)
        else:
            await self.admin.reset_offsets(spec.name, topic, timestamp_ms=spec.consume_timestamp_ms)

    async def _delete(self, obj: Mapping[str, Any]) -> Outcome:
        ns, name = key_of(obj)
        group = (obj.get("status") or {}).get("groupName")
        if deletion_policy(obj) is not DeletionPolicy.DELETE or not group:
            log.info("ConsumerGroup %s/%s deleted; the brokers are left as they are", ns, name)
            return Outcome(remove_finalizer=True)
        removed: list[str] = []
        for topic in (retry_topic(group), dlq_topic(group)):
            try:
                await self.admin.delete_topic(topic)
            except UnknownTopicError:
                continue
            except ApogeeError as err:
                return Outcome(
                    status_with(obj, False, "DeleteFailed", f"deleting topic {topic!r}: {err}"),
                    retry=True,
                )
            removed.append(topic)
        log.info(
            "ConsumerGroup %s/%s deleted; removed %s (committed offsets stay at the brokers)",
            ns,
            name,
            ", ".join(removed) or "nothing (no retry or dead-letter topic)",
        )
        return Outcome(remove_finalizer=True)
