"""The console's process: uvicorn serving :func:`~apogee_console.app.create_app` on ``listen``
(HTTPS with ``tls_cert_file``/``tls_key_file``), and the console's own ``/metrics`` on
``metrics_listen``.

:class:`ConsoleServer` binds the socket itself (a port in use fails the start with an
:class:`OSError` naming the address), runs uvicorn's loop as a task without uvicorn's own
signal handling (the process's SIGTERM handler calls :meth:`ConsoleServer.stop`), and stops
within :data:`GRACE_S` seconds: connections are asked to close, requests in flight get the
grace, then the app's lifespan ends (sampler stopped, connections to the cluster closed).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Final

import uvicorn

from apogee.service.metrics import MetricsServer, split_listen, start_metrics_from
from apogee_console.app import create_app
from apogee_console.settings import ConsoleSettings

log = logging.getLogger(__name__)

_CERT_REQS: Final = {
    "none": ssl.CERT_NONE,
    "optional": ssl.CERT_OPTIONAL,
    "require": ssl.CERT_REQUIRED,
}
#: Seconds requests in flight get on SIGTERM.
GRACE_S: Final = 3.0


def bind(listen: str) -> socket.socket:
    host, port = split_listen(listen)
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise OSError(f"the console cannot listen on {listen}: {exc.strerror or exc}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class ConsoleServer:
    def __init__(self, settings: ConsoleSettings) -> None:
        self.settings = settings
        self.app = create_app(settings)
        self.port = 0
        self.metrics_server: MetricsServer | None = None
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        s = self.settings
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=int(GRACE_S),
            ssl_certfile=s.tls_cert_file or None,
            ssl_keyfile=s.tls_key_file or None,
            ssl_ca_certs=s.tls_ca_file or None,
            ssl_cert_reqs=_CERT_REQS[s.tls_client_auth],
            server_header=False,
            proxy_headers=False,
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        self._sock = bind(s.listen)
        self.port = int(self._sock.getsockname()[1])
        try:
            await server.startup(sockets=[self._sock])
        except SystemExit as exc:  # uvicorn's way of saying the app did not start
            raise OSError(f"the console did not start (lifespan failed: {exc})") from None
        self._server = server
        self._task = asyncio.create_task(server.main_loop(), name="uvicorn")
        host, _ = split_listen(s.listen)
        log.info(
            "console serving %s://%s:%d (namesrv %s; %s)",
            "https" if s.https else "http",
            host,
            self.port,
            s.namesrv,
            "login required" if s.login_required else "open: authentication is off",
        )
        self.metrics_server = start_metrics_from(
            s, self.app.state.console.metrics.registry, "console"
        )

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.should_exit = True
            if self._task is not None:
                await self._task
            await server.shutdown(sockets=[self._sock] if self._sock else None)
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        log.info("console stopped")
