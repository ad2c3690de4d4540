"""What the operator counts, read by its metrics (:mod:`apogee_operator.metrics`)."""

from __future__ import annotations

from collections import Counter

from apogee_operator.core.outcome import Outcome


class OperatorStats:
    """Reconciles by kind and result, since the process started (active or not)."""

    def __init__(self) -> None:
        #: (kind, result) -> reconciles; result: ready, not_ready, retry, deleted
        self.reconciles: Counter[tuple[str, str]] = Counter()

    def count(self, kind: str, outcome: Outcome) -> None:
        if outcome.remove_finalizer:
            result = "deleted"
        elif outcome.retry:
            result = "retry"
        elif outcome.status is not None and _ready(outcome.status):
            result = "ready"
        else:
            result = "not_ready"
        self.reconciles[(kind, result)] += 1


def _ready(status: dict[str, object]) -> bool:
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )
