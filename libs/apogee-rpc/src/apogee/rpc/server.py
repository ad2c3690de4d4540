"""Starting and stopping a grpc.aio server the same way in every service.

:class:`GrpcServer` adds the standard health service (``grpc.health.v1``, which Kubernetes
probes natively), binds the listen address (port 0 picks a free port; the bound one is
returned), and stops gracefully: health goes NOT_SERVING, new calls are refused, calls in flight
get ``grace`` seconds. :func:`run_until_signal` runs a service until SIGTERM or SIGINT.

With a :class:`~apogee.rpc.tls.ServerTls` the port serves TLS only (certificates reloaded when
their files change, see :mod:`apogee.rpc.tls`); without, plaintext. Every server runs the
:class:`~apogee.rpc.malformed.MalformedRequests` interceptor first, then the ones it is given.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from apogee.common.errors import InvalidArgumentError
from apogee.common.threads import name_os_threads
from apogee.rpc.malformed import MalformedRequests
from apogee.rpc.tls import ClientTls, ServerTls, open_channel, server_credentials

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
#: Options for every client channel of Apogee (SDK, broker to nameserver, CLI). Reconnection
#: first waits 100 ms (gRPC's default is 1 s: a replica that becomes leader serves on the same
#: port within moments of its follower server stopping, and clients of it would idle a second)
#: and backs off to at most 2 s (gRPC's default grows to 120 s, so a peer that restarted could
#: stay unreachable for minutes), and each channel keeps its own connections, so one channel's
#: backoff after a failure does not hold back a fresh channel to the same address. (The minimum
#: backoff is left alone: gRPC also uses it as the connect timeout.)
CLIENT_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.use_local_subchannel_pool", 1),
]


class GrpcServer:
    """A grpc.aio server on ``listen`` named ``name`` (in logs and errors), over TLS when
    ``tls`` is given, with ``interceptors`` after :class:`MalformedRequests`."""

    def __init__(
        self,
        listen: str,
        name: str,
        tls: ServerTls | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.listen = listen
        self.name = name
        self.tls = tls
        self.server = grpc.aio.server(
            options=OPTIONS, interceptors=[MalformedRequests(), *interceptors]
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0

    def bind(self) -> int:
        """Bind the listen address without serving yet; returns the bound port. For services
        that must know their port before they can build what they serve (a broker's advertised
        address is stamped into every record it stores). With TLS, the files are read and
        checked here: :class:`~apogee.common.errors.InvalidArgumentError` names the setting
        at fault."""
        if self.port == 0:
            credentials = server_credentials(self.tls) if self.tls is not None else None
            try:
                if credentials is None:
                    self.port = self.server.add_insecure_port(self.listen)
                else:
                    self.port = self.server.add_secure_port(self.listen, credentials)
            except RuntimeError as exc:  # grpc's way of saying the address is taken or invalid
                raise OSError(
                    f"{self.name} cannot listen on {self.listen}: the address is in use or invalid"
                ) from exc
            if self.port == 0:
                raise OSError(f"{self.name} cannot listen on {self.listen}")
        return self.port

    async def start(self, services: list[str]) -> int:
        """Bind (unless :meth:`bind` did), start, and mark ``services`` (and the server as a
        whole) SERVING."""
        self.bind()
        await self.server.start()
        for svc in ["", *services]:
            await self.health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s listening on port %d%s", self.name, self.port, " (TLS)" if self.tls else "")
        return self.port

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def run_until_signal(
    start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]
) -> None:
    """Run ``start``, wait for SIGTERM or SIGINT, then run ``stop``. Once started, the
    process's threads get their names at the operating system's level too
    (:func:`~apogee.common.threads.name_os_threads`: ``top -H`` tells them apart)."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await start()
    name_os_threads()
    try:
        await stopping.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await stop()


async def check_health(
    address: str, timeout: float, service: str = "", tls: ClientTls | None = None
) -> bool:
    """Whether the server at ``address`` answers SERVING within ``timeout`` seconds (over TLS
    when ``tls`` is given)."""
    async with open_channel(address, tls) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            reply = await check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve_process(
    what: str, start: Callable[[], Awaitable[object]], stop: Callable[[], Awaitable[None]]
) -> int:
    """A service process's life: on uvloop when it is installed, :func:`run_until_signal`;
    returns the exit code (1, logged, when the service cannot start: a port taken, a file it
    cannot open, TLS files that are not usable)."""

    async def started() -> None:
        await start()

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(run_until_signal(started, stop))
    except (OSError, InvalidArgumentError) as err:
        log.error("%s could not start: %s", what, err)
        return 1
    return 0
