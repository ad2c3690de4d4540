"""Cluster and topic administration, and message lookups.

:class:`AdminClient` (asyncio; :class:`~apogee.client.SyncAdminClient` is its synchronous
twin) learns the live brokers from any reachable nameserver and talks to them directly:

- :meth:`~AdminClient.cluster_info`, :meth:`~AdminClient.list_topics` ask a nameserver,
  :meth:`~AdminClient.nameserver_health` checks each nameserver's health;
- :meth:`~AdminClient.describe_brokers` asks every broker what it says of itself (flush mode,
  CommitLog bounds, last recovery: :meth:`~AdminClient.last_recoveries`),
  :meth:`~AdminClient.schedule_states` what delayed and timer messages it holds
  (:mod:`apogee.client.admin_info`);
- :meth:`~AdminClient.describe_broker` shows a broker's replica group (who leads, at which
  epoch, each replica's lag; a lone broker is a group of one), :meth:`~AdminClient.replica_groups`
  every broker's, and :meth:`~AdminClient.elect` hands a group's leadership to an in-sync
  follower (:mod:`apogee.client.replicas`);
- :meth:`~AdminClient.create_or_update_topic` puts the topic config (queues, permissions, the
  type of messages it accepts) on every broker of the cluster (or the ones named),
  :meth:`~AdminClient.delete_topic` removes it from every broker that has it,
  :meth:`~AdminClient.list_topic_configs` lists every topic with its config on each broker,
  :meth:`~AdminClient.describe_topic` gathers each broker's config, queues and offsets,
  :meth:`~AdminClient.offsets_for_time` finds a time in each of its queues;
- :meth:`~AdminClient.get_message` asks every broker at once and returns the first hit,
  :meth:`~AdminClient.query_messages` (by key) and :meth:`~AdminClient.messages_between`
  (by time alone) ask them all and merge, newest first (:mod:`apogee.client.admin_messages`);
- :meth:`~AdminClient.list_groups` and :meth:`~AdminClient.describe_group` gather what every
  broker knows of the consumer groups (members, committed offsets, lag; for groups that
  official RocketMQ 5 clients consume by POP, the clients connected and the messages in
  flight),
  :meth:`~AdminClient.reset_offsets` moves a group's offsets of a topic on every broker,
  :meth:`~AdminClient.commit_offsets` sets them queue by queue
  (:mod:`apogee.client.admin_offsets`);
- :meth:`~AdminClient.list_dead_letters` and :meth:`~AdminClient.redrive_dead_letters` read a
  group's dead-letter topic and send its messages again (:mod:`apogee.client.dlq`).

A question put to every broker either raises (a lookup that needs them all) or answers one
:class:`~apogee.client.admin_info.BrokerAnswer` per broker, with the error of each broker that
did not answer (a status page that shows what it can).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from apogee.client import admin_info, admin_messages, admin_offsets, dlq, replicas, txn_admin
from apogee.client._rpc import ChannelPool, NameServerClient, parse_addresses, rpc
from apogee.client.admin_info import (
    BrokerAnswer,
    BrokerDetails,
    BrokerInfo,
    LastRecovery,
    NameServerHealth,
    ScheduleQueue,
    ScheduleState,
    TopicListing,
    all_or_first_error,
    drop_not_found,
    on_each,
)
from apogee.client.admin_messages import MAX_QUERY_MESSAGES, MessageWindow
from apogee.client.admin_offsets import QueueOffset
from apogee.client.dlq import DeadLetter, DeadLetterFilter, RedriveResult
from apogee.client.groups import (
    GroupDescription,
    GroupMember,
    GroupSummary,
    MemberSubscription,
    OfficialClientInfo,
    QueueLag,
    ResetOffset,
    check_group_name,
    merge_descriptions,
    merge_group_lists,
)
from apogee.client.message import StoredMessage, check_text
from apogee.client.producer.routes import MessageQueue
from apogee.client.replicas import Election, ReplicaGroupStatus, ReplicaStatus
from apogee.client.txn_admin import PendingTransaction, Resolved
from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
    UnknownTopicError,
)
from apogee.common.topics import (
    READ_WRITE,
    MessageType,
    Perm,
    TopicConfig,
    is_system_topic,
    validate_topic,
)
from apogee.rpc.security import ClientSecurity
from apogee.v1 import broker_pb2, common_pb2, consumer_pb2, nameserver_pb2

MAX_QUEUES = 1024

__all__ = [
    "MAX_QUERY_MESSAGES",
    "READ_WRITE",
    "AdminClient",
    "BrokerAnswer",
    "BrokerDetails",
    "BrokerInfo",
    "BrokerTopicStatus",
    "Election",
    "GroupDescription",
    "GroupMember",
    "GroupSummary",
    "LastRecovery",
    "MemberSubscription",
    "MessageQueue",
    "MessageType",
    "MessageWindow",
    "NameServerHealth",
    "OfficialClientInfo",
    "PendingTransaction",
    "Perm",
    "QueueLag",
    "QueueOffset",
    "QueueStatus",
    "ReplicaGroupStatus",
    "ReplicaStatus",
    "ResetOffset",
    "Resolved",
    "ScheduleQueue",
    "ScheduleState",
    "TopicConfig",
    "TopicListing",
    "TopicStatus",
    "TopicUpdate",
]


@dataclass(frozen=True, slots=True)
class TopicUpdate:
    """The outcome of :meth:`AdminClient.create_or_update_topic` on one broker."""

    broker_name: str
    topic: TopicConfig
    created: bool


@dataclass(frozen=True, slots=True)
class QueueStatus:
    queue_id: int
    min_offset: int
    max_offset: int
    last_store_timestamp_ms: int

    @property
    def messages(self) -> int:
        return self.max_offset - self.min_offset


@dataclass(frozen=True, slots=True)
class BrokerTopicStatus:
    broker_name: str
    address: str
    topic: TopicConfig
    queues: tuple[QueueStatus, ...]


@dataclass(frozen=True, slots=True)
class TopicStatus:
    """A topic on every broker that has it."""

    name: str
    brokers: tuple[BrokerTopicStatus, ...]

    @property
    def messages(self) -> int:
        """Messages currently kept, all brokers and queues together."""
        return sum(q.messages for b in self.brokers for q in b.queues)


def _check_topic_name(name: str) -> None:
    validate_topic(name)
    if is_system_topic(name):
        raise PermissionDeniedError(
            what=f"topic {name!r}", rule="is a system topic; clients cannot change it"
        )


def _check_broker_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(field="broker_name", rule=f"must name a broker, got {name!r}")
    return name


class AdminClient:
    """Administration over gRPC; use as ``async with AdminClient("host:9876") as admin``."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        timeout: float = 3.0,
        *,
        security: ClientSecurity | None = None,
    ) -> None:
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise InvalidArgumentError(
                field="timeout", rule=f"must be a number above 0, got {timeout!r}"
            )
        self.timeout = float(timeout)
        self._pool = ChannelPool(security)
        self._namesrv = NameServerClient(parse_addresses(namesrv), self._pool, self.timeout)

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._pool.close()

    # -- nameservers -------------------------------------------------------------------------

    async def cluster_info(self) -> list[BrokerInfo]:
        """The live brokers, by cluster and name."""
        resp = await self._namesrv.call(
            "cluster info",
            lambda s: s.GetClusterInfo(
                nameserver_pb2.GetClusterInfoRequest(), timeout=self.timeout
            ),
        )
        brokers = [
            BrokerInfo(
                b.cluster,
                b.broker_name,
                b.address,
                b.last_heartbeat_ms,
                b.topic_count,
                b.auto_create_topics,
            )
            for b in resp.brokers
        ]
        return sorted(brokers, key=lambda b: (b.cluster, b.broker_name))

    async def list_topics(self) -> list[str]:
        """Every topic some live broker has, sorted."""
        resp = await self._namesrv.call(
            "topic list",
            lambda s: s.ListTopics(nameserver_pb2.ListTopicsRequest(), timeout=self.timeout),
        )
        return sorted(resp.topics)

    async def list_topic_configs(self) -> list[TopicListing]:
        """Every topic the live brokers have (system topics left out), sorted by name, with its
        config on each: queues, permissions and the type of messages it accepts."""
        return await admin_info.topic_listings(self._pool, await self.cluster_info(), self.timeout)

    async def nameserver_health(self) -> list[NameServerHealth]:
        """Whether each nameserver this client was given answers its gRPC health check as
        SERVING within ``timeout``, in the order given. Never raises for a nameserver that is
        down: its ``ok`` is False."""
        return await admin_info.nameserver_health(
            self._namesrv.addresses, self._pool.security, self.timeout
        )

    # -- brokers -----------------------------------------------------------------------------

    async def _brokers(self, names: Sequence[str] | None = None) -> list[BrokerInfo]:
        live = await self.cluster_info()
        if not live:
            raise UnavailableError(
                what="the cluster", detail="no live broker is registered with the nameservers"
            )
        if names is None:
            return live
        if isinstance(names, str):
            names = [names]
        by_name = {b.broker_name: b for b in live}
        for name in names:
            if name not in by_name:
                raise InvalidArgumentError(
                    field="brokers",
                    rule=f"{name!r} is not a live broker (live: {', '.join(sorted(by_name))})",
                )
        return [by_name[n] for n in dict.fromkeys(names)]

    async def describe_brokers(
        self, brokers: Sequence[str] | None = None
    ) -> list[BrokerAnswer[BrokerDetails]]:
        """What every live broker (or each one named) says of itself: its flush mode, its
        CommitLog's bounds, its topic count and its last recovery. One answer per broker, in
        :meth:`cluster_info`'s order (none when no broker is live); a broker that does not
        answer has ``value`` None and its ``error``. Raises only when a name given is not live
        or no nameserver answers."""
        targets = await (self.cluster_info() if brokers is None else self._brokers(brokers))
        return await admin_info.answers(
            targets, lambda b: admin_info.broker_details(self._pool, b, self.timeout)
        )

    async def last_recoveries(self) -> list[LastRecovery]:
        """Each live broker's last recovery report (when its store was last opened), sorted by
        broker name. Raises the first broker's error when one does not answer."""
        targets = await self._brokers()
        found = all_or_first_error(
            await on_each(targets, lambda b: admin_info.broker_details(self._pool, b, self.timeout))
        )
        return sorted((d.last_recovery for d in found), key=lambda r: r.broker_name)

    async def schedule_states(self) -> list[BrokerAnswer[ScheduleState]]:
        """The delayed and timer messages each live broker holds: its delay levels, and each
        queue of its schedule topic with the schedule service's progress there (see
        :class:`~apogee.client.admin_info.ScheduleState`). One answer per broker, in
        :meth:`cluster_info`'s order (none when no broker is live); a broker that does not
        answer has ``value`` None and its ``error``."""
        targets = await self.cluster_info()
        return await admin_info.answers(
            targets, lambda b: admin_info.schedule_state(self._pool, b, self.timeout)
        )

    async def describe_broker(self, broker_name: str) -> ReplicaGroupStatus:
        """The replica group of the live broker ``broker_name``: its leader, epoch, acks,
        in-sync set and high watermark, and each replica's role, log end and lag (a follower
        that does not answer is reported with ``reachable`` False, not raised). A lone broker
        is a group of one with ``replicated`` False. Raises when the name is not live or the
        address the nameservers list does not answer."""
        [broker] = await self._brokers([_check_broker_name(broker_name)])
        return await replicas.describe_group(self._pool, broker, self.timeout)

    async def replica_groups(self) -> list[BrokerAnswer[ReplicaGroupStatus]]:
        """:meth:`describe_broker` of every live broker: one answer per broker, in
        :meth:`cluster_info`'s order (none when no broker is live); a broker that does not
        answer has ``value`` None and its ``error``."""
        targets = await self.cluster_info()
        return await admin_info.answers(
            targets, lambda b: replicas.describe_group(self._pool, b, self.timeout)
        )

    async def elect(self, broker_name: str, replica_id: str = "") -> Election:
        """Hand the leadership of ``broker_name``'s replica group to the in-sync follower
        ``replica_id`` ("": the most caught-up one), a controlled switch: returns the new
        ``(epoch, leader_id, leader_address)``. A lone broker raises
        :class:`~apogee.common.errors.UnsupportedError`; a follower that is not in sync, or
        unknown, is refused by the leader. Waits at least
        :data:`~apogee.client.replicas.ELECT_TIMEOUT_S` (the follower catches up first)."""
        name = _check_broker_name(broker_name)
        target = replicas.check_replica_id(replica_id)
        [broker] = await self._brokers([name])
        return await replicas.elect(self._pool, broker, target, self.timeout)

    # -- topics ------------------------------------------------------------------------------

    async def create_or_update_topic(
        self,
        name: str,
        queues: int = 8,
        perm: Perm | int = READ_WRITE,
        brokers: Sequence[str] | None = None,
        cluster: str | None = None,
        message_type: MessageType | str | None = None,
    ) -> list[TopicUpdate]:
        """Create ``name`` with ``queues`` read and write queues (or set them, and ``perm``) on
        the named ``brokers``, by default on every live broker of ``cluster`` (which may be
        left out when there is one cluster). ``message_type`` (a :class:`MessageType` or its
        name, any case): the messages it accepts; None creates a MIXED topic (every type) and
        leaves an existing topic's type as it is."""
        _check_topic_name(name)
        wire_type = admin_info.wire_message_type(message_type)
        if not isinstance(queues, int) or isinstance(queues, bool) or not 1 <= queues <= MAX_QUEUES:
            raise InvalidArgumentError(
                field="queues", rule=f"must be an integer from 1 to {MAX_QUEUES}, got {queues!r}"
            )
        if not isinstance(perm, int) or not 0 <= int(perm) <= 7:
            raise InvalidArgumentError(
                field="perm", rule=f"must be a set of Perm bits (0 to 7), got {perm!r}"
            )
        targets = await self._brokers(brokers)
        if brokers is None:
            clusters = sorted({b.cluster for b in targets})
            if cluster is not None:
                targets = [b for b in targets if b.cluster == cluster]
                if not targets:
                    raise InvalidArgumentError(
                        field="cluster",
                        rule=f"{cluster!r} has no live broker (clusters: {', '.join(clusters)})",
                    )
            elif len(clusters) > 1:
                raise InvalidArgumentError(
                    field="cluster",
                    rule=f"several clusters are registered ({', '.join(clusters)}); name one",
                )
        config = common_pb2.TopicConfig(
            name=name,
            read_queues=queues,
            write_queues=queues,
            perm=int(perm),
            message_type=wire_type,
        )

        async def put(b: BrokerInfo) -> TopicUpdate:
            resp = await rpc(
                b.where,
                self._pool.broker_admin(b.address).PutTopic(
                    broker_pb2.PutTopicRequest(topic=config), timeout=self.timeout
                ),
            )
            return TopicUpdate(b.broker_name, TopicConfig.from_pb(resp.topic), resp.created)

        outcomes = await on_each(targets, put)
        return all_or_first_error(outcomes)

    async def delete_topic(self, name: str, brokers: Sequence[str] | None = None) -> list[str]:
        """Delete ``name`` from every live broker that has it (or the named ones). Returns the
        names of the brokers it was deleted from."""
        _check_topic_name(name)
        targets = await self._brokers(brokers)

        async def delete(b: BrokerInfo) -> str:
            await rpc(
                b.where,
                self._pool.broker_admin(b.address).DeleteTopic(
                    broker_pb2.DeleteTopicRequest(topic=name), timeout=self.timeout
                ),
            )
            return b.broker_name

        outcomes = await on_each(targets, delete)
        deleted = all_or_first_error(drop_not_found(outcomes))
        if not deleted:
            raise UnknownTopicError(topic=name, detail="is not on any live broker")
        return sorted(deleted)

    async def describe_topic(self, name: str) -> TopicStatus:
        """The topic's config and per-queue min/max offsets on every broker that has it."""
        validate_topic(name)
        targets = await self._brokers()

        async def describe(b: BrokerInfo) -> BrokerTopicStatus:
            resp = await rpc(
                b.where,
                self._pool.broker_admin(b.address).DescribeTopic(
                    broker_pb2.DescribeTopicRequest(topic=name), timeout=self.timeout
                ),
            )
            queues = tuple(
                QueueStatus(q.queue_id, q.min_offset, q.max_offset, q.last_store_timestamp_ms)
                for q in sorted(resp.queues, key=lambda q: q.queue_id)
            )
            return BrokerTopicStatus(
                resp.broker_name or b.broker_name,
                b.address,
                TopicConfig.from_pb(resp.topic),
                queues,
            )

        outcomes = await on_each(targets, describe)
        found = all_or_first_error(drop_not_found(outcomes))
        if not found:
            raise UnknownTopicError(topic=name, detail="is not on any live broker")
        return TopicStatus(name, tuple(sorted(found, key=lambda s: s.broker_name)))

    async def offsets_for_time(self, topic: str, timestamp_ms: int) -> list[QueueOffset]:
        """For every queue of ``topic`` on every broker that has it, the first offset whose
        message was stored at or after ``timestamp_ms`` (epoch ms), or the queue's max offset
        when every message is older: where :meth:`reset_offsets` with ``timestamp_ms`` moves a
        group. Sorted by broker and queue; raises the first error of a broker that fails."""
        validate_topic(topic)
        admin_offsets.check_timestamp(timestamp_ms)
        status = await self.describe_topic(topic)
        queues = [(b.broker_name, b.address, q.queue_id) for b in status.brokers for q in b.queues]
        return await admin_offsets.offsets_for_time(
            self._pool, topic, queues, timestamp_ms, self.timeout
        )

    # -- messages ----------------------------------------------------------------------------

    async def get_message(self, unique_id: str) -> StoredMessage:
        """The message with this unique id (message id), from whichever broker has it."""
        admin_messages.check_unique_id(unique_id)
        targets = await self._brokers()
        return await admin_messages.first_by_id(self._pool, targets, unique_id, self.timeout)

    async def get_messages(self, unique_id: str) -> list[StoredMessage]:
        """Every message stored with this unique id, on every broker, newest first: usually
        one, more where a retried send was stored twice (sends are at-least-once)."""
        admin_messages.check_unique_id(unique_id)
        targets = await self._brokers()
        return await admin_messages.all_by_id(self._pool, targets, unique_id, self.timeout)

    async def query_messages(
        self, topic: str, key: str, begin_ms: int = 0, end_ms: int = 0, max_messages: int = 64
    ) -> list[StoredMessage]:
        """Messages of ``topic`` with ``key`` stored between ``begin_ms`` and ``end_ms``
        (0: now), from every broker, newest first, at most ``max_messages``."""
        if not isinstance(key, str) or not key or " " in key:
            raise InvalidArgumentError(field="key", rule=f"{key!r} must be non-empty, no spaces")
        check_text("key", key)
        found, _ = await self._query(topic, key, begin_ms, end_ms, max_messages)
        return found

    async def messages_between(
        self, topic: str, begin_ms: int, end_ms: int = 0, max_messages: int = 64
    ) -> MessageWindow:
        """Every message of ``topic`` stored between ``begin_ms`` and ``end_ms`` (0: now), from
        every broker, newest first: at most ``max_messages``, and whether the window holds more
        (then the newest were answered; narrow the window to see the rest)."""
        found, more = await self._query(topic, "", begin_ms, end_ms, max_messages)
        return MessageWindow(found, more)

    async def _query(
        self, topic: str, key: str, begin_ms: int, end_ms: int, max_messages: int
    ) -> tuple[list[StoredMessage], bool]:
        admin_messages.check_query(topic, begin_ms, end_ms, max_messages)
        targets = await self._brokers()
        request = broker_pb2.QueryMessagesRequest(
            topic=topic, key=key, begin_ms=begin_ms, end_ms=end_ms, max_messages=max_messages
        )
        return await admin_messages.query(self._pool, targets, request, self.timeout)

    # -- transactions ------------------------------------------------------------------------

    async def list_pending_transactions(
        self, group: str = "", topic: str = "", max_entries: int = 100
    ) -> list[PendingTransaction]:
        """Transactions no one has decided yet, on every broker, oldest first: halves still
        being checked and those that ran out of checks (``checking`` False)."""
        brokers = [(b.broker_name, b.address) for b in await self._brokers()]
        return await txn_admin.list_pending(
            self._pool, brokers, self.timeout, group, topic, max_entries
        )

    async def resolve_transaction(
        self, transaction_id: str, *, commit: bool, operator: str = "operator"
    ) -> Resolved:
        """End a pending transaction by hand: ``commit`` stores its message once, else it is
        rolled back. :class:`~apogee.common.errors.NotFoundError` when no broker holds it."""
        brokers = [(b.broker_name, b.address) for b in await self._brokers()]
        return await txn_admin.resolve(
            self._pool, brokers, self.timeout, transaction_id, commit, operator
        )

    # -- consumer groups ---------------------------------------------------------------------

    async def list_groups(self) -> list[GroupSummary]:
        """Every group that some live broker knows (members online or offsets committed),
        merged over the brokers, sorted by name."""
        targets = await self._brokers()

        async def ask(b: BrokerInfo) -> tuple[str, consumer_pb2.ListGroupsResponse]:
            resp = await rpc(
                b.where,
                self._pool.consumer_admin(b.address).ListGroups(
                    consumer_pb2.ListGroupsRequest(), timeout=self.timeout
                ),
            )
            return b.broker_name, resp

        answers = all_or_first_error(await on_each(targets, ask))
        return merge_group_lists(answers)

    async def describe_group(self, group: str) -> GroupDescription:
        """``group``'s members and, per queue of every broker, its committed offset and lag;
        for a group consumed by POP, the official clients connected to each broker and, per
        queue, the messages in flight. Brokers that do not answer are named in ``warnings``;
        when none answers, or none knows the group, this raises."""
        check_group_name(group)
        targets = await self._brokers()
        request = consumer_pb2.DescribeGroupRequest(group=group)

        async def ask(b: BrokerInfo) -> consumer_pb2.DescribeGroupResponse:
            resp = await rpc(
                b.where,
                self._pool.consumer_admin(b.address).DescribeGroup(request, timeout=self.timeout),
            )
            if not resp.broker_name:
                resp.broker_name = b.broker_name
            return resp

        outcomes = await on_each(targets, ask)
        answers: list[consumer_pb2.DescribeGroupResponse] = []
        failures: list[str] = []
        for b, outcome in zip(targets, outcomes, strict=True):
            if isinstance(outcome, ApogeeError):
                if outcome.kind.code != "NOT_FOUND":
                    failures.append(f"broker {b.broker_name} did not answer: {outcome}")
            elif outcome.members or outcome.queues or outcome.clients or outcome.consumption:
                answers.append(outcome)
        if not answers:
            first_error = next((o for o in outcomes if isinstance(o, ApogeeError)), None)
            if failures and first_error is not None:
                raise first_error
            raise NotFoundError(
                what=f"group {group!r}",
                detail="no live broker knows it (no member online, no offset committed)",
            )
        return merge_descriptions(group, answers, failures)

    async def reset_offsets(
        self,
        group: str,
        topic: str,
        *,
        earliest: bool = False,
        latest: bool = False,
        timestamp_ms: int | None = None,
    ) -> list[ResetOffset]:
        """Move ``group``'s committed offsets of every queue of ``topic``, on every broker that
        has it, to the earliest message kept, the end of the queue (skip everything), or the
        first message stored at or after ``timestamp_ms``; exactly one of the three. The
        group's connected consumers continue from there."""
        check_group_name(group)
        validate_topic(topic)
        request = admin_offsets.reset_request(group, topic, earliest, latest, timestamp_ms)
        targets = await self._brokers()
        return await admin_offsets.reset(self._pool, targets, request, self.timeout)

    async def commit_offsets(
        self,
        group: str,
        offsets: Mapping[MessageQueue, int],
        *,
        client_id: str = "apogee-admin",
    ) -> list[QueueOffset]:
        """Set ``group``'s committed offset of each queue named in ``offsets`` (a queue ->
        the offset of the next message to consume), on the broker of each queue, as a
        consumer commits: for a reader that keeps its own progress (a Spark stream) and wants
        the group's lag to show it. ``client_id`` names the committer. Returns what was
        committed, sorted by broker, topic and queue; when a broker is not live or fails, the
        others commit and an :class:`~apogee.common.errors.UnavailableError` names it (run it
        again), or its error is raised when that is not retriable."""
        check_group_name(group)
        by_broker = admin_offsets.check_offsets(offsets)
        if not by_broker:
            return []
        live = await self._brokers()
        return await admin_offsets.commit(
            self._pool, live, group, by_broker, client_id, self.timeout
        )

    # -- dead letters ------------------------------------------------------------------------

    async def list_dead_letters(
        self,
        group: str,
        *,
        key: str | None = None,
        tag: str | None = None,
        topic: str | None = None,
        since_ms: int = 0,
        limit: int = 100,
    ) -> list[DeadLetter]:
        """Up to ``limit`` messages of ``group``'s dead-letter topic (every broker), oldest
        first, that have ``key``, ``tag``, the original ``topic`` and were dead-lettered at or
        after ``since_ms`` (those given). Nothing is consumed or committed."""
        flt = DeadLetterFilter(key=key, tag=tag, topic=topic, since_ms=since_ms)
        return await dlq.list_dead_letters(
            self._pool, self._namesrv, group, flt, limit, self.timeout
        )

    async def redrive_dead_letters(
        self,
        group: str,
        *,
        key: str | None = None,
        tag: str | None = None,
        topic: str | None = None,
        since_ms: int = 0,
        rate: float = 100.0,
        dry_run: bool = False,
    ) -> RedriveResult:
        """Send ``group``'s dead letters that match (as :meth:`list_dead_letters`) to their
        original topics again, at most ``rate`` per second, each with its old id in property
        ``ORIGIN_MSG_ID``; ``dry_run`` only lists them. The dead letters stay where they are."""
        flt = DeadLetterFilter(key=key, tag=tag, topic=topic, since_ms=since_ms)
        return await dlq.redrive(self._pool, self._namesrv, group, flt, rate, dry_run, self.timeout)
