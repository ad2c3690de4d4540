"""The console's own Prometheus metrics (on its own registry, served on ``metrics_listen``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from apogee.service.metrics import new_registry

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)


class ConsoleMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else new_registry()
        self.requests = Counter(
            "apogee_console_requests",
            "HTTP requests answered, by route (its template, not the path) and status.",
            ("route", "method", "status"),
            registry=r,
        )
        self.latency = Histogram(
            "apogee_console_request_duration_seconds",
            "Time to answer an HTTP request, by route.",
            ("route",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.logins = Counter(
            "apogee_console_logins",
            "Login attempts, by result: ok, refused (wrong password or unknown user), locked "
            "(refused unchecked: the user or the address is locked out), busy (too many "
            "password checks at once), full (max_sessions live).",
            ("result",),
            registry=r,
        )
        self.lockouts = Counter(
            "apogee_console_login_lockouts",
            "Lock-outs begun by failed logins, by side: user (a name) or address.",
            ("side",),
            registry=r,
        )
        self.refusals = Counter(
            "apogee_console_refusals",
            "Requests refused, by reason: unauthenticated, expired, csrf, role, host (Host not "
            "allowed), origin (Origin not allowed), too_large (body over its cap), busy (large "
            "bodies queued too long).",
            ("reason",),
            registry=r,
        )
