"""Authentication and permissions, as a pure library (no gRPC).

- :mod:`~apogee.common.auth.signature`: the ``authorization`` / ``x-mq-date-time`` pair RocketMQ 5
  clients sign calls with: built (:func:`signed_metadata`) and parsed strictly.
- :mod:`~apogee.common.auth.users`: the users file (TOML): users, their topic and group rights,
  admin levels and service identities; :func:`check` and friends raise
  :class:`~apogee.common.errors.PermissionDeniedError`. :class:`Credentials` is what a client or
  service signs with.
- :mod:`~apogee.common.auth.verify`: :class:`UsersFile` (reloads on change) and
  :class:`Authenticator` (metadata in, :class:`User` out, or
  :class:`~apogee.common.errors.UnauthenticatedError`).
"""

from apogee.common.auth.signature import (
    ALGORITHM,
    AUTHORIZATION_KEY,
    DATE_TIME_KEY,
    Authorization,
    parse_authorization,
    parse_date_time,
    sign,
    signed_metadata,
)
from apogee.common.auth.users import (
    Credentials,
    User,
    Users,
    check,
    check_admin,
    check_service,
)
from apogee.common.auth.verify import Authenticator, FixedUsers, UsersFile, UsersSource

__all__ = [
    "ALGORITHM",
    "AUTHORIZATION_KEY",
    "DATE_TIME_KEY",
    "Authenticator",
    "Authorization",
    "Credentials",
    "FixedUsers",
    "User",
    "Users",
    "UsersFile",
    "UsersSource",
    "check",
    "check_admin",
    "check_service",
    "parse_authorization",
    "parse_date_time",
    "sign",
    "signed_metadata",
]
