"""The channel a service's session calls one broker on.

A service that works on every broker (schedule, the transaction checker) has one client per
broker: a subclass of :class:`BrokerClient` that adds the stubs of the broker's services it
calls and turns their answers into the service's own model. Each call has the deadline
``timeout_s`` and goes through :func:`apogee.rpc.errors.call` with :attr:`BrokerClient.what` (the
broker, for the errors it raises); nothing of gRPC leaks out. :meth:`BrokerClient.factory`
makes the clients as the service's settings say.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Self

from apogee.rpc.security import PLAIN, ClientSecurity, service_security
from apogee.rpc.server import CLIENT_OPTIONS
from apogee.service.leader_settings import LeaderServiceSettings


class BrokerClient:
    """The channel to the broker at ``address`` (over TLS and signed as ``security`` says);
    each call with ``timeout_s``."""

    def __init__(self, address: str, timeout_s: float, security: ClientSecurity = PLAIN) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = security.channel(address, CLIENT_OPTIONS)
        #: names the broker in the errors of failed calls
        self.what = f"broker {address}"

    @classmethod
    def factory(cls, settings: LeaderServiceSettings) -> Callable[[str], Self]:
        """Address -> client, as a service's settings say: each call within ``rpc_timeout_s``,
        over TLS and signed when they say so (:func:`apogee.rpc.security.service_security`)."""
        timeout_s = settings.rpc_timeout_s
        security = service_security(settings)
        return lambda address: cls(address, timeout_s, security)

    async def close(self) -> None:
        await self.channel.close(grace=None)
