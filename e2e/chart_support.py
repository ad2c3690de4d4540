"""What the Helm chart's tests (:mod:`e2e.test_chart`) share: the chart rendered and linted
through the Helm SDK (``helm-python-sdk``: Helm's own Go code in a shared library, so no
``helm`` binary), the rendered objects and their containers, the environment a container sees
(``$(VAR)`` expanded as the kubelet does), and a small evaluator of NetworkPolicies that says
whether one pod may open a connection to another.

No Kubernetes API server runs here: the objects are checked as rendered, against the
Kubernetes schemas (``kubernetes-validate``) and by the rules below."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "apogee"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE = "apogee"
NAMESPACE = "mq"
#: The workloads of the chart: component -> (kind, name with the default release).
WORKLOADS = {
    "nameserver": ("StatefulSet", "apogee-nameserver"),
    "broker": ("StatefulSet", "apogee-broker"),
    "schedule": ("Deployment", "apogee-schedule"),
    "txn-checker": ("Deployment", "apogee-txn-checker"),
}
#: The label of a broker replica group's pods (broker.replication.replicasPerGroup > 1): the
#: group's StatefulSet name, which is also its broker name.
GROUP_LABEL = "apogee.io/broker-group"
#: The web console (an HTTP service, not a gRPC one like the workloads above).
CONSOLE = ("Deployment", "apogee-console")
#: Everything optional turned on.
EVERYTHING = {
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "dashboards": {"enabled": True},
    "operator": {"enabled": True},
    "console": {"ingress": {"enabled": True, "host": "console.example.com", "tls": True}},
}

Obj = dict[str, Any]


def ci_values(name: str) -> dict[str, Any]:
    """The values of ``charts/apogee/ci/<name>``."""
    loaded: dict[str, Any] = yaml.safe_load((CHART / "ci" / name).read_text()) or {}
    return loaded


@functools.cache
def _render(values_json: str, release: str) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(
            json.loads(values_json), name=release, namespace=NAMESPACE, is_install=True
        )


def render_files(values: Mapping[str, Any] | None = None, release: str = RELEASE) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included), as ``helm install`` renders them."""
    return _render(json.dumps(values or {}, sort_keys=True), release)


def render(values: Mapping[str, Any] | None = None, release: str = RELEASE) -> list[Obj]:
    """The objects the chart renders with ``values`` (hooks such as the test pod included)."""
    objs: list[Obj] = []
    for path, text in sorted(render_files(values, release).items()):
        if path.endswith("NOTES.txt"):
            continue
        objs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objs


def crds() -> list[Obj]:
    """The CustomResourceDefinitions of ``crds/``, which Helm installs as they are."""
    found: list[Obj] = []
    for path in sorted((CHART / "crds").glob("*.yaml")):
        found.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return found


def render_error(values: Mapping[str, Any]) -> str:
    """The message with which the chart refuses ``values`` (fails when it accepts them)."""
    try:
        with helm.Chart.load(CHART) as chart:
            chart.render(dict(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    except (helm.HelmValuesError, helm.HelmRenderError) as err:
        return str(err)
    raise AssertionError(f"the chart accepted {values!r}")


def lint(values: Mapping[str, Any] | None, kube_version: str) -> list[dict[str, Any]]:
    """``helm lint --strict`` findings above the informational ones."""
    report = helm.lint(
        CHART, dict(values) if values else None, strict=True, kube_version=kube_version
    )
    messages: list[dict[str, Any]] = report["messages"]
    return [m for m in messages if m["severity"] > 1] + [
        {"severity": 3, "path": "", "error": e} for e in report["errors"]
    ]


def objects(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def component_of(workload: Obj) -> str:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels["app.kubernetes.io/component"]


def workload(objs: list[Obj], component: str) -> Obj:
    """The workload of ``component`` (see :data:`WORKLOADS`); for brokers in replica groups,
    the first group's StatefulSet."""
    kind, _ = WORKLOADS[component]
    found = sorted(
        (o for o in objects(objs, kind) if component_of(o) == component),
        key=lambda o: str(o["metadata"]["name"]),
    )
    assert found, f"no {kind} of {component}"
    return found[0]


def broker_groups(objs: list[Obj]) -> dict[str, Obj]:
    """Group name -> StatefulSet, of the brokers in replica groups."""
    return {
        o["metadata"]["name"]: o
        for o in objects(objs, "StatefulSet")
        if component_of(o) == "broker" and GROUP_LABEL in o["spec"]["selector"]["matchLabels"]
    }


def pod_specs(objs: list[Obj]) -> Iterator[tuple[str, Obj, Obj]]:
    """(``Kind/name``, pod metadata, pod spec) of every workload and bare pod."""
    for o in objs:
        where = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("StatefulSet", "Deployment"):
            template = o["spec"]["template"]
            yield where, template["metadata"], template["spec"]
        elif o["kind"] == "Pod":
            yield where, o["metadata"], o["spec"]


def container(workload: Obj) -> Obj:
    containers: list[Obj] = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_env(c: Obj, pod_name: str, namespace: str = NAMESPACE) -> dict[str, str]:
    """The container's environment in pod ``pod_name``: fieldRefs to the pod's name and namespace
    resolved, ``$(VAR)`` references to variables defined before expanded (the kubelet's rule)."""
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace}
    env: dict[str, str] = {}
    for var in c.get("env", []):
        if "valueFrom" in var:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = _VAR.sub(
                lambda m: env.get(m.group(1), m.group(0)), str(var.get("value", ""))
            )
    return env


def secret_file(spec: Obj, c: Obj, path: str) -> tuple[str, str, int]:
    """Where file ``path`` of container ``c`` (of pod ``spec``) comes from: (Secret name, key,
    file mode), through the container's read-only mount and the pod's secret or projected
    volume; fails when the file is not a Secret's or its mount is writable."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in c.get("volumeMounts", []):
        folder = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(folder):
            continue
        assert mount.get("readOnly") is True, f"{mount['name']} is mounted writable"
        relative = path[len(folder) :]
        volume = volumes[mount["name"]]
        if "secret" in volume:
            sources = [{"secret": {"name": volume["secret"]["secretName"], **volume["secret"]}}]
            mode = volume["secret"].get("defaultMode", 0o644)
        else:
            sources = volume["projected"]["sources"]
            mode = volume["projected"].get("defaultMode", 0o644)
        for source in sources:
            for item in source["secret"].get("items", []):
                if item["path"] == relative:
                    return source["secret"]["name"], item["key"], item.get("mode", mode)
        raise AssertionError(f"{path}: no item {relative!r} in volume {mount['name']}")
    raise AssertionError(f"{path}: not on a mounted volume")


def dns_name_matches(pattern: str, name: str) -> bool:
    """Whether a certificate's DNS name ``pattern`` (``*.`` wildcards of one label) covers
    ``name``, as TLS clients check it (RFC 6125)."""
    if pattern.startswith("*."):
        label, _, rest = name.partition(".")
        return bool(label) and rest == pattern[2:]
    return pattern == name


def pod_dns_name(pod: str, service: str, namespace: str = NAMESPACE) -> str:
    return f"{pod}.{service}.{namespace}.svc.cluster.local"


def values_leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of every value that is not a non-empty map (scalars, lists, empty maps)."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from values_leaves(value, f"{path}.")
        else:
            yield path


# -- NetworkPolicies ------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    """A pod as NetworkPolicies see it: its labels and its namespace's labels."""

    name: str
    labels: Mapping[str, str]
    namespace: str = NAMESPACE
    namespace_labels: Mapping[str, str] = field(default_factory=dict)


def _matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector {selector} not understood here"
    wanted: Mapping[str, str] = selector.get("matchLabels", {})
    return all(labels.get(k) == v for k, v in wanted.items())


def _peer_matches(peer: Obj, policy_namespace: str, pod: Pod | None) -> bool:
    """Whether ``peer`` (a NetworkPolicyPeer) covers ``pod`` (None: an address outside)."""
    if "ipBlock" in peer:
        return pod is None
    if pod is None:
        return False
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], pod.namespace_labels):
            return False
    elif pod.namespace != policy_namespace:
        return False
    return _matches(peer.get("podSelector", {}), pod.labels)


def _rule_allows(rule: Obj, peers_key: str, namespace: str, pod: Pod | None, port: int) -> bool:
    ports = rule.get("ports")
    if ports and not any(
        p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in ports
    ):
        return False
    peers = rule.get(peers_key)
    return not peers or any(_peer_matches(p, namespace, pod) for p in peers)


def _direction_allows(
    policies: list[Obj], subject: Pod, direction: str, other: Pod | None, port: int
) -> bool:
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == subject.namespace
        and direction in p["spec"].get("policyTypes", ["Ingress"])
        and _matches(p["spec"]["podSelector"], subject.labels)
    ]
    if not selecting:
        return True
    return any(
        _rule_allows(rule, peers_key, p["metadata"]["namespace"], other, port)
        for p in selecting
        for rule in p["spec"].get(key) or []
    )


def may_connect(policies: list[Obj], source: Pod, target: Pod | None, port: int) -> bool:
    """Whether ``source`` may open a TCP connection to ``target`` (None: an address outside the
    cluster's pods) on ``port``: its egress and the target's ingress must both allow it."""
    if not _direction_allows(policies, source, "Egress", target, port):
        return False
    return target is None or _direction_allows(policies, target, "Ingress", source, port)


def chart_pods(objs: list[Obj]) -> dict[str, Pod]:
    """The chart's pods (the console's when it is deployed), the test pod, a client labelled to
    connect, a stranger, Prometheus in its own namespace, a labelled client of another
    namespace and the ingress controller."""
    pods = {
        component: Pod(
            component, workload(objs, component)["spec"]["template"]["metadata"]["labels"]
        )
        for component in WORKLOADS
    }
    kind, name = CONSOLE
    for console in (o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name):
        pods["console"] = Pod("console", console["spec"]["template"]["metadata"]["labels"])
    test_pod = objects(objs, "Pod")[0]
    pods["test"] = Pod("test", test_pod["metadata"]["labels"])
    pods["client"] = Pod("client", {"apogee-client": "true", "app": "orders"})
    pods["stranger"] = Pod("stranger", {"app": "orders"})
    pods["prometheus"] = Pod(
        "prometheus", {"app.kubernetes.io/name": "prometheus"}, "monitoring", {"name": "monitoring"}
    )
    pods["other-namespace"] = Pod("other-namespace", {"apogee-client": "true"}, "elsewhere")
    pods["ingress-controller"] = Pod(
        "ingress-controller",
        {"app.kubernetes.io/name": "ingress-nginx"},
        "ingress-nginx",
        {"kubernetes.io/metadata.name": "ingress-nginx"},
    )
    return pods


#: (target, port) -> the sources that may connect, of the pods of :func:`chart_pods`.
ALLOWED_CONNECTIONS = {
    ("nameserver", 9876): {"broker", "schedule", "txn-checker", "client", "test", "console"},
    ("broker", 10911): {"schedule", "txn-checker", "client", "test", "console"},
    ("nameserver", 9880): {"prometheus"},
    ("broker", 10912): {"prometheus"},
    ("schedule", 9710): {"prometheus"},
    ("txn-checker", 9711): {"prometheus"},
    ("schedule", 9700): set(),  # health: the kubelet only, which policies do not filter
    ("txn-checker", 9701): set(),
    # the console's pages: nobody by default (`kubectl port-forward` is not filtered)
    ("console", 8080): set(),
    ("console", 8081): {"prometheus"},
}
