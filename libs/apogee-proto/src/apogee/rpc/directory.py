"""Finding the live brokers through the nameservers, for services that work on every broker.

:class:`NameServerDirectory` asks every nameserver for its cluster info and answers the union:
a nameserver that restarted knows no broker until the next heartbeats, the others still do.
When a broker is known to several under different addresses, the most recent heartbeat wins.
Failed calls raise :class:`~apogee.common.errors.ApogeeError` (via
:func:`apogee.rpc.errors.call`); nothing else of gRPC leaks out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc.aio

from apogee.common.errors import ApogeeError, UnavailableError
from apogee.rpc.errors import call
from apogee.rpc.server import CLIENT_OPTIONS
from apogee.v1 import nameserver_pb2, nameserver_pb2_grpc

log = logging.getLogger(__name__)


class NameServerDirectory:
    """The live brokers, from the cluster info of every nameserver in ``addresses``, each call
    with ``timeout_s``."""

    def __init__(self, addresses: Sequence[str], timeout_s: float) -> None:
        self.addresses = tuple(addresses)
        self.timeout_s = timeout_s
        self._channels = {
            a: grpc.aio.insecure_channel(a, options=CLIENT_OPTIONS) for a in self.addresses
        }

    async def _one(self, address: str) -> list[nameserver_pb2.BrokerInfo]:
        stub = nameserver_pb2_grpc.NameServerStub(self._channels[address])
        resp = await call(
            f"nameserver {address}",
            stub.GetClusterInfo(nameserver_pb2.GetClusterInfoRequest(), timeout=self.timeout_s),
        )
        return list(resp.brokers)

    async def brokers(self) -> dict[str, str]:
        """``{"<cluster>/<broker name>": address}`` of every live broker any nameserver knows;
        :class:`UnavailableError` when no nameserver answers."""
        answers = await asyncio.gather(
            *(self._one(a) for a in self.addresses), return_exceptions=True
        )
        known: list[nameserver_pb2.BrokerInfo] = []
        errors: list[str] = []
        answered = False
        for address, answer in zip(self.addresses, answers, strict=True):
            if isinstance(answer, ApogeeError):
                errors.append(f"{address}: {answer}")
                continue
            if isinstance(answer, BaseException):
                raise answer
            answered = True
            known += answer
        if not answered:
            raise UnavailableError(
                what=f"every nameserver ({';'.join(self.addresses)})", detail="; ".join(errors)
            )
        for err in errors:
            log.debug("nameserver did not answer: %s", err)
        out: dict[str, str] = {}
        for b in sorted(known, key=lambda b: -b.last_heartbeat_ms):
            out.setdefault(f"{b.cluster}/{b.broker_name}", b.address)
        return out

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(grace=None)
