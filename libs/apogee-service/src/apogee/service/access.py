"""Who may call what: every request authenticated, and the right each method needs checked.

:class:`Access`, a server interceptor a service installs when ``auth_enabled`` is on, reads the
``authorization`` and ``x-mq-date-time`` metadata of each call (the form RocketMQ 5 clients sign
with, :mod:`apogee.common.auth`), and refuses an unsigned or badly signed call as
``UNAUTHENTICATED`` before any handler runs. A signed call runs with its :class:`Caller` in a
context variable, and the method's rule (:data:`RULES`) checks what the request asks for:

- data rights: ``PUB`` on the topics it sends to, ``SUB`` on the topics and the consumer group it
  reads as (a group's retry and dead-letter topics, ``%RETRY%<group>`` and ``%DLQ%<group>``, are
  read with ``SUB`` on the group, and only admins with the write right may send to them: that is
  what redriving dead letters does);
- admin rights: ``read`` to list and describe, ``write`` to create and delete topics, reset
  offsets, redrive dead letters and resolve transactions;
- the service identity: registering brokers, and the calls of the schedule service and the
  transaction checker.

What a rule cannot see in the request (the topics packed in a send's records, the topic of the
transaction an end names) is checked where the broker learns it, with
:func:`~apogee.service.rights.require_topic` and friends (:mod:`apogee.service.rights`, free of
gRPC) on the calling context's user. Every refusal is ``PERMISSION_DENIED`` naming the
user, the resource and the right missing, one audit line on the ``apogee.audit`` logger, and
one count for the service's metric. The health service stays open: probes do not sign.

The official RocketMQ 5 clients' protocol (``apache.rocketmq.v2``, :data:`ANSWERING_PREFIXES`)
answers refusals in its own ``Status`` (``UNAUTHORIZED``, ``FORBIDDEN``), which its clients act
on, rather than as a gRPC status: for its methods the interceptor never aborts. An unsigned or
badly signed call runs with the error in :data:`~apogee.service.rights.REFUSED` (audited and
counted here), which the handler raises first (:func:`~apogee.service.rights.
require_signed`); a signed one runs with its caller, and the handler checks each topic and
group it serves with :func:`~apogee.service.rights.require_topic` and
:func:`~apogee.service.rights.require_group`.

With authentication off (no :class:`Access`), :func:`~apogee.service.rights.current` is None
and every check passes.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import grpc
import grpc.aio

from apogee.common.auth import (
    Authenticator,
    User,
    UsersFile,
    UsersSource,
    check,
    check_admin,
    check_service,
)
from apogee.common.errors import ApogeeError, PermissionDeniedError, UnauthenticatedError
from apogee.rpc.errors import abort
from apogee.rpc.handlers import rewrap
from apogee.rpc.mux import ENVELOPE_RULE
from apogee.service.rights import (
    CURRENT,
    REFUSED,
    Caller,
    OnRefusal,
    audit_refusal,
    topic_right,
)

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]
    Handler = grpc.RpcMethodHandler[Any, Any]

#: methods every caller may use unsigned: Kubernetes' and the images' probes
OPEN_PREFIXES: Final = ("/grpc.health.v1.Health/",)
#: methods that answer a refusal in their response rather than with a gRPC status
ANSWERING_PREFIXES: Final = ("/apache.rocketmq.v2.MessagingService/",)


# -- the rules ---------------------------------------------------------------------------------

Rule = Callable[[User, Any], None]


def _service(action: str) -> Rule:
    def rule(user: User, _request: Any) -> None:
        check_service(user, action)

    return rule


def _admin(write: bool, action: str) -> Rule:
    def rule(user: User, _request: Any) -> None:
        check_admin(user, write, action)

    return rule


def _signed(_user: User, _request: Any) -> None:
    """Any signed caller (what the request names is checked where it is served)."""


def _route(user: User, request: Any) -> None:
    # a route serves sending and receiving alike: either right will do
    if not (user.may("topic", request.topic, "PUB") or user.may("topic", request.topic, "SUB")):
        check(user, "topic", request.topic, "SUB")


def _reads(user: User, request: Any) -> None:
    topic_right(user, request.topic, "SUB")


def _group(user: User, request: Any) -> None:
    check(user, "group", request.group, "SUB")


def _group_and_topics(topics: Callable[[Any], Iterable[str]]) -> Rule:
    def rule(user: User, request: Any) -> None:
        check(user, "group", request.group, "SUB")
        for topic in set(topics(request)):
            topic_right(user, topic, "SUB")

    return rule


def _pull(user: User, request: Any) -> None:
    check(user, "group", request.group, "SUB")
    topic_right(user, request.topic, "SUB")


def _describe_group(user: User, request: Any) -> None:
    # a group's own consumers may look at it; others need the admin read right
    if not user.may("group", request.group, "SUB"):
        check_admin(user, False, f"describe group {request.group!r}")


def _query_messages(user: User, request: Any) -> None:
    if not user.may_admin(False):
        topic_right(user, request.topic, "SUB")


def _sends(user: User, request: Any) -> None:
    for topic in {m.topic for m in request.messages}:
        topic_right(user, topic, "PUB")


def _half(user: User, request: Any) -> None:
    topic_right(user, request.message.topic, "PUB")


def _session(user: User, request: Any) -> None:
    if request.HasField("heartbeat"):
        beat = request.heartbeat
        check(user, "group", beat.group, "SUB")
        for topic in {s.topic for s in beat.subscriptions}:
            topic_right(user, topic, "SUB")


def _deliver(user: User, request: Any) -> None:
    if request.group:
        check(user, "group", request.group, "SUB")
    for topic in {s.topic for s in request.subscribe}:
        topic_right(user, topic, "SUB")


_V1 = "/apogee.v1."
#: method -> the rule its requests (each message, on a request stream) must pass. A method
#: missing here is refused to all but service identities.
RULES: Final[Mapping[str, Rule]] = {
    # nameserver
    f"{_V1}NameServer/RegisterBroker": _service("register a broker"),
    f"{_V1}NameServer/UnregisterBroker": _service("unregister a broker"),
    f"{_V1}NameServer/GetRoute": _route,
    f"{_V1}NameServer/GetClusterInfo": _signed,
    f"{_V1}NameServer/ListTopics": _admin(False, "list topics"),
    # sending: PUB on the records' topics is checked as the broker reads them
    f"{_V1}Broker/SendMessages": _signed,
    f"{_V1}Broker/SendStream": _signed,
    f"{_V1}Broker/GetMessage": _admin(False, "look a message up by id"),
    f"{_V1}Broker/QueryMessages": _query_messages,
    f"{_V1}BrokerAdmin/PutTopic": _admin(True, "create or update topics"),
    f"{_V1}BrokerAdmin/DeleteTopic": _admin(True, "delete topics"),
    f"{_V1}BrokerAdmin/ListTopics": _admin(False, "list topics"),
    f"{_V1}BrokerAdmin/DescribeTopic": _admin(False, "describe topics"),
    f"{_V1}BrokerAdmin/GetBrokerInfo": _admin(False, "read broker information"),
    # consuming
    f"{_V1}Consumer/PullStream": _signed,  # each pull: ENVELOPE_RULE
    f"{_V1}Consumer/Deliver": _deliver,
    f"{_V1}Consumer/Session": _session,
    f"{_V1}Consumer/GetMembers": _group,
    f"{_V1}Consumer/CommitOffsets": _group_and_topics(lambda r: (o.topic for o in r.offsets)),
    f"{_V1}Consumer/QueryOffsets": _group_and_topics(lambda r: (r.topic,)),
    f"{_V1}Consumer/GetQueueOffsets": _reads,
    f"{_V1}Consumer/LockQueues": _group_and_topics(lambda r: (q.topic for q in r.queues)),
    f"{_V1}Consumer/UnlockQueues": _group_and_topics(lambda r: (q.topic for q in r.queues)),
    f"{_V1}Consumer/SendBack": _group_and_topics(lambda r: (i.topic for i in r.items)),
    f"{_V1}ConsumerAdmin/ListGroups": _admin(False, "list groups"),
    f"{_V1}ConsumerAdmin/DescribeGroup": _describe_group,
    f"{_V1}ConsumerAdmin/ResetOffsets": _admin(True, "reset a group's offsets"),
    # transactions: an end's topic is checked where the broker finds its half
    f"{_V1}Transaction/SendHalf": _half,
    f"{_V1}Transaction/SendHalves": _sends,
    f"{_V1}Transaction/EndTransaction": _signed,
    f"{_V1}Transaction/EndTransactions": _signed,
    f"{_V1}Transaction/ProducerSession": _signed,
    f"{_V1}TransactionCheck/ListPending": _admin(False, "list pending transactions"),
    f"{_V1}TransactionCheck/GetTransactionState": _service("check transactions"),
    f"{_V1}TransactionCheck/ScanHalf": _service("check transactions"),
    f"{_V1}TransactionCheck/ScanOps": _service("check transactions"),
    f"{_V1}TransactionCheck/CheckHalf": _service("check transactions"),
    f"{_V1}TransactionCheck/CommitTransactionProgress": _service("check transactions"),
    # the schedule service
    f"{_V1}Schedule/GetScheduleState": _admin(False, "read the schedule's state"),
    f"{_V1}Schedule/Scan": _service("deliver delayed messages"),
    f"{_V1}Schedule/Resolve": _service("deliver delayed messages"),
    f"{_V1}Schedule/CommitProgress": _service("deliver delayed messages"),
}

#: the rule of each request a multiplexed stream carries, by the stream method
ENVELOPE_RULES: Final[Mapping[str, Rule]] = {
    f"{_V1}Consumer/PullStream": _pull,
}


def _unlisted(method: str) -> Rule:
    return _service(f"call {method}")


# -- the interceptor ---------------------------------------------------------------------------


class Access(grpc.aio.ServerInterceptor):
    """See the module's docstring. ``on_refusal(reason)`` counts each refusal."""

    def __init__(
        self,
        users: UsersSource,
        on_refusal: OnRefusal,
        max_skew_s: float = 900.0,
        rules: Mapping[str, Rule] = RULES,
        envelope_rules: Mapping[str, Rule] = ENVELOPE_RULES,
    ) -> None:
        self.users = users
        self.on_refusal = on_refusal
        self._auth = Authenticator(users, max_skew_s)
        self._rules = rules
        self._envelope_rules = envelope_rules

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        answering = method.startswith(ANSWERING_PREFIXES)
        try:
            user = self._auth.authenticate(handler_call_details.invocation_metadata or ())
        except UnauthenticatedError as err:
            return _wrap(handler, _Refuse(self, method, err, answering))
        if answering:  # the handler checks what each request names
            return _wrap(handler, _Admit(self, method, user.access_key, _signed, None))
        rule = self._rules.get(method) or _unlisted(method)
        envelope = self._envelope_rules.get(method)
        return _wrap(handler, _Admit(self, method, user.access_key, rule, envelope))

    def refused_unsigned(self, method: str, peer: str, err: ApogeeError) -> None:
        audit_refusal(method, peer, None, err)
        self.on_refusal(str(err.details.get("reason", "malformed")))


class _Refuse:
    """A call whose signature failed: answered with the error, its handler never run."""

    def __init__(
        self, access: Access, method: str, err: UnauthenticatedError, answering: bool = False
    ) -> None:
        self.access, self.method, self.err = access, method, err
        #: the handler runs and answers the refusal itself (REFUSED holds it)
        self.answering = answering

    async def enter(self, context: Context, request: Any) -> None:
        self.access.refused_unsigned(self.method, context.peer(), self.err)
        if self.answering:
            REFUSED.set(self.err)
            return
        await abort(context, self.err)


class _Admit:
    """A signed call: the caller set for the handler, the method's rule checked."""

    def __init__(
        self, access: Access, method: str, access_key: str, rule: Rule, envelope: Rule | None
    ) -> None:
        self.access, self.method, self.access_key = access, method, access_key
        self.rule, self.envelope = rule, envelope

    def caller(self, context: Context) -> Caller:
        return Caller(self.access_key, self.method, context.peer(), self.access)

    async def enter(self, context: Context, request: Any) -> None:
        caller = self.caller(context)
        if request is not _STREAM:
            try:
                self.rule(caller.user, request)
            except PermissionDeniedError as err:
                await abort(context, caller.refused(err))
        CURRENT.set(caller)
        if self.envelope is not None:
            ENVELOPE_RULE.set(_envelope_check(caller, self.envelope))

    def check_message(self, context: Context, message: Any) -> None:
        """A request stream's message: a refusal ends the stream with the error."""
        caller = self.caller(context)
        try:
            self.rule(caller.user, message)
        except PermissionDeniedError as err:
            raise caller.refused(err) from None


def _envelope_check(caller: Caller, rule: Rule) -> Callable[[Any], None]:
    def check_one(request: Any) -> None:
        try:
            rule(caller.user, request)
        except PermissionDeniedError as err:
            raise caller.refused(err) from None

    return check_one


_STREAM = object()


def _wrap(h: Handler, gate: _Refuse | _Admit) -> Handler:
    return rewrap(h, lambda b: _unary(b, gate), lambda b: _streaming(b, gate))


def _unary(behavior: Callable[..., Any], gate: _Refuse | _Admit) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def gen(request: Any, context: Context) -> AsyncIterator[Any]:
            await gate.enter(context, request)
            async for item in behavior(request, context):
                yield item

        return gen

    async def call(request: Any, context: Context) -> Any:
        await gate.enter(context, request)
        return await behavior(request, context)

    return call


def _streaming(behavior: Callable[..., Any], gate: _Refuse | _Admit) -> Callable[..., Any]:
    """A request stream: the caller checked once, each message by the method's rule (the
    first refused one ends the call with its error, as a malformed message does)."""

    async def checked(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(gate, _Admit):  # else a refusal the handler answers itself
                gate.check_message(context, request)
            yield request

    if inspect.isasyncgenfunction(behavior):

        async def gen(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            await gate.enter(context, _STREAM)
            try:
                async for item in behavior(checked(requests, context), context):
                    yield item
            except PermissionDeniedError as err:
                await abort(context, err)

        return gen

    async def call(requests: AsyncIterator[Any], context: Context) -> Any:
        await gate.enter(context, _STREAM)
        try:
            return await behavior(checked(requests, context), context)
        except PermissionDeniedError as err:
            await abort(context, err)

    return call


def access_from(settings: object, on_refusal: OnRefusal) -> Access | None:
    """The :class:`Access` a service's settings ask for (``auth_enabled``, ``auth_users_file``,
    ``auth_max_skew_s``), or None when authentication is off. A users file that cannot be
    read or parsed fails the start."""
    if not getattr(settings, "auth_enabled", False):
        return None
    users = UsersFile(Path(str(getattr(settings, "auth_users_file", ""))))
    users.current()
    return Access(users, on_refusal, float(getattr(settings, "auth_max_skew_s", 900.0)))


def interceptors_from(settings: object, on_refusal: OnRefusal) -> list[grpc.aio.ServerInterceptor]:
    """The server interceptors a service's settings ask for: :class:`Access` when
    authentication is on, none otherwise."""
    access = access_from(settings, on_refusal)
    return [] if access is None else [access]
