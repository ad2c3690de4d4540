"""A broker's replica group (docs/replication.md) as the JSON the API answers.

:func:`replica_group_view` is one :class:`~apogee.client.admin.ReplicaGroupStatus`: who leads, at
which epoch, with which ``acks`` and ``min_insync_replicas``, the high watermark, the in-sync
set (and ``in_sync_count`` of ``replica_count``), and each replica's role, log end and lag. A
lone broker is a group of one with ``replicated`` false. :func:`unknown_broker` is the 404 of
a name no nameserver lists as a live broker.
"""

from __future__ import annotations

from collections.abc import Iterable

from apogee.client.admin import BrokerInfo, ReplicaGroupStatus, ReplicaStatus
from apogee.common.errors import NotFoundError
from apogee_console.core.views import Json


def replica_view(r: ReplicaStatus) -> Json:
    """One replica: ``reachable`` false (with ``error``) when it did not answer."""
    return {
        "id": r.replica_id,
        "address": r.address,
        "role": r.role or None,
        "in_sync": r.in_sync,
        "log_end": r.log_end,
        "lag_bytes": r.lag_bytes,
        "lag_seconds": r.lag_seconds,
        "eligible": r.eligible,
        "reachable": r.reachable,
        "error": None if r.error is None else str(r.error),
    }


def replica_group_view(g: ReplicaGroupStatus) -> Json:
    """The group of one broker name (see the module docstring)."""
    return {
        "name": g.broker_name,
        "cluster": g.cluster,
        "replicated": g.replicated,
        "leader_id": g.leader_id or None,
        "leader_address": g.leader_address or None,
        "epoch": g.epoch,
        "acks": g.acks or None,
        "min_insync_replicas": g.min_insync_replicas,
        "high_watermark": g.high_watermark,
        "log_end": g.log_end,
        "in_sync": list(g.in_sync),
        "in_sync_count": g.in_sync_count,
        "replica_count": len(g.replicas),
        "replicas": [replica_view(r) for r in g.replicas],
    }


def unknown_broker(name: str, live: Iterable[BrokerInfo]) -> NotFoundError:
    names = sorted({b.broker_name for b in live})
    return NotFoundError(
        what=f"broker {name!r}",
        detail="no nameserver lists it as a live broker (live: "
        + (", ".join(names) or "none")
        + ")",
    )
