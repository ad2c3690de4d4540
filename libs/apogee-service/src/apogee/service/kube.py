"""Talking to the Kubernetes API server with the official ``kubernetes`` client (the
``apogee-service[kubernetes]`` extra), from asyncio code.

The client is synchronous. :class:`KubeCalls` runs its calls on a small thread pool of its own,
each bounded twice: the client's ``_request_timeout`` (the socket gives up) and an
``asyncio.wait_for`` a second later (the caller gives up, even if the thread does not). A call
that fails raises :class:`KubeError` with the HTTP status (0 when no answer came), so callers
test ``err.status == 409`` rather than catching the client's exception classes.

:func:`new_api_client` builds the client's configuration: inside a pod, its service account
(``KUBERNETES_SERVICE_HOST`` is set); elsewhere, the kubeconfig file (``$KUBECONFIG`` or
``~/.kube/config``). :func:`pod_namespace` is the pod's namespace (its service account's), or
``default`` outside a pod.

Nothing here imports ``kubernetes`` at module level, so a process that never asks for the API
server (the file lock, the broker) does not need the package.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

T = TypeVar("T")

#: Where a pod finds its namespace (its service account's files).
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KubeError(Exception):
    """A call to the API server failed: ``status`` is the HTTP status of its answer (0: no
    answer: refused, timed out, cut), ``reason`` the API server's reason (``Conflict``,
    ``NotFound``, ``Invalid``...) or the client's, ``message`` its sentence."""

    def __init__(self, what: str, status: int, reason: str, message: str) -> None:
        super().__init__(f"{what}: {status or 'no answer'} {reason}: {message}")
        self.what = what
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def forbidden(self) -> bool:
        """Refused for who we are (401, 403): a missing RBAC rule, which no retry mends."""
        return self.status in (401, 403)


def missing_client_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} needs the kubernetes package: install apogee-service[kubernetes] "
        "(the schedule, txn-checker and operator images have it)"
    )


def new_api_client(kubeconfig: str = "") -> ApiClient:
    """A client configured from the pod's service account when in a pod (and ``kubeconfig``
    is empty), else from ``kubeconfig`` (empty: ``$KUBECONFIG``, then ``~/.kube/config``)."""
    try:
        from kubernetes import client, config  # noqa: PLC0415
    except ImportError as err:
        raise missing_client_error("talking to the Kubernetes API server") from err
    configuration = client.Configuration()
    if not kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        path = kubeconfig or os.environ.get("KUBECONFIG", "") or "~/.kube/config"
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=os.path.expanduser(path.split(os.pathsep)[0]),
            client_configuration=configuration,
            persist_config=False,
        )
    return client.ApiClient(configuration)


def pod_namespace(default: str = "default") -> str:
    """The namespace of this pod's service account; ``default`` outside a pod."""
    try:
        text = NAMESPACE_FILE.read_text().strip()
    except OSError:
        return default
    return text or default


class KubeCalls:
    """Runs the synchronous client's calls off the event loop, each within ``timeout_s``
    (or the timeout given to :meth:`call`); :meth:`close` lets the threads go (a call still
    running ends at its own socket timeout)."""

    def __init__(self, timeout_s: float = 5.0, threads: int = 2, name: str = "kube") -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    async def call(
        self, what: str, fn: Callable[..., T], *args: Any, timeout: float | None = None, **kw: Any
    ) -> T:
        """``fn(*args, **kw, _request_timeout=timeout)`` on a pool thread; :class:`KubeError`
        when the API server refuses it or does not answer in time."""
        limit = max(0.05, self.timeout_s if timeout is None else timeout)
        bound = functools.partial(fn, *args, _request_timeout=limit, **kw)
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, bound), limit + 1.0)
        except TimeoutError:
            raise KubeError(what, 0, "Timeout", f"no answer within {limit:g}s") from None
        except Exception as err:
            raise as_kube_error(what, err) from err

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def as_kube_error(what: str, err: BaseException) -> KubeError:
    """``err``, raised by the client, as a :class:`KubeError` (the API server's Status read
    from the answer's body when there is one)."""
    if isinstance(err, KubeError):
        return err
    status = getattr(err, "status", None)
    if isinstance(status, int) and status > 0:
        reason = str(getattr(err, "reason", "") or "")
        message = ""
        body = getattr(err, "body", None)
        if body:
            try:
                doc = json.loads(body)
            except (TypeError, ValueError):
                message = str(body)[:500]
            else:
                if isinstance(doc, dict):
                    reason = str(doc.get("reason") or reason)
                    message = str(doc.get("message") or "")
        return KubeError(what, status, reason, message or reason)
    return KubeError(what, 0, type(err).__name__, str(err) or repr(err))
