"""The Helm chart (``charts/apogee``) and ``skaffold.yaml``, without a Kubernetes cluster.

The chart is linted and rendered by Helm's own code (the ``helm-python-sdk`` wheel carries it as
a shared library). Every rendered object must be valid for Kubernetes 1.29 to 1.34
(``kubernetes-validate --strict``); the schema and the chart's own checks must refuse bad values
with a message naming the value; and the rendered objects must say what the deployment needs:
gRPC probes the services answer, hardened pods, disruption budgets, NetworkPolicies that let
only what must talk talk (evaluated for every pair of pods), Lease RBAC, each broker advertising
its stable DNS name, the alerts and dashboards as shipped (the ``security`` values:
:mod:`e2e.test_chart_security`). The environment the chart gives each
container is loaded by that service's own settings classes, the probes' health services are
asked of real processes, and the ``helm test`` pod's script runs against a real local cluster.
``skaffold.yaml`` is checked against Skaffold's JSON schema (``charts/schemas/``) and against
the images ``scripts/images.sh`` builds."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from apogee.common.settings import load
from apogee.rpc.server import check_health
from apogee.testkit.processes import LeaderProcess
from apogee_broker.settings import BrokerSettings
from apogee_nameserver.settings import NameServerSettings
from apogee_schedule.settings import ScheduleSettings
from apogee_txn_checker.settings import TxnCheckerSettings
from e2e.chart_support import (
    ALLOWED_CONNECTIONS,
    CHART,
    CI_VALUES,
    CONSOLE,
    EVERYTHING,
    GROUP_LABEL,
    NAMESPACE,
    ROOT,
    WORKLOADS,
    Obj,
    Pod,
    chart_pods,
    ci_values,
    component_of,
    container,
    container_env,
    crds,
    lint,
    may_connect,
    objects,
    one,
    pod_dns_name,
    pod_specs,
    render,
    render_error,
    render_files,
    values_leaves,
)
from e2e.harness import Cluster

KUBERNETES_VERSIONS = ["1.29", "1.30", "1.31", "1.32", "1.33", "1.34"]
#: Value sets: the defaults, everything optional on, and each ci/ file.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "everything": EVERYTHING,
    **{path.name: ci_values(path.name) for path in CI_VALUES},
}
#: Kinds of custom resources, which kubernetes-validate has no schema for: prometheus-operator's,
#: checked by the tests of their own below; the chart's own (crds/), checked against their CRDs
#: in :mod:`e2e.test_chart_topics`.
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "Topic", "ConsumerGroup"}
RULES = CHART / "rules" / "apogee-alerts.yaml"
SKAFFOLD = ROOT / "skaffold.yaml"
SKAFFOLD_SCHEMA = ROOT / "charts" / "schemas" / "skaffold-v4beta14.json"
IMAGES_SCRIPT = ROOT / "scripts" / "images.sh"
#: component -> (settings class, APOGEE_<PREFIX>_, liveness/readiness health service).
SERVICES: dict[str, tuple[type[Any], str, str]] = {
    "nameserver": (NameServerSettings, "nameserver", "apogee.v1.NameServer"),
    "broker": (BrokerSettings, "broker", "apogee.v1.Broker"),
    "schedule": (ScheduleSettings, "schedule", "apogee.schedule.Process"),
    "txn-checker": (TxnCheckerSettings, "txn_checker", "apogee.txn_checker.Process"),
}
#: TLS and authentication on (ci/secure-values.yaml), and the Secrets it names.
SECURE = ci_values("secure-values.yaml")

pytestmark = [pytest.mark.e2e]


# -- lint and Kubernetes schemas -------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
@pytest.mark.parametrize("kube", ["v1.29.0", "v1.34.0"])
def test_helm_lint_strict_finds_nothing(name: str, kube: str) -> None:
    assert lint(VALUE_SETS[name], kube) == []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_kubernetes(version: str) -> None:
    checked: set[str] = set()
    sets = [(name, render(values)) for name, values in VALUE_SETS.items()]
    for name, objs in [*sets, ("crds/", crds())]:
        for obj in objs:
            key = json.dumps(obj, sort_keys=True)
            if key in checked:
                continue
            checked.add(key)
            where = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
            if obj["kind"] in CUSTOM_KINDS:
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                path = ".".join(str(p) for p in err.path)
                pytest.fail(f"{where} is not valid for Kubernetes {version}: {path}: {err.message}")
    assert len(checked) > 30


# -- values: schema, documentation, the chart's own checks ----------------------------------


BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"broker": {"replicas": 0}}, "at '/broker/replicas': minimum: got 0, want 1"),
    ({"broker": {"replica": 3}}, "at '/broker': additional properties 'replica' not allowed"),
    ({"leadership": {"mode": "zookeeper"}}, "at '/leadership/mode': value must be one of"),
    ({"broker": {"flushMode": "fsync"}}, "at '/broker/flushMode': value must be one of 'async'"),
    ({"broker": {"persistence": {"size": "lots"}}}, "at '/broker/persistence/size': 'lots'"),
    ({"nameserver": {"ports": {"grpc": 70000}}}, "at '/nameserver/ports/grpc': maximum"),
    (
        {"broker": {"settings": {"Retention Hours": 3}}},
        "at '/broker/settings': additional properties 'Retention Hours' not allowed",
    ),
    ({"schedule": {"image": {"digest": "latest"}}}, "at '/schedule/image/digest': 'latest'"),
    ({"fullnameOverride": "Apogee_MQ"}, "at '/fullnameOverride': 'Apogee_MQ' does not match"),
    ({"broker": {"podAntiAffinity": "strict"}}, "at '/broker/podAntiAffinity': value must be"),
    ({"txnChecker": {"logLevel": "TRACE"}}, "at '/txnChecker/logLevel': value must be one of"),
    ({"tests": {"topic": "a b"}}, "at '/tests/topic': 'a b' does not match"),
    ({"fullnameOverride": "a" * 41}, "at '/fullnameOverride': maxLength: got 41, want 40"),
    ({"tests": {"image": {"repository": ""}}}, "at '/tests/image/repository': minLength: got 0"),
    (
        {"security": {"tls": {"clientAuth": "optional"}}},
        "at '/security/tls/clientAuth': value must be one of 'none', 'require'",
    ),
    (
        {"security": {"auth": {"usersSecret": "Apogee_Users"}}},
        "at '/security/auth/usersSecret': 'Apogee_Users' does not match",
    ),
    ({"security": {"tls": {"secret": "x"}}}, "at '/security/tls': additional properties 'secret'"),
    ({"console": {"ports": {"http": 0}}}, "at '/console/ports/http': minimum: got 0, want 1"),
    ({"console": {"replicas": 2}}, "at '/console': additional properties 'replicas' not allowed"),
    (
        {"console": {"ingress": {"host": "Console Example"}}},
        "at '/console/ingress/host': 'Console Example' does not match",
    ),
    (
        {"console": {"ingress": {"pathType": "Regex"}}},
        "at '/console/ingress/pathType': value must be one of",
    ),
    (
        {"console": {"prometheusUrl": "prometheus:9090"}},
        "at '/console/prometheusUrl': 'prometheus:9090' does not match",
    ),
    (
        {"console": {"usersSecret": "Console_Users"}},
        "at '/console/usersSecret': 'Console_Users' does not match",
    ),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_the_schema_refuses_bad_values(values: dict[str, Any], message: str) -> None:
    error = render_error(values)
    assert "values don't meet the specifications of the schema" in error
    assert message in error, error


BAD_COMBINATIONS: list[tuple[dict[str, Any], str]] = [
    (
        {"leadership": {"mode": "file"}},
        "schedule.replicas: is 2, but leadership.mode=file keeps the lock file in each pod",
    ),
    (
        {"broker": {"settings": {"advertised_address": "x:1"}}},
        "broker.settings.advertised_address: is set by the chart from the pod's DNS name",
    ),
    (
        {"schedule": {"settings": {"leadership": "file"}}},
        "schedule.settings.leadership: is set by the chart from leadership.mode",
    ),
    (
        {"nameserver": {"ports": {"grpc": 9880}}},
        "nameserver.ports: grpc and metrics are both 9880",
    ),
    ({"nameOverride": "a" * 35}, "at most 40 keep every pod's DNS name within 63"),
    (
        {"security": {"tls": {"enabled": True}}},
        "security.tls.existingSecret: is empty, but security.tls.enabled=true needs it",
    ),
    (
        {"security": {"auth": {"enabled": True, "serviceCredentialsSecret": "s"}}},
        "security.auth.usersSecret: is empty, but security.auth.enabled=true needs it",
    ),
    (
        {"security": {"auth": {"enabled": True, "usersSecret": "u"}}},
        "security.auth.serviceCredentialsSecret: is empty, but security.auth.enabled=true needs",
    ),
    (
        {**SECURE, "broker": {"settings": {"tls_ca_file": "/x"}}},
        "broker.settings.tls_ca_file: is set by the chart from security.tls.existingSecret",
    ),
    (
        {**SECURE, "schedule": {"settings": {"auth_users_file": "/x"}}},
        "schedule.settings.auth_users_file: is set by the chart from security.auth.usersSecret",
    ),
    (
        {"console": {"settings": {"console_users_file": "/x"}}},
        "console.settings.console_users_file: is set by the chart from console.usersSecret",
    ),
    (
        {"console": {"settings": {"listen": "0.0.0.0:80"}}},
        "console.settings.listen: is set by the chart from console.ports.http",
    ),
    ({"console": {"ports": {"http": 8081}}}, "console.ports: http and metrics are both 8081"),
    (
        {"console": {"ingress": {"enabled": True, "tls": True}}},
        "console.ingress.tls: is true, but console.ingress.host is empty",
    ),
    (
        {"console": {"credentialsSecret": "c"}},
        "console.credentialsSecret: is set, but security.auth.enabled=false",
    ),
]


@pytest.mark.parametrize(
    ("values", "message"), BAD_COMBINATIONS, ids=[m[:40] for _, m in BAD_COMBINATIONS]
)
def test_the_chart_refuses_bad_combinations(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)


def test_every_broken_rule_is_listed_in_one_failure() -> None:
    error = render_error(
        {
            "leadership": {"mode": "file"},
            "broker": {"settings": {"listen": "0.0.0.0:1", "data_dir": "/x"}},
        }
    )
    assert "Apogee chart: bad values:" in error
    for line in (
        "- schedule.replicas: is 2",
        "- txnChecker.replicas: is 2",
        "- broker.settings.listen: is set by the chart from broker.ports.grpc",
        "- broker.settings.data_dir: is set by the chart from the volume",
    ):
        assert line in error


def test_every_value_is_documented_and_in_the_schema() -> None:
    text = (CHART / "values.yaml").read_text()
    params = set(re.findall(r"^\s*## @param (\S+) \S", text, re.MULTILINE))
    values = yaml.safe_load(text)
    schema = json.loads((CHART / "values.schema.json").read_text())
    for leaf in values_leaves(values):
        parts = leaf.split(".")
        documented = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
        assert documented & params, f"{leaf}: no @param line in values.yaml"
        node = schema
        for part in parts:
            if "$ref" in node:
                node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
            if "properties" not in node:
                break  # a free-form map (resources, settings, ...)
            assert part in node["properties"], f"{leaf}: not in values.schema.json"
            node = node["properties"][part]
    for param in params:
        node = values
        for part in param.split("."):
            assert isinstance(node, dict), f"@param {param}: no such value"
            assert part in node, f"@param {param}: no such value"
            node = node[part]


# -- workloads -------------------------------------------------------------------------------


def test_the_workloads_and_their_images() -> None:
    objs = render()
    for component, (kind, name) in WORKLOADS.items():
        workload = one(objs, kind, name)
        image = container(workload)["image"]
        assert image == f"apogee/{component}:0.1.0"
        labels = workload["spec"]["selector"]["matchLabels"]
        assert labels["app.kubernetes.io/component"] == component
        assert "helm.sh/chart" not in labels
        assert "app.kubernetes.io/version" not in labels
    digest = "sha256:" + "a" * 64
    broker = one(
        render({"image": {"registry": "r.example"}, "broker": {"image": {"digest": digest}}}),
        "StatefulSet",
        "apogee-broker",
    )
    assert container(broker)["image"] == f"r.example/apogee/broker@{digest}"


def test_leader_services_run_two_replicas_with_a_lease() -> None:
    objs = render()
    for component in ("schedule", "txn-checker"):
        deployment = one(objs, "Deployment", f"apogee-{component}")
        assert deployment["spec"]["replicas"] == 2
        # a new replica comes up (a ready standby) before an old one goes
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {
            "maxSurge": 1,
            "maxUnavailable": 0,
        }
        prefix = f"APOGEE_{SERVICES[component][1].upper()}_"
        env = container_env(container(deployment), f"apogee-{component}-abc")
        assert env[prefix + "LEADERSHIP"] == "lease"
        assert env[prefix + "LEASE_NAME"] == f"apogee-{component}"
        assert env["POD_NAME"] == f"apogee-{component}-abc"
        spec = deployment["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == "apogee"
        assert spec["automountServiceAccountToken"] is True
    minimal = render(ci_values("minimal-values.yaml"))
    for component in ("schedule", "txn-checker"):
        deployment = one(minimal, "Deployment", f"apogee-{component}")
        env = container_env(container(deployment), "p")
        prefix = f"APOGEE_{SERVICES[component][1].upper()}_"
        assert env[prefix + "LEADERSHIP"] == "file"
        assert env[prefix + "LOCK_FILE"].startswith("/tmp/")
        assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert not objects(minimal, "Role")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_chart_env_is_accepted_by_each_service_settings(name: str) -> None:
    """What each container is given loads through the service's own settings classes (defaults
    < environment), as the process does at start; a setting the chart names that the service
    does not have fails here."""
    objs = render(VALUE_SETS[name])
    for component, (kind, _) in WORKLOADS.items():
        found = [o for o in objects(objs, kind) if component_of(o) == component]
        if not found:
            assert component in ("schedule", "txn-checker"), f"{name}: no {component}"
            continue
        cls, prefix, _ = SERVICES[component]
        env = container_env(container(found[0]), f"{found[0]['metadata']['name']}-0")
        # APOGEE_PROBE_*: the probe command's TLS (security.tls), not the service's settings
        apogee = {
            k: v
            for k, v in env.items()
            if k.startswith("APOGEE_") and not k.startswith("APOGEE_PROBE_")
        }
        fields = {f"APOGEE_{prefix.upper()}_{f.upper()}" for f in cls.__dataclass_fields__}
        assert set(apogee) <= fields, f"{component}: no such settings {set(apogee) - fields}"
        settings = load(cls, prefix, env=apogee)
        assert settings.listen.endswith(f":{container(found[0])['ports'][0]['containerPort']}")


def test_settings_maps_become_the_services_environment() -> None:
    values = {
        "broker": {
            "settings": {
                "commitlog_file_size": 1073741824,
                "disk_high_water_ratio": 0.8,
                "retention_hours": 48,
            }
        },
        "schedule": {"settings": {"lead_ms": 3000, "lease_duration_s": 20}},
    }
    objs = render(values)
    env = container_env(container(one(objs, "StatefulSet", "apogee-broker")), "apogee-broker-0")
    assert env["APOGEE_BROKER_COMMITLOG_FILE_SIZE"] == "1073741824"
    broker = load(BrokerSettings, "broker", env=env)
    assert broker.commitlog_file_size == 1073741824
    assert broker.disk_high_water_ratio == 0.8
    assert broker.retention_hours == 48
    env = container_env(container(one(objs, "Deployment", "apogee-schedule")), "apogee-schedule-0")
    schedule = load(ScheduleSettings, "schedule", env=env)
    assert schedule.lead_ms == 3000
    assert schedule.lease_duration_s == 20


def test_each_broker_advertises_its_stable_dns_name() -> None:
    values = {"broker": {"replicas": 3}, "nameserver": {"replicas": 3}}
    objs = render(values)
    sts = one(objs, "StatefulSet", "apogee-broker")
    headless = one(objs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert (
        headless["spec"]["selector"].items()
        <= sts["spec"]["template"]["metadata"]["labels"].items()
    )
    nameservers = one(objs, "StatefulSet", "apogee-nameserver")
    ns_service = one(objs, "Service", nameservers["spec"]["serviceName"])
    assert ns_service["spec"]["clusterIP"] == "None"
    expected_namesrv = ";".join(
        f"{pod_dns_name(f'apogee-nameserver-{n}', 'apogee-nameserver')}:9876" for n in range(3)
    )
    advertised = set()
    for ordinal in range(3):
        pod = f"apogee-broker-{ordinal}"
        env = container_env(container(sts), pod)
        settings = load(BrokerSettings, "broker", env=env)
        assert settings.advertised_address == f"{pod_dns_name(pod, 'apogee-broker')}:10911"
        assert settings.broker_name == pod
        assert settings.namesrv == expected_namesrv
        assert str(settings.data_dir).startswith("/var/lib/apogee/data/")
        advertised.add(settings.advertised_address)
    assert len(advertised) == 3
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "data"
    mounts = {m["name"]: m["mountPath"] for m in container(sts)["volumeMounts"]}
    assert mounts["data"] == "/var/lib/apogee/data"


def test_probes_are_grpc_health_checks_on_the_grpc_port() -> None:
    objs = render()
    for component, (kind, name) in WORKLOADS.items():
        c = container(one(objs, kind, name))
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        _, _, health = SERVICES[component]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == grpc_port, f"{name} {probe}"
        assert c["livenessProbe"]["grpc"]["service"] == health
        if component in ("schedule", "txn-checker"):
            # a standby answers NOT_SERVING overall: readiness asks whether the process runs
            assert c["readinessProbe"]["grpc"]["service"] == health
            assert c["startupProbe"]["grpc"]["service"] == health
        else:
            assert "service" not in c["readinessProbe"]["grpc"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_pod_is_hardened(name: str) -> None:
    lease = VALUE_SETS[name].get("leadership", {}).get("mode", "lease") == "lease"
    for where, meta, spec in pod_specs(render(VALUE_SETS[name])):
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True, where
        assert pod_sc["runAsUser"] != 0, where
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes["tmp"], where
        assert not any("hostPath" in v for v in spec["volumes"]), where
        # the Lease holders read the API server (the brokers when in replica groups); the
        # console never does
        console = meta["labels"]["app.kubernetes.io/component"] == "console"
        grouped = GROUP_LABEL in meta["labels"]
        uses_api = (lease and where.startswith("Deployment/") and not console) or grouped
        assert spec["automountServiceAccountToken"] is uses_api, where
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["privileged"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], where
            assert "resources" not in c or name != "defaults", f"{where}: resources set by default"


def test_disruption_budgets_and_anti_affinity() -> None:
    objs = render()
    pdbs = {p["metadata"]["name"]: p for p in objects(objs, "PodDisruptionBudget")}
    assert set(pdbs) == {name for _, name in WORKLOADS.values()}
    for kind, name in WORKLOADS.values():
        workload = one(objs, kind, name)
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        pdb = pdbs[name]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        affinity = workload["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        term = affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
    hard = render({"broker": {"podAntiAffinity": "hard"}})
    sts = one(hard, "StatefulSet", "apogee-broker")
    required = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = required["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    assert not objects(render(ci_values("minimal-values.yaml")), "PodDisruptionBudget")


# -- who may talk to whom --------------------------------------------------------------------


def test_network_policies_let_only_what_must_talk_talk() -> None:
    objs = render()
    policies = objects(objs, "NetworkPolicy")
    assert len(policies) == 5
    pods = chart_pods(objs)
    for (target, port), allowed in ALLOWED_CONNECTIONS.items():
        may = {s for s, pod in pods.items() if may_connect(policies, pod, pods[target], port)}
        assert may == allowed, f"{target}:{port}"
    # egress: the Lease holders reach the API server; nothing else of the chart leaves
    for source in ("schedule", "txn-checker"):
        assert may_connect(policies, pods[source], None, 443)
    for source in ("nameserver", "broker"):
        assert not may_connect(policies, pods[source], None, 443)
    assert not may_connect(policies, pods["nameserver"], pods["broker"], 10911)
    for policy in policies:
        dns = policy["spec"]["egress"][0]
        assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}


def test_network_policies_variants() -> None:
    external = render({"networkPolicy": {"allowExternal": True}})
    policies = objects(external, "NetworkPolicy")
    pods = chart_pods(external)
    assert may_connect(policies, pods["stranger"], pods["broker"], 10911)
    assert may_connect(policies, pods["other-namespace"], pods["nameserver"], 9876)
    assert not may_connect(policies, pods["stranger"], pods["broker"], 10912)
    production = render(ci_values("production-values.yaml"))
    policies = objects(production, "NetworkPolicy")
    pods = chart_pods(production)
    labelled = Pod("app", {}, "shop", {"apogee.io/clients": "true"})
    assert may_connect(policies, labelled, pods["broker"], 10911)
    assert not may_connect(policies, pods["other-namespace"], pods["broker"], 10911)
    egress = one(production, "NetworkPolicy", "apogee-schedule")["spec"]["egress"]
    assert {
        "to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}],
        "ports": [{"protocol": "TCP", "port": 443}],
    } in egress
    operator = objects(render({"operator": {"enabled": True}}), "NetworkPolicy")
    reconciler = Pod(
        "operator",
        {
            "app.kubernetes.io/name": "apogee",
            "app.kubernetes.io/instance": "apogee",
            "app.kubernetes.io/component": "operator",
        },
    )
    assert may_connect(operator, reconciler, pods["broker"], 10911)
    assert not objects(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


# -- RBAC ------------------------------------------------------------------------------------


def _rules(role: Obj) -> dict[tuple[str, str], set[str]]:
    return {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


def test_rbac_is_limited_to_leases_and_the_custom_resources() -> None:
    objs = render()
    assert not objects(objs, "ClusterRole")
    assert not objects(objs, "ClusterRoleBinding")
    role = one(objs, "Role", "apogee-leases")
    assert _rules(role) == {("coordination.k8s.io", "leases"): {"get", "create", "update"}}
    binding = one(objs, "RoleBinding", "apogee-leases")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "apogee-leases",
    }
    account = one(objs, "ServiceAccount", "apogee")
    assert account["automountServiceAccountToken"] is False
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "apogee", "namespace": NAMESPACE}
    ]
    assert not [o for o in objs if "operator" in o["metadata"]["name"]]

    with_operator = render({"operator": {"enabled": True}})
    role = one(with_operator, "Role", "apogee-operator")
    assert _rules(role) == {
        ("apogee.io", "topics"): {"get", "list", "watch", "update", "patch"},
        ("apogee.io", "consumergroups"): {"get", "list", "watch", "update", "patch"},
        ("apogee.io", "topics/status"): {"get", "update", "patch"},
        ("apogee.io", "consumergroups/status"): {"get", "update", "patch"},
        ("coordination.k8s.io", "leases"): {"get", "create", "update"},
    }
    binding = one(with_operator, "RoleBinding", "apogee-operator")
    assert (
        binding["subjects"][0]["name"]
        == one(with_operator, "ServiceAccount", "apogee-operator")["metadata"]["name"]
    )
    # the custom resources the reconciler works on are the chart's CRDs (when it ships them)
    for crd in crds():
        plural = crd["spec"]["names"]["plural"]
        assert crd["spec"]["group"] == "apogee.io"
        assert crd["spec"]["scope"] == "Namespaced"  # a Role covers them
        assert ("apogee.io", plural) in _rules(role)
        if any("status" in v.get("subresources", {}) for v in crd["spec"]["versions"]):
            assert ("apogee.io", f"{plural}/status") in _rules(role)
    for role in objects(with_operator, "Role"):
        assert all("*" not in r["verbs"] and "delete" not in r["verbs"] for r in role["rules"])


# -- monitoring ------------------------------------------------------------------------------


def test_the_prometheus_rule_carries_every_alert_unchanged(tmp_path: Path) -> None:
    rule = one(render({"prometheusRule": {"enabled": True}}), "PrometheusRule", "apogee")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    shipped = yaml.safe_load(RULES.read_text())
    assert rule["spec"] == {"groups": shipped["groups"]}
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) == sum(1 for g in shipped["groups"] for r in g["rules"] if "alert" in r)
    assert any("{{ $labels." in a["annotations"]["summary"] for a in alerts)
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: run scripts/system_packages.sh")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(rule["spec"]))
    done = subprocess.run(
        [promtool, "check", "rules", str(spec)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_service_monitor_scrapes_every_member() -> None:
    objs = render({"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}})
    monitor = one(objs, "ServiceMonitor", "apogee")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    wanted = monitor["spec"]["selector"]["matchLabels"]
    selected = [
        s for s in objects(objs, "Service") if wanted.items() <= s["metadata"]["labels"].items()
    ]
    components = sorted(s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected)
    assert components == sorted([*WORKLOADS, "console"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for service in selected:
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports[endpoint["port"]]["targetPort"] == "metrics"


def test_dashboards_are_config_maps_for_the_grafana_sidecar() -> None:
    objs = render({"dashboards": {"enabled": True, "annotations": {"grafana_folder": "Apogee"}}})
    maps = objects(objs, "ConfigMap")
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert len(maps) == len(files) == 5
    for cm, path in zip(sorted(maps, key=lambda m: m["metadata"]["name"]), files, strict=True):
        assert cm["metadata"]["name"] == f"apogee-dashboard-{path.stem}"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Apogee"}
        assert list(cm["data"]) == [path.name]
        assert json.loads(cm["data"][path.name]) == json.loads(path.read_text())
        assert len(cm["data"][path.name]) < 1024 * 1024
    assert not objects(render(), "ConfigMap")


def test_notes_say_how_to_connect() -> None:
    notes = render_files()["apogee/templates/NOTES.txt"]
    assert pod_dns_name("apogee-nameserver-0", "apogee-nameserver") + ":9876" in notes
    assert "apogee-endpoint.mq.svc.cluster.local:10911" in notes
    assert 'apogee-client: "true"' in notes
    assert "helm test apogee -n mq" in notes
    # the example pod and the test pod run the tools image, which has the `apogee` command
    assert "--image=apogee/cli:0.1.0" in notes
    (test_pod,) = objects(render(), "Pod")
    assert test_pod["spec"]["containers"][0]["image"] == "apogee/cli:0.1.0"
    digest = "sha256:" + "b" * 64
    values = {"image": {"registry": "r.example"}, "tests": {"image": {"digest": digest}}}
    assert (
        f"--image=r.example/apogee/cli@{digest}"
        in render_files(values)["apogee/templates/NOTES.txt"]
    )


# -- skaffold --------------------------------------------------------------------------------


def test_skaffold_yaml_is_valid_for_its_schema() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--schemafile",
            str(SKAFFOLD_SCHEMA),
            str(SKAFFOLD),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert yaml.safe_load(SKAFFOLD.read_text())["apiVersion"] == "skaffold/v4beta14"


def _images_script_builds() -> dict[str, tuple[str, str | None, str | None]]:
    """image -> (Dockerfile, target stage, PACKAGE build argument), for every image
    ``scripts/images.sh`` builds by default: the script itself, run with ``echo`` as its
    container engine (each build's command printed, not run)."""
    done = subprocess.run(
        ["bash", str(IMAGES_SCRIPT)],
        env={"PATH": "/usr/bin:/bin", "ENGINE": "echo"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    builds = {}
    for line in done.stdout.splitlines():
        if not line.startswith("build "):
            continue
        words = line.split()
        tags = {words[i + 1] for i, w in enumerate(words) if w == "-t"}
        image = next(iter(tags)).split(":")[0]
        assert tags == {f"{image}:dev", f"{image}:0.1.0"}, line
        target = words[words.index("--target") + 1] if "--target" in words else None
        build_args = dict(
            words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--build-arg"
        )
        builds[image] = (words[words.index("-f") + 1], target, build_args.get("PACKAGE"))
    return builds


def test_skaffold_builds_the_images_the_build_script_builds_and_the_chart_uses() -> None:
    config = yaml.safe_load(SKAFFOLD.read_text())
    artifacts = {a["image"]: a for a in config["build"]["artifacts"]}
    services = {
        f"apogee/{name}" for name in ("nameserver", "broker", "schedule", "txn-checker", "console")
    }
    expected = {*services, "apogee/cli"}
    assert set(artifacts) == expected
    # one Dockerfile, a stage per image, named as the image; PACKAGE the distribution the
    # image's pyproject.toml names
    stages = {
        image: (
            "Dockerfile",
            image.split("/")[1],
            "apogee-cli" if image == "apogee/cli" else f"apogee-{image.split('/')[1]}",
        )
        for image in expected
    }
    for image, artifact in artifacts.items():
        assert artifact["context"] == "."
        docker = artifact["docker"]
        assert (docker["dockerfile"], docker["target"], docker["buildArgs"]["PACKAGE"]) == (
            stages[image]
        )
    built = _images_script_builds()
    assert {image: built[image] for image in expected} == stages
    assert built["apogee/operator"] == ("Dockerfile", "operator", "apogee-operator")
    # the operator's image is built by the script but not deployed by skaffold (the chart
    # names apogee/operator at image.tag, which skaffold does not set)
    assert set(built) - expected == {"apogee/operator"}
    (release,) = config["deploy"]["helm"]["releases"]
    assert (ROOT / release["chartPath"]) == CHART
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    set_images = set()
    for key, template in release["setValueTemplates"].items():
        node = defaults
        for part in key.split("."):
            assert part in node, f"skaffold sets {key}, which the chart does not have"
            node = node[part]
        name = re.search(r"IMAGE_(?:REPO|TAG)_(\w+?)}}", template)
        assert name, template
        set_images.add(name.group(1))
    assert set_images == {i.replace("/", "_").replace("-", "_") for i in expected}
    objs = render()
    chart_images = {
        container(one(objs, kind, name))["image"].split(":")[0]
        for kind, name in [*WORKLOADS.values(), CONSOLE]
    }
    assert chart_images == services
    (test_pod,) = objects(objs, "Pod")
    assert test_pod["spec"]["containers"][0]["image"].split(":")[0] == "apogee/cli"
    (dev,) = config["profiles"]
    assert dev["name"] == "dev"
    for patch in dev["patches"]:
        for path in patch["value"] if patch["path"].endswith("valuesFiles") else []:
            assert (ROOT / path).exists()


# -- against real processes ------------------------------------------------------------------


@pytest.mark.integration
async def test_the_probes_health_services_answer_on_real_services(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Each probe's grpc.health.v1 service, asked of the running services: nameserver and
    broker, and the schedule service and checker both active and standby (a second replica
    on the local cluster's own lock file)."""
    objs = render()
    probes = {
        component: {
            p: container(one(objs, kind, name))[p]["grpc"].get("service", "")
            for p in ("readinessProbe", "livenessProbe", "startupProbe")
        }
        for component, (kind, name) in WORKLOADS.items()
    }
    for component, address in (
        ("nameserver", cluster.nameservers[0].address),
        ("broker", cluster.brokers[0].address),
    ):
        for probe, service in probes[component].items():
            assert await check_health(address, 2.0, service), f"{component} {probe} {service!r}"
    state = cluster.state
    for component, module, active in (
        ("schedule", "apogee_schedule", state.schedule[0]),
        ("txn-checker", "apogee_txn_checker", state.txn_checker[0]),
    ):
        lock = cluster.data_dir / component / f"{component}.lock"
        assert lock.exists(), lock
        standby = LeaderProcess(module, cluster.namesrv, lock, tmp_path / f"{component}.log")
        try:
            await standby.wait_standby(f"a second {component}")
            for probe, service in probes[component].items():
                assert await check_health(active.address, 2.0, service), f"active {probe}"
                assert await check_health(standby.address, 2.0, service), f"standby {probe}"
            assert not await check_health(standby.address, 2.0)
        finally:
            assert await standby.terminate() == 0


@pytest.mark.integration
def test_the_helm_test_pod_script_sends_and_consumes(cluster: Cluster, tmp_path: Path) -> None:
    """The ``helm test`` pod's own script and environment, with the nameservers of a local
    cluster instead of the in-cluster names and the ``apogee`` command of this environment."""
    pod = objects(render(), "Pod")[0]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["sh", "-c"]
    env = container_env(c, pod["metadata"]["name"])
    assert (
        env["APOGEE_NAMESRV"]
        == render_files()["apogee/templates/NOTES.txt"].split('namesrv = "')[1].split('"')[0]
    )
    env.update(
        APOGEE_NAMESRV=cluster.namesrv,
        TIMEOUT="30",
        HOME=str(tmp_path),
        TMPDIR=str(tmp_path),
        PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin",
    )
    done = subprocess.run(
        ["sh", "-c", c["args"][0]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "helm test: sent and consumed: helm test of apogee" in done.stdout
