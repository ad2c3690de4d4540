"""The console's one connection to the cluster: an :class:`~apogee.client.AdminClient` (the
nameservers' health, the brokers' own info and replica groups, schedule state and a queue's
offset at a time included) and a :class:`~apogee.client.Producer` for test messages (made on
first use); no channel or stub of its own. Every call is bounded by ``timeout`` seconds (per
RPC, as the SDK bounds them) and each operation as a whole by :data:`OPERATION_FACTOR` times
that.

Results are JSON-ready dicts (see :mod:`apogee_console.core.views`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, Final, TypeVar

from apogee.client import AdminClient, Message, Producer
from apogee.client.admin import BrokerInfo, LastRecovery, ReplicaGroupStatus
from apogee.client.message import DEFAULT_DELAY_LEVELS, StoredMessage
from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
)
from apogee.common.settings import parse_nameservers
from apogee.common.topics import (
    DLQ_PREFIX,
    RETRY_PREFIX,
    MessageType,
    Perm,
    is_system_topic,
    perm_text,
)
from apogee.rpc.security import ClientSecurity
from apogee_console.core.replicas import replica_group_view, unknown_broker
from apogee_console.core.views import (
    Json,
    copy_view,
    dead_letter_view,
    group_view,
    message_view,
    pending_view,
)

T = TypeVar("T")

#: An operation of several calls (cluster info, then every broker) may take this many times
#: the per-call deadline.
OPERATION_FACTOR: Final = 3.0
#: The producer group of the console's test messages.
PRODUCER_GROUP: Final = "apogee-console"
#: Seconds the list of live brokers is reused (see CachedAdminClient).
BROKERS_TTL_S: Final = 1.0
#: Topics described at once by the topic list.
DESCRIBE_CONCURRENCY: Final = 16
_PERMS: Final = {"rw": Perm.READ | Perm.WRITE, "r": Perm.READ, "w": Perm.WRITE, "none": Perm.NONE}


class CachedAdminClient(AdminClient):
    """An :class:`AdminClient` whose list of live brokers (``cluster_info``, asked of a
    nameserver before every broker call) is reused for ``ttl_s`` seconds, and asked once for
    callers that arrive together: a page or a sampling round makes many calls, and brokers
    register every few seconds anyway. A failed ask is not kept."""

    def __init__(self, *args: Any, ttl_s: float = BROKERS_TTL_S, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ttl_s = ttl_s
        self._brokers_at = -math.inf
        self._brokers_cache: list[BrokerInfo] = []
        self._inflight: asyncio.Future[list[BrokerInfo]] | None = None

    async def cluster_info(self) -> list[BrokerInfo]:
        loop = asyncio.get_running_loop()
        if loop.time() - self._brokers_at < self.ttl_s:
            return list(self._brokers_cache)
        if self._inflight is None:
            self._inflight = loop.create_future()
            try:
                found = await super().cluster_info()
            except BaseException as exc:
                self._inflight.set_exception(exc)
                self._inflight.exception()  # retrieved: no "never retrieved" warning
                raise
            else:
                self._brokers_cache, self._brokers_at = found, loop.time()
                self._inflight.set_result(found)
            finally:
                self._inflight = None
            return list(found)
        return list(await asyncio.shield(self._inflight))

    def forget_brokers(self) -> None:
        self._brokers_at = -math.inf


def delay_text(ms: int) -> str:
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def parse_perm(value: str) -> Perm:
    try:
        return _PERMS[value.lower()]
    except KeyError:
        raise InvalidArgumentError(
            field="perm", rule=f"{value!r} is not one of: {', '.join(_PERMS)}"
        ) from None


class ClusterView:
    """What the API asks of the cluster (see the module docstring)."""

    def __init__(self, namesrv: str, security: ClientSecurity, timeout: float) -> None:
        self.namesrv = parse_nameservers(namesrv)
        self.security = security
        self.timeout = timeout
        self.admin = CachedAdminClient(self.namesrv, timeout=timeout, security=security)
        self._producer: Producer | None = None
        self._producer_lock = asyncio.Lock()

    async def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.close()
        await self.admin.close()

    async def bounded(self, what: str, op: Awaitable[T]) -> T:
        """``op``, or :class:`DeadlineExceededError` after the operation's bound."""
        limit = self.timeout * OPERATION_FACTOR
        try:
            async with asyncio.timeout(limit):
                return await op
        except TimeoutError:
            raise DeadlineExceededError(what=what, timeout_s=limit) from None

    # -- cluster -------------------------------------------------------------------------------

    async def ready(self) -> bool:
        """Whether some nameserver answers."""
        return any(h.ok for h in await self.admin.nameserver_health())

    async def cluster(self) -> Json:
        nameservers = await self.admin.nameserver_health()
        brokers, groups = await self.bounded(
            "the cluster info",
            asyncio.gather(self.admin.describe_brokers(), self.admin.replica_groups()),
        )
        by_name = {g.broker.broker_name: g.value for g in groups}
        return {
            "nameservers": [{"address": h.address, "ok": h.ok} for h in nameservers],
            "brokers": [
                {
                    "name": a.broker.broker_name,
                    "cluster": a.broker.cluster,
                    "address": a.broker.address,
                    "ok": a.value is not None,
                    "version": None,
                    "last_heartbeat_ms": a.broker.last_heartbeat_ms,
                    "topics": a.broker.topic_count,
                    "flush_mode": a.value.flush_mode if a.value is not None else None,
                    "recovery": _recovery(a.value.last_recovery) if a.value is not None else None,
                    "replication": _group(by_name.get(a.broker.broker_name)),
                }
                for a in brokers
            ],
        }

    async def replicas(self, name: str) -> Json:
        """The replica group of broker ``name`` (see :mod:`apogee_console.core.replicas`);
        :class:`NotFoundError` when no nameserver lists it."""
        live = await self.bounded("the cluster info", self.admin.cluster_info())
        if name not in {b.broker_name for b in live}:
            raise unknown_broker(name, live)
        status = await self.bounded(f"broker {name!r}", self.admin.describe_broker(name))
        return replica_group_view(status)

    # -- topics --------------------------------------------------------------------------------

    async def topic_names(self) -> list[str]:
        return await self.bounded("the topic list", self.admin.list_topics())

    async def topics(self, rates: dict[str, float | None]) -> list[Json]:
        names = await self.topic_names()
        gate = asyncio.Semaphore(DESCRIBE_CONCURRENCY)

        async def one(name: str) -> Json:
            async with gate:
                try:
                    status = await self.admin.describe_topic(name)
                except ApogeeError as err:
                    if err.kind.code == "NOT_FOUND":
                        return _topic_row(name, 0, [], None, None, "gone")
                    return _topic_row(name, 0, [], None, rates.get(name), str(err))
            queues = sum(len(b.queues) for b in status.brokers)
            brokers = [b.broker_name for b in status.brokers]
            row = _topic_row(name, queues, brokers, status.messages, rates.get(name), None)
            row["message_type"] = _types_text(b.topic.message_type for b in status.brokers)
            return row

        return list(await self.bounded("the topic list", asyncio.gather(*map(one, names))))

    async def topic(self, name: str) -> Json:
        status = await self.bounded(f"topic {name!r}", self.admin.describe_topic(name))
        perms = {b.topic.perm for b in status.brokers}
        return {
            "name": name,
            "system": is_system_topic(name),
            "queues": [
                {
                    "broker": b.broker_name,
                    "queue_id": q.queue_id,
                    "min_offset": q.min_offset,
                    "max_offset": q.max_offset,
                    "last_store_ms": q.last_store_timestamp_ms,
                }
                for b in status.brokers
                for q in b.queues
            ],
            "messages": status.messages,
            "perm": perm_text(perms.pop()) if len(perms) == 1 else "mixed",
            "message_type": _types_text(b.topic.message_type for b in status.brokers),
        }

    async def offsets(self, name: str) -> dict[tuple[str, int], int]:
        """Max offset of every queue of topic ``name``, by (broker, queue)."""
        status = await self.bounded(f"topic {name!r}", self.admin.describe_topic(name))
        return {(b.broker_name, q.queue_id): q.max_offset for b in status.brokers for q in b.queues}

    async def put_topic(
        self, name: str, queues: int, perm: str | None, message_type: str | None = None
    ) -> list[Json]:
        """Create or update topic ``name`` (``message_type`` None: MIXED for a new topic, kept
        for an existing one)."""
        updates = await self.bounded(
            f"topic {name!r}",
            self.admin.create_or_update_topic(
                name,
                queues=queues,
                perm=parse_perm(perm) if perm else Perm.READ | Perm.WRITE,
                message_type=message_type,
            ),
        )
        return [
            {
                "broker": u.broker_name,
                "created": u.created,
                "queues": u.topic.write_queues,
                "perm": perm_text(u.topic.perm),
                "message_type": u.topic.message_type.value,
            }
            for u in updates
        ]

    async def delete_topic(self, name: str) -> list[str]:
        return await self.bounded(f"topic {name!r}", self.admin.delete_topic(name))

    # -- groups --------------------------------------------------------------------------------

    async def groups(self) -> list[Any]:
        return await self.bounded("the group list", self.admin.list_groups())

    async def group(self, name: str) -> Json:
        return group_view(await self.bounded(f"group {name!r}", self.admin.describe_group(name)))

    async def reset_preview(
        self, group: str, topic: str, to: str, timestamp_ms: int | None
    ) -> list[Json]:
        """Where a reset of ``group`` on ``topic`` would move each queue (nothing changes)."""
        targets: list[tuple[str, int, int]]
        if to == "timestamp":
            assert timestamp_ms is not None
            found = await self.bounded(
                f"topic {topic!r}", self.admin.offsets_for_time(topic, timestamp_ms)
            )
            targets = [(o.broker_name, o.queue_id, o.offset) for o in found]
        else:
            status = await self.bounded(f"topic {topic!r}", self.admin.describe_topic(topic))
            targets = [
                (b.broker_name, q.queue_id, q.min_offset if to == "earliest" else q.max_offset)
                for b in status.brokers
                for q in b.queues
            ]
        try:
            desc = await self.bounded(f"group {group!r}", self.admin.describe_group(group))
            current = {
                (q.broker_name, q.queue_id): q.consumer_offset
                for q in desc.queues
                if q.topic == topic
            }
        except NotFoundError:
            current = {}
        return [
            {
                "broker": broker,
                "queue_id": queue_id,
                "from": current.get((broker, queue_id)),
                "to": to_offset,
            }
            for broker, queue_id, to_offset in targets
        ]

    async def reset(self, group: str, topic: str, to: str, timestamp_ms: int | None) -> list[Json]:
        before = {
            (r["broker"], r["queue_id"]): r["from"]
            for r in await self.reset_preview(group, topic, "latest", None)
        }
        done = await self.bounded(
            f"resetting group {group!r}",
            self.admin.reset_offsets(
                group,
                topic,
                earliest=to == "earliest",
                latest=to == "latest",
                timestamp_ms=timestamp_ms if to == "timestamp" else None,
            ),
        )
        return [
            {
                "broker": r.broker_name,
                "queue_id": r.queue_id,
                "from": before.get((r.broker_name, r.queue_id)),
                "to": r.offset,
            }
            for r in done
        ]

    # -- messages ------------------------------------------------------------------------------

    async def message(
        self,
        unique_id: str,
        *,
        topic: str | None = None,
        broker: str | None = None,
        queue_id: int | None = None,
        queue_offset: int | None = None,
    ) -> Json:
        """The copy of message ``unique_id`` that matches the given ``topic``, ``broker``,
        ``queue_id`` and ``queue_offset`` (by default the original, see :func:`copy_order`),
        with ``other_copies``: where every other copy of it is stored."""
        copies = copy_order(
            await self.bounded(f"message {unique_id}", self.admin.get_messages(unique_id))
        )
        wanted = {
            "topic": topic,
            "broker": broker,
            "queue_id": queue_id,
            "queue_offset": queue_offset,
        }
        given = {k: v for k, v in wanted.items() if v is not None}
        shown = next((m for m in copies if given.items() <= copy_view(m).items()), None)
        if shown is None:
            where = "; ".join(_copy_text(m) for m in copies)
            raise NotFoundError(
                what=f"message {unique_id}",
                detail=f"no copy of it matches {_given_text(given)}; it is stored in {where}",
            )
        out = message_view(shown)
        out["other_copies"] = [copy_view(m) for m in copies if m is not shown]
        return out

    async def by_key(self, topic: str, key: str, begin_ms: int, end_ms: int, limit: int) -> Json:
        found = await self.bounded(
            f"messages of {topic!r}",
            self.admin.query_messages(topic, key, begin_ms, end_ms, max_messages=limit),
        )
        return {"messages": [message_view(m) for m in found], "more": len(found) >= limit}

    async def between(self, topic: str, begin_ms: int, end_ms: int, limit: int) -> Json:
        window = await self.bounded(
            f"messages of {topic!r}",
            self.admin.messages_between(topic, begin_ms, end_ms, max_messages=limit),
        )
        return {"messages": [message_view(m) for m in window.messages], "more": window.more}

    async def send(
        self,
        topic: str,
        body: bytes,
        tags: str,
        keys: Sequence[str],
        properties: dict[str, str],
    ) -> Json:
        producer = await self._get_producer()
        r = await self.bounded(
            f"sending to {topic!r}",
            producer.send(Message(topic, body, tags=tags, keys=tuple(keys), properties=properties)),
        )
        return {
            "id": r.message_id,
            "topic": r.topic,
            "broker": r.broker_name,
            "queue_id": r.queue_id,
            "queue_offset": r.queue_offset,
            "status": r.status.value,
        }

    async def _get_producer(self) -> Producer:
        async with self._producer_lock:
            if self._producer is None:
                self._producer = Producer(
                    self.namesrv,
                    PRODUCER_GROUP,
                    send_timeout=self.timeout,
                    security=self.security,
                )
            return self._producer

    # -- dead letters and transactions ---------------------------------------------------------

    async def dead_letters(self, group: str, limit: int) -> list[Json]:
        found = await self.bounded(
            f"dead letters of {group!r}", self.admin.list_dead_letters(group, limit=limit)
        )
        return [dead_letter_view(d) for d in found]

    async def redrive(
        self,
        group: str,
        key: str | None,
        tag: str | None,
        topic: str | None,
        since_ms: int,
        dry_run: bool,
    ) -> Json:
        # a redrive sends at its own pace: bounded by the SDK's per-call deadlines only
        r = await self.admin.redrive_dead_letters(
            group, key=key, tag=tag, topic=topic, since_ms=since_ms, dry_run=dry_run
        )
        return {
            "redriven": r.sent,
            "matched": r.matched,
            "failed": r.failed,
            "dry_run": r.dry_run,
            "items": [
                {
                    "id": i.old_id,
                    "origin_topic": i.origin_topic,
                    "new_id": i.new_id or None,
                    "error": i.error or None,
                }
                for i in r.items
            ],
        }

    async def pending(self, group: str, topic: str, limit: int) -> list[Json]:
        found = await self.bounded(
            "pending transactions",
            self.admin.list_pending_transactions(group, topic, max_entries=limit),
        )
        return [pending_view(p) for p in found]

    async def resolve(self, transaction_id: str, commit: bool, operator: str) -> Json:
        r = await self.bounded(
            f"transaction {transaction_id}",
            self.admin.resolve_transaction(transaction_id, commit=commit, operator=operator),
        )
        return {
            "id": r.transaction_id,
            "broker": r.broker_name,
            "outcome": r.outcome,
            "topic": r.topic or None,
            "queue_id": r.queue_id if r.queue_id >= 0 else None,
            "queue_offset": r.queue_offset if r.queue_offset >= 0 else None,
        }

    # -- schedule ------------------------------------------------------------------------------

    async def schedule(self) -> list[Json]:
        """Delayed and timer messages waiting, by delay level over every broker (level
        ``"timer"``: the timer wheel); the brokers that did not answer are left out."""
        answers = await self.bounded("the cluster info", self.admin.schedule_states())
        delays: dict[str, int | None] = {}
        backlog: dict[str, int] = {}
        for state in (a.value for a in answers):
            if state is None:
                continue
            for i, d in enumerate(state.delay_ms):
                delays[str(i + 1)] = d
            if state.slots:
                delays["timer"] = None
            for q in state.queues:
                number = state.level_of(q.queue_id)
                if number is not None:
                    level = str(number)
                    delays[level] = state.delay_ms[q.queue_id]
                elif state.is_timer_queue(q.queue_id):
                    level = "timer"
                    delays[level] = None
                else:
                    continue
                backlog[level] = backlog.get(level, 0) + q.waiting
        if not delays:  # no broker answered, or none has a schedule topic yet
            for i, text in enumerate(DEFAULT_DELAY_LEVELS):
                delays[str(i + 1)] = _parse_delay(text)
        rows = [
            {
                "level": int(level) if level.isdigit() else level,
                "delay": delay_text(d) if d is not None else "timer",
                "delay_ms": d,
                "backlog": backlog.get(level, 0),
            }
            for level, d in delays.items()
        ]
        rows.sort(key=lambda r: (isinstance(r["level"], str), r["level"]))
        return rows


def _parse_delay(text: str) -> int:
    unit = {"s": 1000, "m": 60_000, "h": 3_600_000}[text[-1]]
    return int(text[:-1]) * unit


def copy_order(copies: Sequence[StoredMessage]) -> list[StoredMessage]:
    """Copies of one message id, the original first: those in an ordinary topic, then in a
    retry topic, then in a dead-letter topic, then in a system topic; the oldest first within
    each."""

    def rank(m: StoredMessage) -> tuple[int, int]:
        if m.topic.startswith(RETRY_PREFIX):
            kind = 1
        elif m.topic.startswith(DLQ_PREFIX):
            kind = 2
        elif is_system_topic(m.topic):
            kind = 3
        else:
            kind = 0
        return kind, m.store_timestamp_ms

    return sorted(copies, key=rank)


def _copy_text(m: StoredMessage) -> str:
    return f"topic {m.topic!r} ({m.broker_name}, queue {m.queue_id}, offset {m.queue_offset})"


def _given_text(given: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v!r}" for k, v in given.items())


def _recovery(r: LastRecovery) -> Json:
    return {
        "finished_ms": r.finished_ms,
        "clean": r.clean,
        "files_checked": r.files_checked,
        "records_checked": r.records_checked,
        "bytes_truncated": r.bytes_truncated,
        "files_quarantined": list(r.files_quarantined),
        "entries_redispatched": r.entries_redispatched,
        "seconds": r.seconds,
        "summary": r.summary,
    }


def _group(g: ReplicaGroupStatus | None) -> Json | None:
    return None if g is None else replica_group_view(g)


def _types_text(types: Iterable[MessageType]) -> str:
    """A topic's message type; its brokers' types joined by ``/`` when an update reached only
    some of them (``FIFO/MIXED``)."""
    found = set(types)
    return "/".join(t.value for t in MessageType if t in found)


def _topic_row(
    name: str,
    queues: int,
    brokers: list[str],
    messages: int | None,
    rate: float | None,
    error: str | None,
) -> Json:
    return {
        "name": name,
        "system": is_system_topic(name),
        "queues": queues,
        "brokers": brokers,
        "messages": messages,
        "rate_per_s": rate,
        "error": error,
        "message_type": None,  # the caller's, when it could describe the topic
    }
