"""A stand-in for the Kubernetes API server, for tests only: a small HTTP server that answers
the REST paths the ``kubernetes`` client uses for Leases and namespaced custom resources.

It is not Kubernetes. It keeps objects in memory and implements only what Apogee's Lease
leadership and operator call, with the API server's rules that they rely on:

- get, create (POST), replace (PUT), merge or JSON patch (PATCH), delete, list and watch
  (``?watch=true``: chunked JSON lines ``{"type": "ADDED"|"MODIFIED"|"DELETED", "object": ...}``,
  from a ``resourceVersion`` on, ended after ``timeoutSeconds``) on
  ``/apis/<group>/<version>/namespaces/<ns>/<plural>[/<name>[/status]]``, and list and watch
  across namespaces on ``/apis/<group>/<version>/<plural>``;
- one resourceVersion counter; a write that names a resourceVersion other than the current
  one gets 409 Conflict (an update must name one), a create of an existing name 409
  AlreadyExists, a missing object 404 NotFound, each with a ``Status`` body;
- custom resources registered from their CustomResourceDefinition (:meth:`add_crd`): the
  ``status`` subresource (writes to the object keep its status, writes to ``/status`` keep
  the rest), ``metadata.generation`` raised when anything but metadata and status changes,
  defaults and the OpenAPI v3 checks the schema states (``type``, ``required``, ``enum``,
  ``pattern``, ``minimum``/``maximum``, ``minLength``/``maxLength``, ``minItems``/
  ``maxItems``, ``format: date-time``; unknown fields pruned) answered 422 Invalid, and
  finalizers (a delete sets ``deletionTimestamp``; the object goes when its last finalizer is
  removed).

Not implemented: authentication and RBAC, label and field selectors, server-side apply,
strategic merge patch, CEL rules (``x-kubernetes-validations``), API discovery, compaction
(no 410 Gone unless :meth:`FakeApiServer.forget_events` is called), cluster-scoped objects.

Tests also reach the state directly: :meth:`~FakeApiServer.get`, :meth:`~FakeApiServer.put`
(a write by someone else), :meth:`~FakeApiServer.fail_with` (every request answered with an
error status, as an unreachable or failing API server), :meth:`~FakeApiServer.paused` (no
answer at all for a while, as an API server that hangs or a network that drops everything), and
:meth:`~FakeApiServer.kubeconfig` writes a kubeconfig file pointing at it, for processes
started by the test.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

JSON = dict[str, Any]
#: (group, version, plural)
TypeKey = tuple[str, str, str]


@dataclass
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    status_subresource: bool = False
    schema: JSON | None = None

    @property
    def key(self) -> TypeKey:
        return (self.group, self.version, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


LEASES = ResourceType("coordination.k8s.io", "v1", "leases", "Lease")


@dataclass
class _Event:
    rv: int
    type_key: TypeKey
    namespace: str
    kind: str
    obj: JSON = field(default_factory=dict)


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message

    def body(self) -> JSON:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.status,
        }


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeApiServer:
    """Start with :meth:`start` (or ``with FakeApiServer() as api``); ``url`` is its address
    on 127.0.0.1. Leases are always served; custom resources once their CRD is added."""

    def __init__(self, crds: Iterable[Mapping[str, Any]] = ()) -> None:
        self._types: dict[TypeKey, ResourceType] = {LEASES.key: LEASES}
        self._objects: dict[tuple[TypeKey, str, str], JSON] = {}
        self._events: list[_Event] = []
        self._first_kept_rv = 0
        self._rv = 0
        self._cond = threading.Condition()
        self._fault: int | None = None
        self._paused = False
        self._stopping = False
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        #: (method, path) of every request answered, in order
        self.requests: list[tuple[str, str]] = []
        for crd in crds:
            self.add_crd(crd)

    # -- life --------------------------------------------------------------------------------

    def start(self) -> FakeApiServer:
        with self._cond:
            self._stopping = False
        handler = _handler_for(self)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening; a request that comes after on a connection kept open is dropped
        unanswered (the connection closed), as by an API server that is gone."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """Write a kubeconfig whose current context is this server (no credentials)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
                }
            ],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for this server."""
        from kubernetes import client  # noqa: PLC0415

        configuration = client.Configuration()
        configuration.host = self.url
        return client.ApiClient(configuration)

    # -- types -------------------------------------------------------------------------------

    def add_crd(self, crd: Mapping[str, Any]) -> None:
        """Serve the custom resource ``crd`` defines (its served versions)."""
        spec = crd["spec"]
        if spec.get("scope", "Namespaced") != "Namespaced":
            raise ValueError("only namespaced custom resources are served")
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            rtype = ResourceType(
                spec["group"],
                version["name"],
                spec["names"]["plural"],
                spec["names"]["kind"],
                status_subresource="status" in (version.get("subresources") or {}),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
            )
            self._types[rtype.key] = rtype

    def type_for(self, plural: str) -> ResourceType:
        for rtype in self._types.values():
            if rtype.plural == plural:
                return rtype
        raise KeyError(plural)

    # -- direct access (tests) ---------------------------------------------------------------

    def get(self, plural: str, namespace: str, name: str) -> JSON | None:
        """A copy of the object, or None."""
        with self._cond:
            obj = self._objects.get((self.type_for(plural).key, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, plural: str, namespace: str | None = None) -> list[JSON]:
        key = self.type_for(plural).key
        with self._cond:
            return [
                copy.deepcopy(o)
                for (k, ns, _), o in sorted(self._objects.items())
                if k == key and namespace in (None, ns)
            ]

    def put(self, plural: str, namespace: str, obj: JSON) -> JSON:
        """Write ``obj`` as another client would, whatever its resourceVersion."""
        rtype = self.type_for(plural)
        with self._cond:
            name = obj["metadata"]["name"]
            current = self._objects.get((rtype.key, namespace, name))
            body = copy.deepcopy(obj)
            if current is None:
                return self._create(rtype, namespace, body)
            body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            return self._replace(rtype, namespace, name, body, status_only=False, keep=False)

    def fail_with(self, status: int | None) -> None:
        """Answer every request with ``status`` (503, say) until called with None."""
        with self._cond:
            self._fault = status

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No answers for the block: every request that arrives meanwhile waits until the block
        ends and is then dropped unanswered (its connection closed, nothing done), so a client
        sees its own timeout. :meth:`get`, :meth:`put` and watches already open go on."""
        with self._cond:
            self._paused = True
        try:
            yield
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def _held_back(self) -> bool:
        """Wait while paused; whether the request is to be dropped (it waited, or the server
        is stopped)."""
        with self._cond:
            dropped = self._stopping or self._paused
            while self._paused and not self._stopping:
                self._cond.wait(0.5)
            return dropped

    def forget_events(self) -> None:
        """Drop the watch history: a watch from an older resourceVersion gets 410 Gone."""
        with self._cond:
            self._events.clear()
            self._first_kept_rv = self._rv + 1

    # -- the API -----------------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _record(self, rtype: ResourceType, namespace: str, kind: str, obj: JSON) -> None:
        self._events.append(
            _Event(int(obj["metadata"]["resourceVersion"]), rtype.key, namespace, kind, obj)
        )
        self._cond.notify_all()

    def _check(self, rtype: ResourceType, obj: JSON, name: str) -> None:
        if rtype.schema is None:
            return
        _default_and_prune(rtype.schema, obj)
        problems: list[str] = []
        _validate(rtype.schema, obj, "", problems, top=True)
        if problems:
            raise ApiError(
                422,
                "Invalid",
                f'{rtype.kind}.{rtype.group} "{name}" is invalid: ' + ", ".join(problems),
            )

    def _create(self, rtype: ResourceType, namespace: str, body: JSON) -> JSON:
        meta = body.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value: name is required")
        key = (rtype.key, namespace, name)
        if key in self._objects:
            raise ApiError(
                409, "AlreadyExists", f'{rtype.plural}.{rtype.group} "{name}" already exists'
            )
        body["apiVersion"] = rtype.api_version
        body["kind"] = rtype.kind
        if rtype.status_subresource:
            body.pop("status", None)
        self._check(rtype, body, name)
        meta.update(
            namespace=namespace,
            uid=str(uuid.uuid4()),
            creationTimestamp=_now(),
            resourceVersion=self._next_rv(),
        )
        if rtype.schema is not None:
            meta["generation"] = 1
        meta.pop("deletionTimestamp", None)
        self._objects[key] = body
        self._record(rtype, namespace, "ADDED", copy.deepcopy(body))
        return copy.deepcopy(body)

    def _existing(self, rtype: ResourceType, namespace: str, name: str) -> JSON:
        obj = self._objects.get((rtype.key, namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{rtype.plural}.{rtype.group} "{name}" not found')
        return obj

    def _replace(
        self,
        rtype: ResourceType,
        namespace: str,
        name: str,
        body: JSON,
        status_only: bool,
        keep: bool = True,
        require_rv: bool = True,
    ) -> JSON:
        current = self._existing(rtype, namespace, name)
        meta = body.setdefault("metadata", {})
        rv = meta.get("resourceVersion")
        if rv in (None, ""):
            if require_rv:
                raise ApiError(
                    422,
                    "Invalid",
                    f'{rtype.kind} "{name}" is invalid: metadata.resourceVersion: Invalid '
                    "value: 0: must be specified for an update",
                )
        elif rv != current["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {rtype.plural}.{rtype.group} "{name}": the '
                "object has been modified; please apply your changes to the latest version "
                "and try again",
            )
        if status_only:
            new = copy.deepcopy(current)
            if "status" in body:
                new["status"] = body["status"]
            else:
                new.pop("status", None)
        else:
            new = body
            if keep and rtype.status_subresource:
                if "status" in current:
                    new["status"] = copy.deepcopy(current["status"])
                else:
                    new.pop("status", None)
            for fixed in ("uid", "creationTimestamp", "deletionTimestamp", "generation"):
                if fixed in current["metadata"]:
                    meta[fixed] = current["metadata"][fixed]
                else:
                    meta.pop(fixed, None)
            meta["name"], meta["namespace"] = name, namespace
            new["apiVersion"], new["kind"] = rtype.api_version, rtype.kind
        self._check(rtype, new, name)
        if rtype.schema is not None and _content(new) != _content(current):
            new["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
        if new == current:
            return copy.deepcopy(current)  # nothing changed: no new version
        new["metadata"]["resourceVersion"] = self._next_rv()
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            del self._objects[(rtype.key, namespace, name)]
            self._record(rtype, namespace, "DELETED", copy.deepcopy(new))
            return copy.deepcopy(new)
        self._objects[(rtype.key, namespace, name)] = new
        self._record(rtype, namespace, "MODIFIED", copy.deepcopy(new))
        return copy.deepcopy(new)

    def _patch(
        self,
        rtype: ResourceType,
        namespace: str,
        name: str,
        patch: Any,
        content_type: str,
        status_only: bool,
    ) -> JSON:
        current = copy.deepcopy(self._existing(rtype, namespace, name))
        if "json-patch" in content_type:
            new = _json_patch(current, patch)
        elif "merge-patch" in content_type:
            new = _merge_patch(current, patch)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"{content_type} is not served here")
        if not isinstance(new, dict):
            raise ApiError(422, "Invalid", "a patch must leave an object")
        asked = (
            patch.get("metadata", {}).get("resourceVersion") if isinstance(patch, dict) else None
        )
        new.setdefault("metadata", {})["resourceVersion"] = (
            asked or current["metadata"]["resourceVersion"]
        )
        return self._replace(rtype, namespace, name, new, status_only)

    def _delete(self, rtype: ResourceType, namespace: str, name: str) -> JSON:
        current = self._existing(rtype, namespace, name)
        if current["metadata"].get("finalizers"):
            if not current["metadata"].get("deletionTimestamp"):
                new = copy.deepcopy(current)
                new["metadata"]["deletionTimestamp"] = _now()
                new["metadata"]["resourceVersion"] = self._next_rv()
                self._objects[(rtype.key, namespace, name)] = new
                self._record(rtype, namespace, "MODIFIED", copy.deepcopy(new))
                return copy.deepcopy(new)
            return copy.deepcopy(current)
        del self._objects[(rtype.key, namespace, name)]
        gone = copy.deepcopy(current)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        self._record(rtype, namespace, "DELETED", copy.deepcopy(gone))
        return gone

    def _list(self, rtype: ResourceType, namespace: str | None) -> JSON:
        items = [
            copy.deepcopy(o)
            for (k, ns, _), o in sorted(self._objects.items())
            if k == rtype.key and namespace in (None, ns)
        ]
        return {
            "apiVersion": rtype.api_version,
            "kind": f"{rtype.kind}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    def handle(
        self, method: str, path: str, query: Mapping[str, str], body: Any, ctype: str
    ) -> Any:
        """One request: the answer's JSON, or raises :class:`ApiError`."""
        with self._cond:
            if self._fault is not None:
                raise ApiError(self._fault, "ServiceUnavailable", "the API server is failing")
            rtype, namespace, name, status = self._route(path)
            if name is None:
                if method == "GET":
                    return self._list(rtype, namespace)
                if method == "POST" and namespace is not None:
                    return self._create(rtype, namespace, copy.deepcopy(body))
                raise ApiError(405, "MethodNotAllowed", f"{method} {path}")
            assert namespace is not None
            if method == "GET":
                return copy.deepcopy(self._existing(rtype, namespace, name))
            if method == "PUT":
                return self._replace(rtype, namespace, name, copy.deepcopy(body), status)
            if method == "PATCH":
                return self._patch(rtype, namespace, name, body, ctype, status)
            if method == "DELETE" and not status:
                return self._delete(rtype, namespace, name)
            raise ApiError(405, "MethodNotAllowed", f"{method} {path}")

    def _route(self, path: str) -> tuple[ResourceType, str | None, str | None, bool]:
        parts = [p for p in path.split("/") if p]
        if len(parts) < 4 or parts[0] != "apis":
            raise ApiError(404, "NotFound", f"the server could not find {path}")
        group, version, rest = parts[1], parts[2], parts[3:]
        namespace: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        plural, rest = rest[0], rest[1:]
        rtype = self._types.get((group, version, plural))
        if rtype is None or len(rest) > 2 or (len(rest) == 2 and rest[1] != "status"):
            raise ApiError(404, "NotFound", f"the server could not find {path}")
        if rest and namespace is None:
            raise ApiError(404, "NotFound", f"{plural} are namespaced: {path}")
        if len(rest) == 2 and not rtype.status_subresource:
            raise ApiError(404, "NotFound", f"{plural} have no status subresource")
        return rtype, namespace, rest[0] if rest else None, len(rest) == 2

    def watch(self, path: str, query: Mapping[str, str], write: Any) -> None:
        """Stream events of the collection ``path`` to ``write(json_line_bytes)``."""
        timeout = float(query.get("timeoutSeconds", "") or 30)
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._fault is not None:
                raise ApiError(self._fault, "ServiceUnavailable", "the API server is failing")
            rtype, namespace, name, _ = self._route(path)
            if name is not None:
                raise ApiError(405, "MethodNotAllowed", "watch a collection")
            start = query.get("resourceVersion", "")
            pending: list[JSON] = []
            if start in ("", "0"):
                listed = self._list(rtype, namespace)
                pending = [{"type": "ADDED", "object": o} for o in listed["items"]]
                after = self._rv
            else:
                after = int(start)
                if after + 1 < self._first_kept_rv:
                    pending = [_gone(after)]
                    after = -1
        for event in pending:
            write(event)
        while after >= 0:
            with self._cond:
                events = [
                    e
                    for e in self._events
                    if e.rv > after and e.type_key == rtype.key and namespace in (None, e.namespace)
                ]
                if not events:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stopping or self._fault is not None:
                        return
                    self._cond.wait(min(left, 0.5))
                    continue
                after = events[-1].rv  # events are kept in order
            for e in events:
                write({"type": e.kind, "object": copy.deepcopy(e.obj)})


def _gone(rv: int) -> JSON:
    status = ApiError(410, "Expired", f"too old resource version: {rv}").body()
    return {"type": "ERROR", "object": status}


def _content(obj: JSON) -> JSON:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


def _json_patch(target: JSON, ops: Any) -> JSON:
    """RFC 6902: add, replace, remove and test."""
    doc: Any = copy.deepcopy(target)
    for op in ops if isinstance(ops, list) else []:
        steps = [s.replace("~1", "/").replace("~0", "~") for s in op["path"].split("/")[1:]]
        parent = doc
        for step in steps[:-1]:
            parent = parent[int(step)] if isinstance(parent, list) else parent[step]
        last = steps[-1]
        kind = op["op"]
        if kind == "test":
            here = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if here != op.get("value"):
                raise ApiError(422, "Invalid", f"test of {op['path']} failed")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif kind == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                parent.pop(last, None)
        else:
            raise ApiError(422, "Invalid", f"patch operation {kind!r} is not served here")
    return dict(doc)


# -- the OpenAPI v3 subset of structural schemas --------------------------------------------

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def _default_and_prune(schema: Mapping[str, Any], value: Any) -> None:
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        if props is None:
            return
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            for key in [k for k in value if k not in props]:
                if key not in ("apiVersion", "kind", "metadata"):
                    del value[key]
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value and key != "metadata":
                _default_and_prune(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default_and_prune(schema["items"], item)


def _validate(
    schema: Mapping[str, Any], value: Any, path: str, out: list[str], top: bool = False
) -> None:
    where = path or "<root>"

    def bad(rule: str) -> None:
        out.append(f"{where}: Invalid value: {json.dumps(value)}: {rule}")

    kind = schema.get("type")
    if kind is not None:
        ok = isinstance(value, _TYPES.get(kind, (object,)))
        if kind in ("integer", "number") and isinstance(value, bool):
            ok = False
        if not ok:
            out.append(
                f'{where}: Invalid value: "{type(value).__name__}": {where} in body must '
                f"be of type {kind}"
            )
            return
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(json.dumps(v) for v in schema["enum"])
        out.append(f"{where}: Unsupported value: {json.dumps(value)}: supported values: {allowed}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            bad(f"{where} in body should match '{schema['pattern']}'")
        if "minLength" in schema and len(value) < schema["minLength"]:
            bad(f"{where} in body should be at least {schema['minLength']} chars long")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            bad(f"{where} in body should be at most {schema['maxLength']} chars long")
        if schema.get("format") == "date-time":
            try:
                datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                bad(f"{where} in body must be of type date-time")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            bad(f"{where} in body should be greater than or equal to {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            bad(f"{where} in body should be less than or equal to {schema['maximum']}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            bad(f"{where} in body should have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            bad(f"{where} in body should have at most {schema['maxItems']} items")
        for i, item in enumerate(value):
            _validate(schema.get("items", {}), item, f"{path}[{i}]", out)
    if isinstance(value, dict):
        for req in schema.get("required", []):
            if req not in value:
                out.append(f"{path + '.' if path else ''}{req}: Required value")
        for key, sub in (schema.get("properties") or {}).items():
            if key in value and not (top and key == "metadata"):
                _validate(sub, value[key], f"{path + '.' if path else ''}{key}", out)


def _handler_for(api: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: tests read api.requests

        def _answer(self, status: int, doc: Any) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, method: str) -> None:
            if api._held_back():
                self.close_connection = True
                return
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            api.requests.append((method, parts.path))
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                self._answer(400, ApiError(400, "BadRequest", "the body is not JSON").body())
                return
            try:
                if method == "GET" and query.get("watch", "").lower() in ("true", "1"):
                    self._watch(parts.path, query)
                    return
                doc = api.handle(
                    method, parts.path, query, body, self.headers.get("Content-Type", "")
                )
            except ApiError as err:
                self._answer(err.status, err.body())
                return
            self._answer(201 if method == "POST" else 200, doc)

        def _watch(self, path: str, query: Mapping[str, str]) -> None:
            started = False

            def write(event: JSON) -> None:
                nonlocal started
                if not started:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    started = True
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                self.wfile.flush()

            try:
                api.watch(path, query, write)
            except ApiError as err:
                if not started:
                    self._answer(err.status, err.body())
                    return
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
                return
            if not started:
                write_head = self.send_response
                write_head(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_PATCH(self) -> None:
            self._serve("PATCH")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

    return Handler
