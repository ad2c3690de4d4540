"""The read routes: every GET of the API (role ``read`` or ``admin``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from apogee.common.errors import InvalidArgumentError
from apogee_console.api.deps import console, session
from apogee_console.api.fields import EpochMs, ListLimit, Offset, QueueId, SearchLimit
from apogee_console.core.prometheus import SCHEDULE_QUERY, group_lag_query, topic_rate_query
from apogee_console.core.views import Json

router = APIRouter(dependencies=[Depends(session)], tags=["read"])


@router.get("/cluster")
async def cluster(request: Request) -> Json:
    c = console(request)
    out = await c.cluster.cluster()
    out["auth"] = c.settings.auth_enabled
    out["login_required"] = c.login_required
    out["source"] = "prometheus" if c.prometheus is not None else "sampling"
    return out


@router.get("/brokers/{name}/replicas")
async def broker_replicas(name: str, request: Request) -> Json:
    """The replica group serving broker ``name``: leader, epoch, acks, min in-sync replicas,
    high watermark, in-sync set, and each replica's role and lag. A lone broker answers
    ``replicated`` false (a group of one); a name no nameserver lists, 404."""
    return await console(request).cluster.replicas(name)


@router.get("/topics")
async def topics(request: Request) -> list[Json]:
    c = console(request)
    rates = {name: s.last() for name, s in c.sampler.store.all("topic_rate").items()}
    return await c.cluster.topics(rates)


@router.get("/topics/{name}")
async def topic(name: str, request: Request) -> Json:
    c = console(request)
    out = await c.cluster.topic(name)
    out["rate_per_s"] = c.sampler.store.last("topic_rate", name)
    return out


@router.get("/groups")
async def groups(request: Request) -> list[Json]:
    c = console(request)
    return [
        {
            "name": g.group,
            "members": g.members,
            "mode": g.mode,
            "topics": list(g.topics),
            "brokers": list(g.brokers),
            "lag_messages": _int(c.sampler.store.last("group_lag", g.group)),
        }
        for g in await c.cluster.groups()
    ]


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


@router.get("/groups/{name}")
async def group(name: str, request: Request) -> Json:
    return await console(request).cluster.group(name)


@router.get("/messages/{message_id}")
async def message(
    message_id: str,
    request: Request,
    topic: str | None = None,
    broker: str | None = None,
    queue_id: Annotated[QueueId | None, Query()] = None,
    queue_offset: Annotated[Offset | None, Query()] = None,
) -> Json:
    """The message stored with this id; where it is stored more than once (a dead-letter copy
    beside the original, a send stored twice), the copy in ``topic`` (``broker``, ``queue_id``,
    ``queue_offset``: the first copy matching all that are given), by default the original;
    ``other_copies`` says where the others are."""
    return await console(request).cluster.message(
        message_id, topic=topic, broker=broker, queue_id=queue_id, queue_offset=queue_offset
    )


@router.get("/messages")
async def messages(
    request: Request,
    response: Response,
    topic: str,
    key: str | None = None,
    begin_ms: Annotated[EpochMs | None, Query()] = None,
    end_ms: Annotated[EpochMs, Query()] = 0,
    limit: Annotated[SearchLimit, Query()] = 64,
) -> list[Json]:
    """By key (``key``, optionally within ``begin_ms``..``end_ms``), or every message stored in
    ``begin_ms``..``end_ms`` (0: now); newest first, at most ``limit``. The ``X-More`` header
    is ``true`` when the window holds more."""
    c = console(request).cluster
    if key is not None:
        found = await c.by_key(topic, key, begin_ms or 0, end_ms, limit)
    elif begin_ms is None:
        raise InvalidArgumentError(field="begin_ms", rule="give key, or begin_ms (epoch ms)")
    else:
        found = await c.between(topic, begin_ms, end_ms, limit)
    result: list[Json] = found["messages"]
    response.headers["X-More"] = "true" if found["more"] else "false"
    return result


@router.get("/dlq/{group}")
async def dead_letters(
    group: str, request: Request, limit: Annotated[ListLimit, Query()] = 100
) -> list[Json]:
    return await console(request).cluster.dead_letters(group, limit)


@router.get("/transactions")
async def transactions(
    request: Request,
    group: str = "",
    topic: str = "",
    limit: Annotated[ListLimit, Query()] = 100,
) -> list[Json]:
    return await console(request).cluster.pending(group, topic, limit)


@router.get("/schedule")
async def schedule(request: Request) -> list[Json]:
    return await console(request).cluster.schedule()


Minutes = Annotated[float, Query(gt=0, le=60 * 24 * 7)]


@router.get("/metrics/topics/{name}/rate")
async def topic_rate(name: str, request: Request, minutes: Minutes = 60) -> Json:
    c = console(request)
    if c.prometheus is not None:
        return await c.prometheus.query_range(topic_rate_query(name), minutes, name)
    return c.sampler.chart("topic_rate", name, minutes)


@router.get("/metrics/groups/{name}/lag")
async def group_lag(name: str, request: Request, minutes: Minutes = 60) -> Json:
    c = console(request)
    if c.prometheus is not None:
        return await c.prometheus.query_range(group_lag_query(name), minutes, name)
    return c.sampler.chart("group_lag", name, minutes)


@router.get("/metrics/schedule/backlog")
async def schedule_backlog(request: Request, minutes: Minutes = 60) -> Json:
    c = console(request)
    if c.prometheus is not None:
        return await c.prometheus.query_range(SCHEDULE_QUERY, minutes, None)
    return c.sampler.chart("schedule_backlog", None, minutes)
