"""What every request reaches through ``request.app.state.console``: the settings, the cluster,
the series source, the sessions, the users, the login limits and password checks, the metrics,
and the audit log."""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from apogee.common.errors import ApogeeError
from apogee.rpc.security import ClientSecurity, service_security
from apogee_console.core.access import AccessKeys, ConsoleUsers, Session, SessionStore
from apogee_console.core.cluster import ClusterView
from apogee_console.core.logins import LoginLimits, PasswordChecks
from apogee_console.core.prometheus import PrometheusSource
from apogee_console.core.sampling import Sampler
from apogee_console.metrics import ConsoleMetrics
from apogee_console.settings import ConsoleSettings

T = TypeVar("T")

audit_log = logging.getLogger("apogee.audit")

#: The user of every request when no login is required.
OPEN_USER: Final = "anonymous"


def audit_line(user: str, role: str, via: str, action: str, target: str, outcome: str) -> None:
    """One line on ``apogee.audit``: who (user, role, how they logged in), what, on what, and
    how it ended."""
    audit_log.info(
        "console user=%s role=%s via=%s action=%s target=%s outcome=%s",
        user,
        role,
        via,
        action,
        target,
        outcome,
    )


class Console:
    def __init__(
        self,
        settings: ConsoleSettings,
        clock: Callable[[], float] = time.time,
        security: ClientSecurity | None = None,
        metrics: ConsoleMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.metrics = metrics or ConsoleMetrics()
        self.security = security if security is not None else service_security(settings)
        self.cluster = ClusterView(settings.namesrv, self.security, settings.request_timeout_s)
        self.sessions = SessionStore(
            settings.session_ttl_s,
            clock,
            per_user=settings.sessions_per_user,
            limit=settings.max_sessions,
        )
        self.login_limits = LoginLimits(
            user_failures=settings.login_user_failures,
            address_failures=settings.login_address_failures,
            window_s=settings.login_window_s,
            lockout_s=settings.login_lockout_s,
            lockout_max_s=settings.login_lockout_max_s,
            clock=clock,
        )
        self.password_checks = PasswordChecks()
        self.users = (
            ConsoleUsers(settings.console_users_file) if settings.console_users_file else None
        )
        self.keys = (
            AccessKeys(settings.auth_users_file)
            if settings.auth_enabled and settings.auth_users_file
            else None
        )
        self.prometheus = (
            PrometheusSource(settings.prometheus_url, settings.request_timeout_s, clock)
            if settings.prometheus_url
            else None
        )
        self.sampler = Sampler(self.cluster, settings.sample_interval_s, clock=clock)
        #: every visitor's session when no login is required (its CSRF token is the process's)
        self.open_session = Session(
            token="",
            csrf=secrets.token_urlsafe(32),
            user=OPEN_USER,
            role="admin",
            expires_at=math.inf,
            via="open",
        )

    @property
    def login_required(self) -> bool:
        return self.settings.login_required

    async def start(self) -> None:
        if self.prometheus is None:
            self.sampler.start()

    async def stop(self) -> None:
        await self.sampler.stop()
        if self.prometheus is not None:
            await self.prometheus.close()
        await self.cluster.close()
        self.password_checks.close()

    def audit(self, session: Session, action: str, target: str, outcome: str) -> None:
        audit_line(session.user, session.role, session.via, action, target, outcome)

    async def audited(self, session: Session, action: str, target: str, op: Awaitable[T]) -> T:
        """``op``, with an audit line of its outcome."""
        try:
            result = await op
        except ApogeeError as err:
            self.audit(session, action, target, f"failed {err.kind.name}: {err}")
            raise
        except Exception as err:
            self.audit(session, action, target, f"failed {type(err).__name__}")
            raise
        self.audit(session, action, target, "ok")
        return result
