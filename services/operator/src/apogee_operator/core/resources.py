"""The apogee.io/v1alpha1 resources: their names, and their specs read and checked.

The CustomResourceDefinitions in ``charts/apogee/crds/`` refuse bad specs when they are applied
(OpenAPI v3 schemas); the same rules are checked again here, so that an object the API server
let through (an older schema, a cluster that does not check) is reported on its ``Ready``
condition with the field and the rule, never acted on. A spec is read into a frozen dataclass
or refused with :class:`~apogee.common.errors.InvalidArgumentError`, whose message names the
field (``spec.queues``) and the rule.

Topic::

    spec:
      name: Orders            # the topic on the brokers; default: metadata.name
      queues: 8               # read and write queues on each broker, 1 to 1024 (default 8)
      perm: rw                # rw, r or w (default rw)
      messageType: MIXED      # what it accepts: NORMAL, FIFO, DELAY, TRANSACTION or MIXED
                              #   (default MIXED, every type)
      cluster: ""             # the broker cluster; empty: the only one registered
      deletionPolicy: orphan  # delete: deleting the resource deletes the topic

ConsumerGroup::

    spec:
      name: billing           # the group; default: metadata.name
      consumeMode: clustering # or broadcasting
      consumeFrom: latest     # earliest, latest or timestamp: where the group starts on
      consumeTimestamp: ...   #   each topic of `topics` it has no committed offset in
      topics: [Orders]
      deletionPolicy: orphan  # delete: deleting the resource deletes %RETRY%/%DLQ% topics
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from apogee.common.errors import InvalidArgumentError
from apogee.common.topics import (
    MAX_TOPIC_LENGTH,
    MESSAGE_TYPE_NAMES,
    READ_WRITE,
    RETRY_PREFIX,
    MessageType,
    Perm,
)

GROUP: Final = "apogee.io"
VERSION: Final = "v1alpha1"
#: Kept on every resource the operator has acted on, so that deleting it waits for the
#: deletion policy to be carried out.
FINALIZER: Final = "apogee.io/cleanup"

TOPIC_NAME_RE: Final = re.compile(r"[%|a-zA-Z0-9_-]+")
MAX_QUEUES: Final = 1024
#: A group name leaves room for its ``%RETRY%`` topic within a topic name's length.
MAX_GROUP_LENGTH: Final = MAX_TOPIC_LENGTH - len(RETRY_PREFIX)
MAX_GROUP_TOPICS: Final = 64
PERMS: Final = {"rw": READ_WRITE, "r": Perm.READ, "w": Perm.WRITE}


@dataclass(frozen=True, slots=True)
class Kind:
    plural: str
    kind: str


TOPICS: Final = Kind("topics", "Topic")
CONSUMER_GROUPS: Final = Kind("consumergroups", "ConsumerGroup")
KINDS: Final = (TOPICS, CONSUMER_GROUPS)


class DeletionPolicy(enum.Enum):
    #: deleting the resource deletes what it made on the brokers
    DELETE = "delete"
    #: deleting the resource leaves the brokers alone
    ORPHAN = "orphan"


class ConsumeMode(enum.Enum):
    CLUSTERING = "clustering"
    BROADCASTING = "broadcasting"


class ConsumeFrom(enum.Enum):
    EARLIEST = "earliest"
    LATEST = "latest"
    TIMESTAMP = "timestamp"


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    queues: int
    perm: Perm
    cluster: str | None
    deletion_policy: DeletionPolicy
    message_type: MessageType = MessageType.MIXED

    @property
    def perm_name(self) -> str:
        return next(k for k, v in PERMS.items() if v == self.perm)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    name: str
    consume_mode: ConsumeMode
    consume_from: ConsumeFrom
    #: epoch ms, with ``consume_from`` timestamp
    consume_timestamp_ms: int | None
    topics: tuple[str, ...]
    deletion_policy: DeletionPolicy


def key_of(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(namespace, name) of an object."""
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = obj.get("spec")
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise InvalidArgumentError(field="spec", rule="must be an object")
    return spec


def _name(
    spec: Mapping[str, Any], obj: Mapping[str, Any], what: str, max_len: int = MAX_TOPIC_LENGTH
) -> str:
    name = spec.get("name") or key_of(obj)[1]
    if not isinstance(name, str) or not TOPIC_NAME_RE.fullmatch(name):
        raise InvalidArgumentError(
            field="spec.name", rule=f"{name!r} is not a {what} name (characters [%|a-zA-Z0-9_-])"
        )
    if len(name) > max_len:
        raise InvalidArgumentError(
            field="spec.name", rule=f"{name!r} has {len(name)} characters; at most {max_len}"
        )
    return name


def _enum(spec: Mapping[str, Any], field: str, cls: type[enum.Enum], default: Any) -> Any:
    raw = spec.get(field, default.value)
    try:
        return cls(raw)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in cls)
        raise InvalidArgumentError(
            field=f"spec.{field}", rule=f"{raw!r} is not one of: {allowed}"
        ) from None


def _policy(spec: Mapping[str, Any]) -> DeletionPolicy:
    policy: DeletionPolicy = _enum(spec, "deletionPolicy", DeletionPolicy, DeletionPolicy.ORPHAN)
    return policy


def deletion_policy(obj: Mapping[str, Any]) -> DeletionPolicy | None:
    """The object's deletion policy, or None when its spec does not say a valid one."""
    try:
        return _policy(_spec(obj))
    except InvalidArgumentError:
        return None


def parse_topic(obj: Mapping[str, Any]) -> TopicSpec:
    spec = _spec(obj)
    name = _name(spec, obj, "topic")
    queues = spec.get("queues", 8)
    if not isinstance(queues, int) or isinstance(queues, bool) or not 1 <= queues <= MAX_QUEUES:
        raise InvalidArgumentError(
            field="spec.queues", rule=f"must be an integer from 1 to {MAX_QUEUES}, got {queues!r}"
        )
    perm = spec.get("perm", "rw")
    if perm not in PERMS:
        raise InvalidArgumentError(field="spec.perm", rule=f"{perm!r} is not one of: rw, r, w")
    cluster = spec.get("cluster") or None
    if cluster is not None and not isinstance(cluster, str):
        raise InvalidArgumentError(field="spec.cluster", rule="must be a string")
    message_type = spec.get("messageType", MessageType.MIXED.value)
    if message_type not in MESSAGE_TYPE_NAMES:  # exactly as the schema's enum: capitals
        raise InvalidArgumentError(
            field="spec.messageType",
            rule=f"{message_type!r} is not one of: {', '.join(MESSAGE_TYPE_NAMES)}",
        )
    return TopicSpec(name, queues, PERMS[perm], cluster, _policy(spec), MessageType(message_type))


def parse_group(obj: Mapping[str, Any]) -> GroupSpec:
    spec = _spec(obj)
    name = _name(spec, obj, "consumer group", MAX_GROUP_LENGTH)
    mode: ConsumeMode = _enum(spec, "consumeMode", ConsumeMode, ConsumeMode.CLUSTERING)
    start: ConsumeFrom = _enum(spec, "consumeFrom", ConsumeFrom, ConsumeFrom.LATEST)
    stamp = spec.get("consumeTimestamp")
    stamp_ms: int | None = None
    if start is ConsumeFrom.TIMESTAMP:
        if not isinstance(stamp, str) or not stamp:
            raise InvalidArgumentError(
                field="spec.consumeTimestamp",
                rule="is required with consumeFrom: timestamp (RFC 3339, e.g. "
                "2026-11-26T08:00:00Z)",
            )
        try:
            when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            raise InvalidArgumentError(
                field="spec.consumeTimestamp", rule=f"{stamp!r} is not an RFC 3339 time"
            ) from None
        if when.tzinfo is None:
            raise InvalidArgumentError(
                field="spec.consumeTimestamp", rule=f"{stamp!r} has no time zone (add Z)"
            )
        stamp_ms = int(when.timestamp() * 1000)
    topics = spec.get("topics", [])
    if not isinstance(topics, list) or len(topics) > MAX_GROUP_TOPICS:
        raise InvalidArgumentError(
            field="spec.topics", rule=f"must be a list of at most {MAX_GROUP_TOPICS} topic names"
        )
    for i, topic in enumerate(topics):
        if not isinstance(topic, str) or not TOPIC_NAME_RE.fullmatch(topic):
            raise InvalidArgumentError(
                field=f"spec.topics[{i}]", rule=f"{topic!r} is not a topic name"
            )
    return GroupSpec(name, mode, start, stamp_ms, tuple(dict.fromkeys(topics)), _policy(spec))
