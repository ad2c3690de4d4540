"""What one reconcile decided, and the ``Ready`` condition it reports.

A reconcile returns an :class:`Outcome`: the status to write (``None``: leave it), whether to
add or remove the finalizer, and whether the failure is worth a retry before the next resync
(brokers unavailable: yes; a spec the brokers refuse: no, it waits for the resource to change).
The status follows the Kubernetes conventions: ``observedGeneration`` is the generation the
status describes, and ``conditions`` holds one ``Ready`` condition whose
``lastTransitionTime`` moves only when its status does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

JSON = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Outcome:
    status: JSON | None = None
    add_finalizer: bool = False
    remove_finalizer: bool = False
    retry: bool = False


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ready_condition(obj: Mapping[str, Any], ok: bool, reason: str, message: str) -> JSON:
    """The ``Ready`` condition, its transition time kept from the object's when unchanged."""
    status = "True" if ok else "False"
    generation = int((obj.get("metadata") or {}).get("generation") or 0)
    previous = next(
        (c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"),
        None,
    )
    since = (
        previous["lastTransitionTime"]
        if previous is not None
        and previous.get("status") == status
        and previous.get("lastTransitionTime")
        else now_rfc3339()
    )
    return {
        "type": "Ready",
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": since,
    }


def status_with(obj: Mapping[str, Any], ok: bool, reason: str, message: str, **fields: Any) -> JSON:
    """A status: ``observedGeneration``, ``fields`` and the ``Ready`` condition. Fields left
    out keep the object's current values (what was last applied stays visible)."""
    current = dict(obj.get("status") or {})
    current.update(fields)
    current["observedGeneration"] = int((obj.get("metadata") or {}).get("generation") or 0)
    current["conditions"] = [ready_condition(obj, ok, reason, message)]
    return current
