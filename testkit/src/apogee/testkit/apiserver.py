"""A stand-in for the Kubernetes API server, for tests only: a small HTTP server that answers
the REST paths the ``kubernetes`` client and ``kubectl`` use for Leases, Events and namespaced
custom resources.

It is not Kubernetes. It keeps objects in memory and implements only what Apogee's Lease
leadership and operator call, and what ``kubectl`` apply, get and describe ask, with the API
server's rules that they rely on:

- get, create (POST), replace (PUT), merge or JSON patch (PATCH), delete, list and watch
  (``?watch=true``: chunked JSON lines ``{"type": "ADDED"|"MODIFIED"|"DELETED", "object": ...}``,
  from a ``resourceVersion`` on, ended after ``timeoutSeconds``) on
  ``/apis/<group>/<version>/namespaces/<ns>/<plural>[/<name>[/status]]`` and, for the core
  group's Events, ``/api/v1/namespaces/<ns>/events[/<name>]``; list and watch across
  namespaces on ``/apis/<group>/<version>/<plural>``; lists filtered by a ``fieldSelector`` of
  equalities (``a.b=x``, ``a.b!=y``) on any field;
- one resourceVersion counter; a write that names a resourceVersion other than the current
  one gets 409 Conflict (an update must name one), a create of an existing name 409
  AlreadyExists, a missing object 404 NotFound, each with a ``Status`` body;
- custom resources registered from their CustomResourceDefinition (:meth:`add_crd`): the
  ``status`` subresource (writes to the object keep its status, writes to ``/status`` keep
  the rest), ``metadata.generation`` raised when anything but metadata and status changes,
  defaults and the OpenAPI v3 checks the schema states (``type``, ``required``, ``enum``,
  ``pattern``, ``minimum``/``maximum``, ``minLength``/``maxLength``, ``minItems``/
  ``maxItems``, ``format: date-time``) answered 422 Invalid with a cause per field, unknown
  fields as ``fieldValidation`` says (Ignore: pruned; Warn, the default: pruned with a
  ``Warning`` header; Strict: 400 BadRequest ``strict decoding error: unknown field "spec.x"``,
  or 422 naming the patch for a PATCH), and finalizers (a delete sets ``deletionTimestamp``;
  the object goes when its last finalizer is removed);
- discovery, the legacy (unaggregated) form: ``/api``, ``/api/v1``, ``/apis``,
  ``/apis/<group>`` and ``/apis/<group>/<version>`` (APIResourceList: plural, singular, kind,
  shortNames and categories from the CRD, namespaced, verbs, the status subresource), and
  ``/version``;
- ``/openapi/v3`` and ``/openapi/v3/apis/<group>/<version>`` (and ``api/v1``): each type's
  schema (a CRD's own) and its paths, whose writes take ``fieldValidation`` and whose patches
  are JSON and merge patches, so ``kubectl apply`` leaves the checks to this server (it sends
  ``fieldValidation=Strict``) and sends custom resources merge patches; ``kubectl explain``
  reads the schemas;
- Tables (``Accept: application/json;as=Table;v=v1;g=meta.k8s.io``) for a GET of a list or
  an object: Name, then a CRD's ``additionalPrinterColumns`` (JSONPaths ``.a.b``, ``[0]``,
  ``[*]``, filters ``[?(@.type=="Ready")]``; a ``date`` column shown as an age; Age alone when
  the CRD has none), a Lease's Holder and Age; an Event's Last Seen, Type, Reason, Object,
  Message and (wide) Name; each row with the object's metadata (``includeObject``);
- Namespaces: ``GET /api/v1/namespaces[/<name>]``, every name Active (none is created or
  deleted; objects may be written in any namespace).

Not implemented: authentication and RBAC, label selectors (ignored), field selectors other
than equalities, server-side apply, strategic merge patch (what kubectl sends to change a Lease
or an Event it applied: 415), dry runs, CEL rules (``x-kubernetes-validations``), aggregated
discovery and ``/openapi/v2`` (kubectl falls back to the legacy discovery and does without
v2), watches of Tables, compaction (no 410 Gone unless :meth:`FakeApiServer.forget_events` is
called), other cluster-scoped objects, and anything recording Events (tests may
:meth:`~FakeApiServer.put` some).

Tests also reach the state directly: :meth:`~FakeApiServer.get`, :meth:`~FakeApiServer.put`
(a write by someone else), :meth:`~FakeApiServer.fail_with` (every request answered with an
error status, as an unreachable or failing API server), :meth:`~FakeApiServer.paused` (no
answer at all for a while, as an API server that hangs or a network that drops everything), and
:meth:`~FakeApiServer.kubeconfig` writes a kubeconfig file pointing at it, for processes
started by the test (``kubectl --kubeconfig <file>``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

JSON = dict[str, Any]
#: (group, version, plural)
TypeKey = tuple[str, str, str]
Strings = list[str]


@dataclass(frozen=True)
class Column:
    """A column of ``kubectl get``'s Table: a CRD's additionalPrinterColumn (its ``jsonPath``)
    or a built-in type's printer (``value``)."""

    name: str
    type: str
    json_path: str = ""
    description: str = ""
    priority: int = 0
    format: str = ""
    value: Callable[[JSON], Any] | None = None

    def definition(self) -> JSON:
        return {
            "name": self.name,
            "type": self.type,
            "format": self.format,
            "description": self.description,
            "priority": self.priority,
        }

    def cell(self, obj: JSON) -> Any:
        """As the API server fills a CRD's cell: nothing found is None, a ``string`` column
        the value printed, a ``date`` one the age, others the value if of that type."""
        if self.value is not None:
            return self.value(obj)
        found = jsonpath(obj, self.json_path)
        if not found or found[0] is None:
            return None
        value = found[0]
        if self.type == "string":
            return _text(value)
        if (
            self.type == "integer"
            and isinstance(value, int | float)
            and not isinstance(value, bool)
        ):
            return int(value)
        if self.type == "number" and isinstance(value, int | float) and not isinstance(value, bool):
            return value
        if self.type == "boolean" and isinstance(value, bool):
            return value
        if self.type == "date" and isinstance(value, str):
            return _age(value)
        return None


#: the column a CRD without additionalPrinterColumns gets besides Name
AGE = Column(
    "Age",
    "date",
    ".metadata.creationTimestamp",
    "CreationTimestamp is a timestamp representing the server time when this object was created.",
)
NAME_DOC = "Name must be unique within a namespace."


@dataclass
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    status_subresource: bool = False
    schema: JSON | None = None
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    #: the Table's columns after Name (empty: Age)
    columns: tuple[Column, ...] = ()
    #: the schema /openapi/v3 shows when ``schema`` (which is also enforced) is None
    openapi: JSON | None = None
    #: whether the Table starts with Name (else a column of ``columns`` shows it)
    name_first: bool = True

    @property
    def key(self) -> TypeKey:
        return (self.group, self.version, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


def _qualified(rtype: ResourceType) -> str:
    """``topics.apogee.io``, ``events`` (the core group): how messages name a type."""
    return f"{rtype.plural}.{rtype.group}" if rtype.group else rtype.plural


def _holder_of(lease: JSON) -> str:
    holder = (lease.get("spec") or {}).get("holderIdentity")
    return holder if isinstance(holder, str) else ""


def _age_of(obj: JSON) -> str:
    return _age(obj["metadata"].get("creationTimestamp") or "")


def _event_last_seen(event: JSON) -> str:
    seen = event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp")
    return _age(seen or "")


def _event_object(event: JSON) -> str:
    involved = event.get("involvedObject") or {}
    return f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}"


_TIME = {"type": "string", "format": "date-time"}
LEASES = ResourceType(
    "coordination.k8s.io",
    "v1",
    "leases",
    "Lease",
    singular="lease",
    columns=(
        Column("Holder", "string", description="The holder of the lease.", value=_holder_of),
        Column("Age", "string", description=AGE.description, value=_age_of),
    ),
    openapi={
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": {
                "type": "object",
                "properties": {
                    "acquireTime": _TIME,
                    "holderIdentity": {"type": "string"},
                    "leaseDurationSeconds": {"type": "integer", "format": "int32"},
                    "leaseTransitions": {"type": "integer", "format": "int32"},
                    "preferredHolder": {"type": "string"},
                    "renewTime": _TIME,
                    "strategy": {"type": "string"},
                },
            },
        },
    },
)
EVENTS = ResourceType(
    "",
    "v1",
    "events",
    "Event",
    singular="event",
    short_names=("ev",),
    columns=(
        Column("Last Seen", "string", value=_event_last_seen),
        Column("Type", "string", value=lambda e: e.get("type", "")),
        Column("Reason", "string", value=lambda e: e.get("reason", "")),
        Column("Object", "string", value=_event_object),
        Column("Message", "string", value=lambda e: e.get("message", "")),
        Column("Name", "string", priority=1, value=lambda e: e["metadata"].get("name", "")),
    ),
    name_first=False,
    openapi={"type": "object", "x-kubernetes-preserve-unknown-fields": True},
)
#: namespaces: not stored; every namespace exists (see FakeApiServer.namespace)
NAMESPACES = ResourceType(
    "",
    "v1",
    "namespaces",
    "Namespace",
    singular="namespace",
    short_names=("ns",),
    columns=(
        Column("Status", "string", value=lambda n: n["status"]["phase"]),
        Column("Age", "string", description=AGE.description, value=_age_of),
    ),
)
#: the verbs this server serves on every type (no deletecollection)
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
#: what /version answers
VERSION_INFO = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0",
    "gitCommit": "",
    "gitTreeState": "clean",
    "buildDate": "2024-12-11T00:00:00Z",
    "goVersion": "",
    "compiler": "gc",
    "platform": "linux/amd64",
}


@dataclass
class _Event:
    rv: int
    type_key: TypeKey
    namespace: str
    kind: str
    obj: JSON = field(default_factory=dict)


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, details: JSON | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.details = details

    def body(self) -> JSON:
        doc: JSON = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.status,
        }
        if self.details is not None:
            doc["details"] = self.details
        return doc


#: a broken rule of a schema: (field, reason, what is wrong), as the API server's causes
Cause = tuple[str, str, str]
#: fieldValidation's values
_FIELD_VALIDATION = ("Ignore", "Warn", "Strict")


@dataclass
class _Write:
    """How a write treats fields its schema does not know (``fieldValidation``): Ignore
    prunes them, Warn prunes them and adds a warning, Strict refuses the write."""

    validation: str = "Ignore"
    warnings: list[str] = field(default_factory=list)
    #: the patch, for a PATCH (a Strict refusal names it)
    patch: Any = None


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeApiServer:
    """Start with :meth:`start` (or ``with FakeApiServer() as api``); ``url`` is its address
    on 127.0.0.1. Leases are always served; custom resources once their CRD is added."""

    def __init__(self, crds: Iterable[Mapping[str, Any]] = ()) -> None:
        self._types: dict[TypeKey, ResourceType] = {LEASES.key: LEASES, EVENTS.key: EVENTS}
        self._objects: dict[tuple[TypeKey, str, str], JSON] = {}
        self._events: list[_Event] = []
        self._first_kept_rv = 0
        self._rv = 0
        self._started = _now()
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
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            columns = tuple(
                Column(
                    c["name"],
                    c["type"],
                    c["jsonPath"],
                    c.get("description", ""),
                    c.get("priority", 0),
                    c.get("format", ""),
                )
                for c in version.get("additionalPrinterColumns") or ()
            )
            for column in columns:
                jsonpath({}, column.json_path)  # raises ValueError for what is not served
            rtype = ResourceType(
                spec["group"],
                version["name"],
                names["plural"],
                names["kind"],
                status_subresource="status" in (version.get("subresources") or {}),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                singular=names.get("singular") or names["kind"].lower(),
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                columns=columns or (AGE,),
            )
            with self._cond:
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

    def _check(self, rtype: ResourceType, obj: JSON, name: str, write: _Write) -> None:
        if rtype.schema is None:
            return
        unknown: list[str] = []
        _default_and_prune(rtype.schema, obj, "", unknown)
        said = ", ".join(f'unknown field "{u}"' for u in unknown)
        if unknown and write.validation == "Strict":
            if write.patch is not None:
                patch = json.dumps(write.patch, separators=(",", ":"))
                detail = f"Invalid value: {json.dumps(patch)}: strict decoding error: {said}"
                raise ApiError(
                    422,
                    "Invalid",
                    f"patch: {detail}",
                    {
                        "causes": [
                            {"reason": "FieldValueInvalid", "message": detail, "field": "patch"}
                        ]
                    },
                )
            raise ApiError(
                400,
                "BadRequest",
                f'{rtype.kind} in version "{rtype.version}" cannot be handled as a '
                f"{rtype.kind}: strict decoding error: {said}",
            )
        if write.validation == "Warn":
            write.warnings.extend(f'unknown field "{u}"' for u in unknown)
        problems: list[Cause] = []
        _validate(rtype.schema, obj, "", problems, top=True)
        if problems:
            raise ApiError(
                422,
                "Invalid",
                f'{rtype.kind}.{rtype.group} "{name}" is invalid: '
                + ", ".join(f"{where}: {what}" for where, _, what in problems),
                {
                    "name": name,
                    "group": rtype.group,
                    "kind": rtype.kind,
                    "causes": [
                        {"reason": reason, "message": what, "field": where}
                        for where, reason, what in problems
                    ],
                },
            )

    def _create(
        self, rtype: ResourceType, namespace: str, body: JSON, write: _Write | None = None
    ) -> JSON:
        meta = body.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value: name is required")
        key = (rtype.key, namespace, name)
        if key in self._objects:
            raise ApiError(409, "AlreadyExists", f'{_qualified(rtype)} "{name}" already exists')
        body["apiVersion"] = rtype.api_version
        body["kind"] = rtype.kind
        if rtype.status_subresource:
            body.pop("status", None)
        self._check(rtype, body, name, write or _Write())
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
            raise ApiError(404, "NotFound", f'{_qualified(rtype)} "{name}" not found')
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
        write: _Write | None = None,
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
                f'Operation cannot be fulfilled on {_qualified(rtype)} "{name}": the '
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
        self._check(rtype, new, name, write or _Write())
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
        write: _Write | None = None,
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
        if write is not None:
            write.patch = patch
        return self._replace(rtype, namespace, name, new, status_only, write=write)

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

    def _list(self, rtype: ResourceType, namespace: str | None, fields: str = "") -> JSON:
        terms = _field_selector(fields)
        items = [
            copy.deepcopy(o)
            for (k, ns, _), o in sorted(self._objects.items())
            if k == rtype.key
            and namespace in (None, ns)
            and all((_field(o, path) == value) == equal for path, equal, value in terms)
        ]
        return {
            "apiVersion": rtype.api_version,
            "kind": f"{rtype.kind}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    # -- discovery and OpenAPI ---------------------------------------------------------------

    def _group_versions(self) -> dict[str, Strings]:
        """group -> its versions, in the order they were added ("" is the core group)."""
        groups: dict[str, Strings] = {}
        for group, version, _ in self._types:
            versions = groups.setdefault(group, [])
            if version not in versions:
                versions.append(version)
        return groups

    def _api_group(self, group: str, versions: Strings) -> JSON:
        listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": listed, "preferredVersion": listed[0]}

    def _resource_list(self, group: str, version: str) -> JSON:
        resources: list[JSON] = []
        for rtype in self._types.values():
            if (rtype.group, rtype.version) != (group, version):
                continue
            entry: JSON = {
                "name": rtype.plural,
                "singularName": rtype.singular,
                "namespaced": True,
                "kind": rtype.kind,
                "verbs": VERBS,
            }
            if rtype.short_names:
                entry["shortNames"] = list(rtype.short_names)
            if rtype.categories:
                entry["categories"] = list(rtype.categories)
            resources.append(entry)
            if rtype.status_subresource:
                resources.append(
                    {
                        "name": f"{rtype.plural}/status",
                        "singularName": "",
                        "namespaced": True,
                        "kind": rtype.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        if (group, version) == ("", "v1"):
            resources.append(
                {
                    "name": "namespaces",
                    "singularName": "namespace",
                    "namespaced": False,
                    "kind": "Namespace",
                    "verbs": ["get", "list"],
                    "shortNames": ["ns"],
                }
            )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }

    def _openapi_docs(self) -> dict[str, JSON]:
        """``api/v1`` or ``apis/<group>/<version>`` -> its OpenAPI v3 document."""
        docs: dict[str, JSON] = {}
        for group, versions in self._group_versions().items():
            for version in versions:
                types = [
                    t for t in self._types.values() if (t.group, t.version) == (group, version)
                ]
                key = f"apis/{group}/{version}" if group else f"api/{version}"
                docs[key] = _openapi_document(key, types)
        return docs

    def namespace(self, name: str) -> JSON:
        """Namespace ``name``, Active: every namespace exists here (objects may be written in
        any), created when the server started or when its first object was."""
        created = min(
            (
                o["metadata"].get("creationTimestamp") or self._started
                for (_, ns, _), o in self._objects.items()
                if ns == name
            ),
            default=self._started,
        )
        return {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, name)),
                "creationTimestamp": created,
                "resourceVersion": "1",
            },
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        }

    def _namespaces(self, parts: Strings, accept: str, query: Mapping[str, str]) -> JSON:
        """GET /api/v1/namespaces[/<name>]: those holding objects and ``default``."""
        if len(parts) == 4:
            found = [self.namespace(parts[3])]
        else:
            names = {"default"} | {ns for (_, ns, _) in self._objects}
            found = [self.namespace(n) for n in sorted(names)]
        if _wants_table(accept):
            return _table(NAMESPACES, found, {}, query)
        if len(parts) == 4:
            return found[0]
        return {"apiVersion": "v1", "kind": "NamespaceList", "metadata": {}, "items": found}

    def _describe_api(self, path: str) -> JSON | None:
        """What discovery, ``/openapi/v3`` and ``/version`` answer; None for other paths."""
        parts = [p for p in path.split("/") if p]
        groups = self._group_versions()
        if parts == ["version"]:
            return dict(VERSION_INFO)
        if parts == ["api"]:
            address = self.url.removeprefix("http://")
            return {
                "kind": "APIVersions",
                "versions": groups.get("", []),
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": address}
                ],
            }
        if len(parts) == 2 and parts[0] == "api":
            if parts[1] not in groups.get("", []):
                raise ApiError(404, "NotFound", f"the server could not find {path}")
            return self._resource_list("", parts[1])
        if parts == ["apis"]:
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [self._api_group(g, v) for g, v in groups.items() if g],
            }
        if len(parts) in (2, 3) and parts[0] == "apis":
            versions = groups.get(parts[1], []) if parts[1] else []
            if not versions or (len(parts) == 3 and parts[2] not in versions):
                raise ApiError(404, "NotFound", f"the server could not find {path}")
            if len(parts) == 2:
                return {
                    "kind": "APIGroup",
                    "apiVersion": "v1",
                    **self._api_group(parts[1], versions),
                }
            return self._resource_list(parts[1], parts[2])
        if parts[:2] == ["openapi", "v3"]:
            docs = self._openapi_docs()
            if len(parts) == 2:
                return {
                    "paths": {
                        key: {"serverRelativeURL": f"/openapi/v3/{key}?hash={_hash(doc)}"}
                        for key, doc in docs.items()
                    }
                }
            doc = docs.get("/".join(parts[2:]))
            if doc is None:
                raise ApiError(404, "NotFound", f"the server could not find {path}")
            return doc
        return None

    def handle(
        self,
        method: str,
        path: str,
        query: Mapping[str, str],
        body: Any,
        ctype: str,
        accept: str = "",
        warnings: Strings | None = None,
    ) -> Any:
        """One request: the answer's JSON, or raises :class:`ApiError`. ``accept`` asking for
        ``as=Table;g=meta.k8s.io`` gets a GET's answer as a Table; the warnings of a write
        (``fieldValidation=Warn``, the default) are added to ``warnings``."""
        with self._cond:
            if self._fault is not None:
                raise ApiError(self._fault, "ServiceUnavailable", "the API server is failing")
            if method == "GET":
                described = self._describe_api(path)
                if described is not None:
                    return described
                parts = [p for p in path.split("/") if p]
                if parts[:3] == ["api", "v1", "namespaces"] and len(parts) in (3, 4):
                    return self._namespaces(parts, accept, query)
            rtype, namespace, name, status = self._route(path)
            write = _Write(query.get("fieldValidation") or "Warn")
            if write.validation not in _FIELD_VALIDATION:
                raise ApiError(
                    400,
                    "BadRequest",
                    f"fieldValidation: Unsupported value: {json.dumps(write.validation)}: "
                    'supported values: "Ignore", "Strict", "Warn"',
                )
            if warnings is not None:
                write.warnings = warnings
            table = method == "GET" and _wants_table(accept)
            if name is None:
                if method == "GET":
                    listed = self._list(rtype, namespace, query.get("fieldSelector", ""))
                    if table:
                        return _table(rtype, listed["items"], listed["metadata"], query)
                    return listed
                if method == "POST" and namespace is not None:
                    return self._create(rtype, namespace, copy.deepcopy(body), write)
                raise ApiError(405, "MethodNotAllowed", f"{method} {path}")
            assert namespace is not None
            if method == "GET":
                obj = copy.deepcopy(self._existing(rtype, namespace, name))
                return _table(rtype, [obj], {}, query) if table else obj
            if method == "PUT":
                return self._replace(
                    rtype, namespace, name, copy.deepcopy(body), status, write=write
                )
            if method == "PATCH":
                return self._patch(rtype, namespace, name, body, ctype, status, write)
            if method == "DELETE" and not status:
                return self._delete(rtype, namespace, name)
            raise ApiError(405, "MethodNotAllowed", f"{method} {path}")

    def _route(self, path: str) -> tuple[ResourceType, str | None, str | None, bool]:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            parts = ["apis", "", *parts[1:]]  # the core group
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


# -- Tables, selectors, JSONPath ------------------------------------------------------------


def _wants_table(accept: str) -> bool:
    return any("as=Table" in part and "g=meta.k8s.io" in part for part in accept.split(","))


def _table(rtype: ResourceType, objects: list[JSON], meta: JSON, query: Mapping[str, str]) -> JSON:
    """``objects`` as ``kubectl get`` asks for them: Name, then the type's columns; each row
    with the object's metadata (``includeObject``: Metadata, the default, Object or None)."""
    columns = rtype.columns or (AGE,)
    include = query.get("includeObject") or "Metadata"
    rows: list[JSON] = []
    for obj in objects:
        first = [obj["metadata"].get("name", "")] if rtype.name_first else []
        row: JSON = {"cells": [*first, *(c.cell(obj) for c in columns)]}
        if include == "Object":
            row["object"] = obj
        elif include == "Metadata":
            row["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"],
            }
        rows.append(row)
    name = Column("Name", "string", description=NAME_DOC, format="name")
    first = [name.definition()] if rtype.name_first else []
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": dict(meta),
        "columnDefinitions": [*first, *(c.definition() for c in columns)],
        "rows": rows,
    }


def _field_selector(selector: str) -> list[tuple[str, bool, str]]:
    """``a.b=x,c!=y`` as (path, equal, value) terms."""
    terms: list[tuple[str, bool, str]] = []
    for term in filter(None, (t.strip() for t in selector.split(","))):
        match = re.fullmatch(r"([^=!]+)(==|=|!=)(.*)", term)
        if match is None:
            raise ApiError(400, "BadRequest", f'invalid field selector: "{term}"')
        terms.append((match[1].strip(), match[2] != "!=", match[3].strip()))
    return terms


def _field(obj: JSON, path: str) -> str:
    value: Any = obj
    for step in path.split("."):
        value = value.get(step) if isinstance(value, dict) else None
    return "" if value is None else _text(value)


_STEP = re.compile(
    r"\.(?P<field>(?:\\.|[^.\[\]\\])+)"
    r"|\[(?P<index>\d+|\*)\]"
    r"|\[\?\(@(?P<key>(?:\.[^.\[\]=!)\s]+)+)\s*(?P<op>==|!=)\s*"
    r"(?:\"(?P<dq>[^\"]*)\"|'(?P<sq>[^']*)'|(?P<bare>[^)\s]+))\)\]"
)


def jsonpath(doc: Any, path: str) -> list[Any]:
    """What the JSONPath ``path`` finds in ``doc``: the subset printer columns use
    (``.a.b``, ``.a\\.b`` for a key with a dot, ``[0]``, ``[*]``, and filters
    ``[?(@.k=="v")]`` or ``!=``); ValueError for anything else."""
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    text = text.removeprefix("$")
    found = [doc]
    pos = 0
    while pos < len(text):
        step = _STEP.match(text, pos)
        if step is None:
            raise ValueError(f"JSONPath {path!r}: not served here from {text[pos:]!r}")
        pos = step.end()
        after: list[Any] = []
        for value in found:
            if step["field"] is not None:
                key = step["field"].replace("\\.", ".")
                if isinstance(value, dict) and key in value:
                    after.append(value[key])
            elif step["index"] == "*":
                after.extend(value if isinstance(value, list) else [])
                after.extend(value.values() if isinstance(value, dict) else [])
            elif step["index"] is not None:
                index = int(step["index"])
                if isinstance(value, list) and index < len(value):
                    after.append(value[index])
            else:
                want = next(v for v in (step["dq"], step["sq"], step["bare"]) if v is not None)
                for item in value if isinstance(value, list) else []:
                    got = jsonpath(item, step["key"])
                    if bool(got and _text(got[0]) == want) == (step["op"] == "=="):
                        after.append(item)
        found = after
    return found


def _text(value: Any) -> str:
    """A value as a JSONPath printer prints it."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


def _age(timestamp: str) -> str:
    """The time since ``timestamp`` (RFC 3339) as kubectl shows it; ``<unknown>`` if none."""
    if not timestamp:
        return "<unknown>"
    try:
        then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    return human_duration((datetime.now(UTC) - then).total_seconds())


def human_duration(seconds: float) -> str:
    """Kubernetes' ``duration.HumanDuration``: 45s, 3m20s, 15m, 5h3m, 3d4h, 2y10d."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes, hours, days = s // 60, s // 3600, s // 86400
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if hours < 24 * 365 * 2:
        return f"{days}d"
    if hours < 24 * 365 * 8:
        return f"{days // 365}y{days % 365}d" if days % 365 else f"{days // 365}y"
    return f"{days // 365}y"


# -- OpenAPI v3 ------------------------------------------------------------------------------


def _hash(doc: JSON) -> str:
    return hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest().upper()


def _schema_name(rtype: ResourceType) -> str:
    """As the API server names definitions: io.apogee.v1alpha1.Topic for apogee.io."""
    if rtype.group == "coordination.k8s.io" or not rtype.group:
        group = rtype.group.split(".")[0] or "core"
        return f"io.k8s.api.{group}.{rtype.version}.{rtype.kind}"
    return ".".join([*reversed(rtype.group.split(".")), rtype.version, rtype.kind])


def _openapi_document(key: str, types: list[ResourceType]) -> JSON:
    """The document of one group version: each type's schema, and its paths with the
    operations served; every write takes ``fieldValidation`` (so kubectl leaves the checks to
    this server) and patches are JSON or merge patches (kubectl sends merge patches)."""
    schemas: JSON = {}
    paths: JSON = {}

    def param(name: str, where: str = "query", kind: str = "string") -> JSON:
        return {
            "name": name,
            "in": where,
            "required": where == "path",
            "schema": {"type": kind},
            "uniqueItems": True,
        }

    writes = [param("dryRun"), param("fieldManager"), param("fieldValidation")]
    for rtype in types:
        ref = _schema_name(rtype)
        gvk = {"group": rtype.group, "version": rtype.version, "kind": rtype.kind}
        list_gvk = {**gvk, "kind": f"{rtype.kind}List"}
        schema = copy.deepcopy(rtype.schema or rtype.openapi or {"type": "object"})
        schemas[ref] = {**schema, "x-kubernetes-group-version-kind": [gvk]}
        schemas[f"{ref}List"] = {
            "type": "object",
            "required": ["items"],
            "properties": {
                "apiVersion": {"type": "string"},
                "kind": {"type": "string"},
                "metadata": {"type": "object"},
                "items": {"type": "array", "items": {"$ref": f"#/components/schemas/{ref}"}},
            },
            "x-kubernetes-group-version-kind": [list_gvk],
        }

        def op(
            action: str,
            target: str,
            kind: JSON,
            body: tuple[str, ...] = (),
            rtype: ResourceType = rtype,
            ref: str = ref,
        ) -> JSON:
            answer = {"schema": {"$ref": f"#/components/schemas/{target}"}}
            operation: JSON = {
                "operationId": f"{action}{rtype.kind}",
                "responses": {
                    "200": {"description": "OK", "content": {"application/json": answer}}
                },
                "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": kind,
            }
            if body:
                operation["requestBody"] = {
                    "content": {
                        c: {"schema": {"$ref": f"#/components/schemas/{ref}"}} for c in body
                    },
                    "required": True,
                }
                operation["parameters"] = writes
            return operation

        patches = ("application/json-patch+json", "application/merge-patch+json")
        base = f"/{key}/namespaces/{{namespace}}/{rtype.plural}"
        namespace = [param("namespace", "path")]
        named = [param("name", "path"), *namespace]
        paths[base] = {
            "get": op("list", f"{ref}List", list_gvk),
            "post": op("post", ref, gvk, ("application/json",)),
            "parameters": namespace,
        }
        paths[f"{base}/{{name}}"] = {
            "get": op("get", ref, gvk),
            "put": op("put", ref, gvk, ("application/json",)),
            "patch": op("patch", ref, gvk, patches),
            "delete": op("delete", ref, gvk),
            "parameters": named,
        }
        if rtype.status_subresource:
            paths[f"{base}/{{name}}/status"] = {
                "get": op("get", ref, gvk),
                "put": op("put", ref, gvk, ("application/json",)),
                "patch": op("patch", ref, gvk, patches),
                "parameters": named,
            }
        paths[f"/{key}/{rtype.plural}"] = {"get": op("list", f"{ref}List", list_gvk)}
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": VERSION_INFO["gitVersion"]},
        "paths": paths,
        "components": {"schemas": schemas},
    }


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


def _default_and_prune(
    schema: Mapping[str, Any], value: Any, path: str, unknown: list[str]
) -> None:
    """Fill in defaults and drop the fields the schema does not know (their paths added to
    ``unknown``)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        if props is None:
            return
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            for key in [k for k in value if k not in props]:
                if path or key not in ("apiVersion", "kind", "metadata"):
                    unknown.append(f"{path}.{key}" if path else key)
                    del value[key]
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value and (path or key != "metadata"):
                _default_and_prune(sub, value[key], f"{path}.{key}" if path else key, unknown)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _default_and_prune(schema["items"], item, f"{path}[{i}]", unknown)


def _validate(
    schema: Mapping[str, Any], value: Any, path: str, out: list[Cause], top: bool = False
) -> None:
    where = path or "<root>"

    def bad(rule: str) -> None:
        out.append((where, "FieldValueInvalid", f"Invalid value: {json.dumps(value)}: {rule}"))

    kind = schema.get("type")
    if kind is not None:
        ok = isinstance(value, _TYPES.get(kind, (object,)))
        if kind in ("integer", "number") and isinstance(value, bool):
            ok = False
        if not ok:
            out.append(
                (
                    where,
                    "FieldValueTypeInvalid",
                    f'Invalid value: "{type(value).__name__}": {where} in body must be of '
                    f"type {kind}",
                )
            )
            return
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(json.dumps(v) for v in schema["enum"])
        out.append(
            (
                where,
                "FieldValueNotSupported",
                f"Unsupported value: {json.dumps(value)}: supported values: {allowed}",
            )
        )
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
                out.append(
                    (f"{path + '.' if path else ''}{req}", "FieldValueRequired", "Required value")
                )
        for key, sub in (schema.get("properties") or {}).items():
            if key in value and not (top and key == "metadata"):
                _validate(sub, value[key], f"{path + '.' if path else ''}{key}", out)


def _handler_for(api: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: tests read api.requests

        def _answer(self, status: int, doc: Any, warnings: Iterable[str] = ()) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            for warning in warnings:
                self.send_header("Warning", f"299 - {json.dumps(warning)}")
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
                warnings: list[str] = []
                doc = api.handle(
                    method,
                    parts.path,
                    query,
                    body,
                    self.headers.get("Content-Type", ""),
                    self.headers.get("Accept", ""),
                    warnings,
                )
            except ApiError as err:
                self._answer(err.status, err.body())
                return
            self._answer(201 if method == "POST" else 200, doc, warnings)

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
