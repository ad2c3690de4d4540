"""Finding the live brokers through the nameservers, for services that work on every broker.

:class:`NameServerDirectory` asks every nameserver for its cluster info and answers the union:
a nameserver that restarted knows no broker until the next heartbeats, the others still do.
When a broker is known to several under different addresses, the most recent heartbeat wins.
Failed calls raise :class:`~apogee.common.errors.ApogeeError` (via
:func:`apogee.rpc.errors.call`); nothing else of gRPC leaks out.

:class:`DirectoryWorkers` keeps one :class:`~apogee.service.workers.BrokerWorker` per live broker:
the broker list is read at start and then every ``refresh_s`` (every second while none is
known, so that a service started before its brokers finds them at once), and
:class:`~apogee.service.workers.BrokerWorkers` matches the workers to it: a new broker gets a
worker, a broker gone from every nameserver has its worker stopped, a broker that moved is
served again at its new address. When no nameserver answers, the current brokers are kept (a
WARNING says so once, an INFO when they answer again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from apogee.common.errors import ApogeeError, UnavailableError
from apogee.rpc.errors import call
from apogee.rpc.security import PLAIN, ClientSecurity, service_security
from apogee.rpc.server import CLIENT_OPTIONS
from apogee.service.leader_settings import LeaderServiceSettings
from apogee.service.loops import BackgroundLoop
from apogee.service.workers import BrokerWorker, BrokerWorkers, Session
from apogee.v1 import nameserver_pb2, nameserver_pb2_grpc

log = logging.getLogger(__name__)

#: How often the broker list is read while it is empty.
EMPTY_REFRESH_S = 1.0

S = TypeVar("S", bound=Session)


class NameServerDirectory:
    """The live brokers, from the cluster info of every nameserver in ``addresses``, each call
    with ``timeout_s`` (over TLS and signed as ``security`` says)."""

    def __init__(
        self, addresses: Sequence[str], timeout_s: float, security: ClientSecurity = PLAIN
    ) -> None:
        self.addresses = tuple(addresses)
        self.timeout_s = timeout_s
        self._channels = {a: security.channel(a, CLIENT_OPTIONS) for a in self.addresses}

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


class DirectoryWorkers(Generic[S]):
    """One worker per live broker of the nameservers at ``addresses`` (each call with
    ``timeout_s``), made by ``new_worker(broker, address)``; ``grace_s`` is what each stopping
    worker's session gets. ``await start()`` reads the brokers and follows them;
    ``await stop()`` stops every worker, bounded. The lines about the nameservers go to
    ``logger`` (the service's; this module's by default); ``security``: how the nameservers are
    called (TLS, signing)."""

    def __init__(
        self,
        addresses: Sequence[str],
        timeout_s: float,
        refresh_s: float,
        new_worker: Callable[[str, str], BrokerWorker[S]],
        grace_s: float,
        logger: logging.Logger = log,
        security: ClientSecurity = PLAIN,
    ) -> None:
        self.addresses = tuple(addresses)
        self.security = security
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.log = logger
        self._directory: NameServerDirectory | None = None
        self._workers: BrokerWorkers[S] = BrokerWorkers(new_worker, grace_s)
        self._discovery: Discovery | None = None
        self._nameservers_down = False

    @classmethod
    def from_settings(
        cls,
        settings: LeaderServiceSettings,
        new_worker: Callable[[str, str], BrokerWorker[S]],
        logger: logging.Logger = log,
    ) -> DirectoryWorkers[S]:
        """As a leader-elected service's settings say: its nameservers, each call within
        ``rpc_timeout_s``, the list read every ``broker_refresh_s``, ``shutdown_grace_s`` for
        each stopping worker, over TLS and signed when they say so
        (:func:`apogee.rpc.security.service_security`)."""
        return cls(
            settings.nameservers,
            settings.rpc_timeout_s,
            settings.broker_refresh_s,
            new_worker,
            settings.shutdown_grace_s,
            logger,
            service_security(settings),
        )

    @property
    def workers(self) -> dict[str, BrokerWorker[S]]:
        """Broker -> its worker."""
        return self._workers.workers

    async def start(self) -> None:
        self._directory = NameServerDirectory(self.addresses, self.timeout_s, self.security)
        await self.refresh()
        self._discovery = Discovery(self, self.refresh_s)
        self._discovery.start()

    async def refresh(self) -> None:
        """Read the brokers from the nameservers and start or stop workers to match."""
        assert self._directory is not None
        try:
            brokers = await self._directory.brokers()
        except Exception as err:
            if not self._nameservers_down:
                self.log.warning(
                    "cannot read the brokers (keeping %d): %s",
                    len(self.workers),
                    err,
                    exc_info=None if isinstance(err, ApogeeError) else err,
                )
            self._nameservers_down = True
            return
        if self._nameservers_down:
            self.log.info("nameservers answer again")
            self._nameservers_down = False
        await self._workers.sync(brokers)

    async def stop(self) -> None:
        if self._discovery is not None:
            await self._discovery.stop()
            self._discovery = None
        await self._workers.stop()
        if self._directory is not None:
            await self._directory.close()
            self._directory = None


class Discovery(BackgroundLoop):
    """Reads the broker list again every ``interval_s`` (see the module docstring)."""

    name = "broker discovery"

    def __init__(self, workers: DirectoryWorkers[Any], interval_s: float) -> None:
        super().__init__(self._failed)
        self._workers = workers
        self._interval_s = interval_s

    def _failed(self, exc: BaseException) -> None:  # pragma: no cover - refresh never raises
        self._workers.log.error("broker discovery stopped: %r", exc)

    async def _run(self) -> None:
        while True:
            # while no broker is known (a service started before its brokers), look every
            # second, so that the brokers' first work does not wait a whole interval
            idle = not self._workers.workers
            await asyncio.sleep(
                min(self._interval_s, EMPTY_REFRESH_S) if idle else self._interval_s
            )
            await self._workers.refresh()
