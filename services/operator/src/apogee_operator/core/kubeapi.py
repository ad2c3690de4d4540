"""The apogee.io custom resources through the ``kubernetes`` client's CustomObjectsApi: list,
merge-patch (the object, for finalizers, with its resourceVersion; the status subresource),
and watch.

Calls run on :class:`~apogee.service.kube.KubeCalls` threads with a deadline each. A watch is a
thread of its own reading the API server's chunked answer line by line (the client's raw
urllib3 response): it hands each event to the event loop and ends when the API server ends the
watch (``timeoutSeconds``), when the connection fails, or when :meth:`Watch.stop` shuts the
socket down under it (urllib3's ``HTTPResponse.shutdown``), so a stop never waits for the
next event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from apogee.service.kube import KubeCalls, as_kube_error
from apogee_operator.core.resources import GROUP, VERSION, Kind

log = logging.getLogger(__name__)

JSON = dict[str, Any]
#: what a watch hands over: ("event", {"type": ..., "object": ...}) or ("end", error or None)
WatchItem = tuple[str, Any]


class CustomResources:
    """The resources of one namespace (``namespace``), or of all (None)."""

    def __init__(
        self,
        api_client_factory: Callable[[], Any],
        namespace: str | None,
        calls: KubeCalls,
        watch_timeout_s: float,
    ) -> None:
        from kubernetes import client  # noqa: PLC0415

        self._api = client.CustomObjectsApi(api_client_factory())
        self.namespace = namespace
        self.calls = calls
        self.watch_timeout_s = watch_timeout_s

    @property
    def where(self) -> str:
        return f"namespace {self.namespace}" if self.namespace else "every namespace"

    async def list(self, kind: Kind) -> tuple[list[JSON], str]:
        """Every object of ``kind`` and the list's resourceVersion."""
        answer: Any
        if self.namespace is None:
            answer = await self.calls.call(
                f"listing {kind.plural}",
                self._api.list_cluster_custom_object,
                GROUP,
                VERSION,
                kind.plural,
            )
        else:
            answer = await self.calls.call(
                f"listing {kind.plural}",
                self._api.list_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                kind.plural,
            )
        items = list(answer.get("items") or [])
        return items, str((answer.get("metadata") or {}).get("resourceVersion") or "")

    async def patch(
        self, kind: Kind, namespace: str, name: str, body: JSON, status: bool = False
    ) -> JSON:
        """A merge patch of the object (or of its status subresource); the object as it is
        now. A ``metadata.resourceVersion`` in ``body`` makes it conditional (409 if stale)."""
        fn = (
            self._api.patch_namespaced_custom_object_status
            if status
            else self._api.patch_namespaced_custom_object
        )
        answer: Any = await self.calls.call(
            f"patching {kind.kind} {namespace}/{name}{' status' if status else ''}",
            fn,
            GROUP,
            VERSION,
            namespace,
            kind.plural,
            name,
            body,
        )
        return dict(answer)

    def watch(
        self,
        kind: Kind,
        resource_version: str,
        deliver: Callable[[WatchItem], None],
    ) -> Watch:
        """Start watching ``kind`` from ``resource_version``; ``deliver`` is called on the
        watch's thread for every item (make it thread-safe)."""

        def open_stream() -> Any:
            kwargs: dict[str, Any] = {
                "watch": True,
                "resource_version": resource_version or None,
                "timeout_seconds": max(1, int(self.watch_timeout_s)),
                "_preload_content": False,
                "_request_timeout": (
                    self.calls.timeout_s,
                    self.watch_timeout_s + self.calls.timeout_s,
                ),
            }
            if self.namespace is None:
                return self._api.list_cluster_custom_object(GROUP, VERSION, kind.plural, **kwargs)
            return self._api.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, kind.plural, **kwargs
            )

        watch = Watch(f"watching {kind.plural}", open_stream, deliver)
        watch.start()
        return watch


class Watch:
    """One watch request on a thread of its own (see the module docstring); create it on the
    event loop's thread."""

    def __init__(
        self, what: str, open_stream: Callable[[], Any], deliver: Callable[[WatchItem], None]
    ) -> None:
        self.what = what
        self._open = open_stream
        self._deliver = deliver
        self._lock = threading.Lock()
        self._response: Any = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=what, daemon=True)
        self._loop = asyncio.get_running_loop()
        self._ended = asyncio.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the watch: the socket is shut down under a read that waits."""
        with self._lock:
            self._stopped = True
            response = self._response
        if response is not None:
            _shut(response)

    def done(self) -> bool:
        return not self._thread.is_alive()

    async def wait_done(self, timeout: float) -> bool:
        """Whether the thread ended within ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ended.wait(), timeout)
        return self._ended.is_set()

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            response = self._open()
            with self._lock:
                self._response = response
                stopped = self._stopped
            if stopped:
                _shut(response)
                return
            buffer = b""
            for chunk in response.stream(amt=None, decode_content=False):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._deliver(("event", json.loads(line)))
            if buffer.strip():
                self._deliver(("event", json.loads(buffer)))
            response.release_conn()
        except Exception as err:
            with self._lock:
                stopped = self._stopped
            if not stopped:
                error = as_kube_error(self.what, err)
        finally:
            self._deliver(("end", error))
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(self._ended.set)


def _shut(response: Any) -> None:
    with contextlib.suppress(Exception):
        shutdown = getattr(response, "shutdown", None)
        if shutdown is not None:
            shutdown()
        response.close()
