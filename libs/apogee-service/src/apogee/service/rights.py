"""The rights of the caller of the request being served, checked where the service learns what
a request touches: :func:`require_topic`, :func:`require_group`, :func:`require_admin` and
:func:`publisher`. Free of gRPC, so a service's protocol-free core can call them; the
interceptor that authenticates each call and sets its :class:`Caller` is
:mod:`apogee.service.access`.

With authentication off no caller is set: :func:`current` is None and every check passes. A
refusal is :class:`~apogee.common.errors.PermissionDeniedError` naming the user, the resource
and the right missing, one audit line on the ``apogee.audit`` logger, and one count for the
service's metric (``on_refusal("permission")``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from apogee.common.auth import User, UsersSource, check, check_admin
from apogee.common.errors import ApogeeError, PermissionDeniedError, UnauthenticatedError

audit = logging.getLogger("apogee.audit")

RETRY_PREFIX: Final = "%RETRY%"
DLQ_PREFIX: Final = "%DLQ%"

#: ``on_refusal(reason)``: counts a refusal (``reason``: one of the authenticator's reasons,
#: or ``permission``)
OnRefusal = Callable[[str], None]


class Gatekeeper(Protocol):
    """What a :class:`Caller` needs of the interceptor that admitted it: the users file as it
    is now, and the refusal counter."""

    @property
    def users(self) -> UsersSource: ...

    @property
    def on_refusal(self) -> OnRefusal: ...


@dataclass(frozen=True, slots=True)
class Caller:
    """The signed caller of the request being served. Its rights are read from the users file
    as it is now at every check (:attr:`user`), so a right taken away applies to streams
    opened before, and a user removed from the file is refused from then on."""

    access_key: str
    method: str
    peer: str
    access: Gatekeeper

    @property
    def user(self) -> User:
        user = self.access.users.current().get(self.access_key)
        if user is None:  # the checks that read this refuse, audit and count
            raise PermissionDeniedError(
                what=f"user {self.access_key!r}",
                rule="is no longer in the users file (removed after this call began)",
            )
        return user

    def refused(self, err: ApogeeError) -> ApogeeError:
        audit_refusal(self.method, self.peer, self.access_key, err)
        self.access.on_refusal("permission")
        return err


CURRENT: ContextVar[Caller | None] = ContextVar("apogee_caller", default=None)
#: the signature failure of a call whose handler answers refusals itself (apache.rocketmq.v2)
REFUSED: ContextVar[UnauthenticatedError | None] = ContextVar("apogee_refused", default=None)


def current() -> Caller | None:
    """The caller of the request being served; None when authentication is off."""
    return CURRENT.get()


def require_signed() -> None:
    """Raise the call's signature failure, if it had one (a handler that answers refusals
    itself calls this first)."""
    err = REFUSED.get()
    if err is not None:
        raise err


def require_topic(topic: str, right: Literal["PUB", "SUB"]) -> None:
    """``right`` on ``topic`` for the current caller (see the module's docstring for retry and
    dead-letter topics)."""
    caller = CURRENT.get()
    if caller is None:
        return
    try:
        topic_right(caller.user, topic, right)
    except PermissionDeniedError as err:
        raise caller.refused(err) from None


def may_topic(topic: str, right: Literal["PUB", "SUB"]) -> bool:
    """Whether the current caller has ``right`` on ``topic`` (True without authentication)."""
    caller = CURRENT.get()
    if caller is None:
        return True
    try:
        topic_right(caller.user, topic, right)
    except PermissionDeniedError:
        return False
    return True


def require_group(group: str) -> None:
    caller = CURRENT.get()
    if caller is not None:
        try:
            check(caller.user, "group", group, "SUB")
        except PermissionDeniedError as err:
            raise caller.refused(err) from None


def require_admin(write: bool, action: str) -> None:
    caller = CURRENT.get()
    if caller is not None:
        try:
            check_admin(caller.user, write, action)
        except PermissionDeniedError as err:
            raise caller.refused(err) from None


def publisher() -> Callable[[str], bool]:
    """Whether the current caller may send to a topic, asked later (as the users file is then),
    without refusing anything: a broker hands a transaction check only to a producer session
    whose user may send to the half's topic. Always true with authentication off."""
    caller = CURRENT.get()
    if caller is None:
        return _anyone

    def may(topic: str) -> bool:
        try:
            topic_right(caller.user, topic, "PUB")
        except PermissionDeniedError:
            return False
        return True

    return may


def _anyone(_topic_name: str) -> bool:
    return True


def topic_right(user: User, topic: str, right: Literal["PUB", "SUB"]) -> None:
    for prefix in (RETRY_PREFIX, DLQ_PREFIX):
        if topic.startswith(prefix):
            if right == "PUB":
                check_admin(user, True, f"send to {topic!r}, a group's retry or dead-letter topic")
            else:
                check(user, "group", topic[len(prefix) :], "SUB")
            return
    check(user, "topic", topic, right)


def audit_refusal(method: str, peer: str, access_key: str | None, err: ApogeeError) -> None:
    """One ``apogee.audit`` line for a refused call."""
    who = f"access key {access_key!r}" if access_key else "an unsigned or unknown caller"
    audit.warning("refused %s from %s (%s): %s %s", method, who, peer, err.kind.name, err)
