"""The web console in the Helm chart (``console.*`` values), without a Kubernetes cluster: one
hardened replica whose environment the console's own settings class loads, HTTP probes of
``/healthz`` and ``/readyz`` (HTTPS with TLS on), its Service (and metrics for the
ServiceMonitor), the optional Ingress, its NetworkPolicy (it reaches the nameservers and the
brokers; only the peers named and the ingress controller reach its pages, only Prometheus its
metrics), its users Secret, and nothing at all with ``console.enabled=false``. Validity for
every Kubernetes version, lint and the schema are :mod:`e2e.test_chart`'s (the value sets there
include the console); security: :mod:`e2e.test_chart_security`."""

from __future__ import annotations

from typing import Any

import pytest

from apogee.common.settings import load
from apogee_console.core.hosts import AllowedHosts, host_of
from apogee_console.settings import ConsoleSettings
from e2e.chart_support import (
    CONSOLE,
    NAMESPACE,
    Pod,
    chart_pods,
    ci_values,
    container,
    container_env,
    may_connect,
    objects,
    one,
    pod_dns_name,
    render,
    render_error,
    render_files,
)

pytestmark = [pytest.mark.e2e]

KIND, NAME = CONSOLE
NOTES = "apogee/templates/NOTES.txt"


def _console(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, KIND, NAME)


def _settings(values: dict[str, Any] | None = None) -> ConsoleSettings:
    """The console's settings as its process loads them from the rendered environment."""
    c = container(_console(render(values)))
    env = container_env(c, f"{NAME}-abc")
    own = {k: v for k, v in env.items() if k.startswith("APOGEE_CONSOLE_")}
    fields = {f"APOGEE_CONSOLE_{f.upper()}" for f in ConsoleSettings.__dataclass_fields__}
    assert set(own) <= fields, f"no such settings {set(own) - fields}"
    return load(ConsoleSettings, "console", env=own)


def test_the_console_is_one_replica_of_its_image_on_the_release_nameservers() -> None:
    objs = render()
    deployment = _console(objs)
    assert deployment["spec"]["replicas"] == 1
    # sessions live in the process: an update never runs two side by side
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    c = container(deployment)
    assert c["image"] == "apogee/console:0.1.0"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8080, "metrics": 8081}
    settings = _settings()
    assert settings.listen == "0.0.0.0:8080"
    assert settings.metrics_listen == "0.0.0.0:8081"
    assert settings.namesrv == ";".join(
        f"{pod_dns_name(f'apogee-nameserver-{n}', 'apogee-nameserver')}:9876" for n in range(2)
    )
    assert settings.prometheus_url == ""
    assert not settings.login_required  # open: NOTES warns (below)
    spec = deployment["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in spec  # not the Lease holders' account
    labels = deployment["spec"]["selector"]["matchLabels"]
    assert labels["app.kubernetes.io/component"] == "console"
    assert "helm.sh/chart" not in labels
    digest = "sha256:" + "c" * 64
    pinned = _console(
        render({"image": {"registry": "r.example"}, "console": {"image": {"digest": digest}}})
    )
    assert container(pinned)["image"] == f"r.example/apogee/console@{digest}"


def test_console_values_become_its_settings() -> None:
    values = {
        "console": {
            "ports": {"http": 9080, "metrics": 9081},
            "prometheusUrl": "http://prometheus-operated.monitoring.svc:9090",
            "usersSecret": "console-users",
            "logLevel": "DEBUG",
            "settings": {"session_ttl_s": 1800, "sample_interval_s": 2.5},
        }
    }
    settings = _settings(values)
    assert settings.listen == "0.0.0.0:9080"
    assert settings.metrics_listen == "0.0.0.0:9081"
    assert settings.prometheus_url == "http://prometheus-operated.monitoring.svc:9090"
    assert settings.log_level == "DEBUG"
    assert settings.session_ttl_s == 1800
    assert settings.sample_interval_s == 2.5
    assert settings.login_required
    # the users file is the Secret's, mounted read-only, readable by the pod's group only
    deployment = _console(render(values))
    spec, c = deployment["spec"]["template"]["spec"], container(deployment)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["console-users"] == {
        "name": "console-users",
        "mountPath": "/etc/apogee/console",
        "readOnly": True,
    }
    assert volumes["console-users"]["secret"] == {
        "secretName": "console-users",
        "defaultMode": 0o440,
        "items": [{"key": "console-users.toml", "path": "console-users.toml"}],
    }
    assert settings.console_users_file == "/etc/apogee/console/console-users.toml"


def _hosts(values: dict[str, Any] | None = None) -> AllowedHosts:
    """The host names the rendered console answers to."""
    settings = _settings(values)
    return AllowedHosts.of(settings.allowed_hosts, settings.listen)


def test_the_console_answers_its_service_names_its_ingress_host_and_allowed_hosts() -> None:
    """What its callers send as Host passes the console's check: kubectl port-forward (a
    loopback name), clients in the cluster (the Service's DNS names), browsers through the
    Ingress (its host) and console.allowedHosts; other names do not (the probes, which call the
    pod's IP, are exempt in the console)."""
    service = f"{NAME}.{NAMESPACE}.svc"
    default = _hosts()
    for host in ("localhost:8080", "127.0.0.1", NAME, f"{NAME}.{NAMESPACE}", f"{service}:8080"):
        assert default.allows(host_of(host)), host
    assert default.allows(host_of(f"{service}.cluster.local"))
    for host in ("console.example.com", "10.1.2.3", f"{NAME}.other"):
        assert not default.allows(host_of(host)), host
    assert _hosts({"clusterDomain": "corp.local"}).allows(host_of(f"{service}.corp.local"))

    values = {
        "console": {
            "ingress": {"enabled": True, "host": "console.example.com"},
            "allowedHosts": ["*.corp.example", "10.0.0.5"],
        }
    }
    configured = _hosts(values)
    for host in ("console.example.com", "ops.corp.example", "10.0.0.5:30080", NAME):
        assert configured.allows(host_of(host)), host
    assert not configured.allows(host_of("corp.example"))
    assert _hosts({"console": {"allowedHosts": ["*"]}}).allows(host_of("any.where"))

    # the chart sets the setting itself; the schema refuses what is not a host
    assert (
        "console.settings.allowed_hosts: is set by the chart from console.allowedHosts"
        in render_error({"console": {"settings": {"allowed_hosts": "x"}}})
    )
    bad = render_error({"console": {"allowedHosts": ["https://console.example.com"]}})
    assert "at '/console/allowedHosts/0': 'https://console.example.com' does not match" in bad


def test_the_probes_get_healthz_and_readyz_on_the_http_port() -> None:
    c = container(_console(render()))
    for probe, path in (
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        assert c[probe]["httpGet"] == {"path": path, "port": "http", "scheme": "HTTP"}, probe
        assert c[probe]["timeoutSeconds"] >= 1
    assert c["readinessProbe"]["periodSeconds"] == 5
    timing = {"periodSeconds": 7, "timeoutSeconds": 4, "failureThreshold": 9}
    tuned = container(_console(render({"console": {"probes": {"liveness": timing}}})))
    assert tuned["livenessProbe"] == {
        "httpGet": {"path": "/healthz", "port": "http", "scheme": "HTTP"},
        **timing,
    }


def test_the_service_fronts_the_pages_and_the_metrics() -> None:
    objs = render()
    service = one(objs, "Service", NAME)
    assert service["spec"]["type"] == "ClusterIP"
    assert service["metadata"]["labels"]["apogee.io/metrics"] == "true"
    assert service["spec"]["selector"].items() <= (
        _console(objs)["spec"]["template"]["metadata"]["labels"].items()
    )
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["http"]["port"] == 8080
    assert ports["http"]["targetPort"] == "http"
    assert ports["http"]["appProtocol"] == "http"
    assert ports["metrics"]["targetPort"] == "metrics"
    exposed = one(
        render({"console": {"service": {"type": "LoadBalancer", "port": 80}}}), "Service", NAME
    )
    assert exposed["spec"]["type"] == "LoadBalancer"
    assert exposed["spec"]["ports"][0]["port"] == 80
    assert not objects(render(), "Ingress")


@pytest.mark.parametrize(
    ("ingress", "host", "tls"),
    [
        ({"enabled": True}, None, None),
        ({"enabled": True, "host": "console.example.com"}, "console.example.com", None),
        (
            {"enabled": True, "host": "console.example.com", "tls": True},
            "console.example.com",
            "apogee-console-tls",
        ),
        (
            {"enabled": True, "host": "c.example.com", "tls": True, "tlsSecret": "my-cert"},
            "c.example.com",
            "my-cert",
        ),
    ],
)
def test_ingress_variants(ingress: dict[str, Any], host: str | None, tls: str | None) -> None:
    values = {"console": {"ingress": {**ingress, "annotations": {"a.example/b": "c"}}}}
    (obj,) = objects(render(values), "Ingress")
    assert obj["metadata"]["name"] == NAME
    assert obj["metadata"]["annotations"] == {"a.example/b": "c"}
    (rule,) = obj["spec"]["rules"]
    assert rule.get("host") == host
    (path,) = rule["http"]["paths"]
    assert path["path"] == "/"
    assert path["pathType"] == "Prefix"
    assert path["backend"] == {"service": {"name": NAME, "port": {"name": "http"}}}
    if tls is None:
        assert "tls" not in obj["spec"]
    else:
        assert obj["spec"]["tls"] == [{"hosts": [host], "secretName": tls}]
    assert "ingressClassName" not in obj["spec"]
    classed = {"console": {"ingress": {"enabled": True, "className": "nginx"}}}
    assert objects(render(classed), "Ingress")[0]["spec"]["ingressClassName"] == "nginx"


def test_the_console_reaches_nameservers_and_brokers_and_only_prometheus_its_metrics() -> None:
    """The pairs of :data:`e2e.chart_support.ALLOWED_CONNECTIONS` cover the defaults (pages:
    nobody); here the variants: peers named, the ingress controller with the Ingress,
    Prometheus's API with console.prometheusUrl, the other members left as they were."""
    objs = render()
    policies = objects(objs, "NetworkPolicy")
    pods = chart_pods(objs)
    console = pods["console"]
    for target, port in (("nameserver", 9876), ("broker", 10911)):
        assert may_connect(policies, console, pods[target], port)
    for target, port in (("nameserver", 9880), ("broker", 10912), ("schedule", 9700)):
        assert not may_connect(policies, console, pods[target], port)
    assert not may_connect(policies, console, None, 443)
    assert not may_connect(policies, pods["ingress-controller"], console, 8080)
    for source in ("client", "stranger", "broker", "test"):
        assert not may_connect(policies, pods[source], console, 8080), source
        assert not may_connect(policies, pods[source], console, 8081), source

    office = Pod("browser-proxy", {"app": "proxy"}, "office", {"team": "ops"})
    values = {
        "console": {
            "ingress": {"enabled": True, "host": "console.example.com"},
            "networkPolicy": {"from": [{"namespaceSelector": {"matchLabels": {"team": "ops"}}}]},
            "prometheusUrl": "http://prometheus.monitoring.svc:9090",
        }
    }
    objs = render(values)
    policies = objects(objs, "NetworkPolicy")
    pods = chart_pods(objs)
    console = pods["console"]
    assert may_connect(policies, office, console, 8080)
    assert not may_connect(policies, office, console, 8081)
    assert may_connect(policies, pods["ingress-controller"], console, 8080)
    assert not may_connect(policies, pods["stranger"], console, 8080)
    assert may_connect(policies, console, pods["prometheus"], 9090)
    assert not may_connect(policies, console, pods["prometheus"], 9091)
    # without the Ingress the controller is not let in
    no_ingress = objects(
        render({"console": {"networkPolicy": values["console"]["networkPolicy"]}}), "NetworkPolicy"
    )
    assert not may_connect(no_ingress, pods["ingress-controller"], console, 8080)
    assert may_connect(no_ingress, office, console, 8080)
    assert not may_connect(no_ingress, console, pods["prometheus"], 9090)


def test_without_the_console_nothing_of_it_is_rendered_nor_admitted() -> None:
    objs = render({"console": {"enabled": False}})
    assert not [o for o in objs if "console" in o["metadata"]["name"]]
    text = str(objects(objs, "NetworkPolicy"))
    assert "'app.kubernetes.io/component': 'console'" not in text
    assert "Web console" not in render_files({"console": {"enabled": False}})[NOTES]
    with_it = str(objects(render(), "NetworkPolicy"))
    assert "'app.kubernetes.io/component': 'console'" in with_it
    # nor with networkPolicy off
    assert not objects(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


def test_notes_say_how_to_reach_the_console_and_warn_when_it_is_open() -> None:
    notes = render_files()[NOTES]
    assert f"kubectl -n {NAMESPACE} port-forward svc/{NAME} 8080:8080" in notes
    assert "http://127.0.0.1:8080/" in notes
    assert "WARNING: authentication is off: every visitor of the console is an admin" in notes
    production = render_files(ci_values("production-values.yaml"))[NOTES]
    assert "Through its Ingress: https://console.example.com/" in production
    assert "a user of Secret apogee-console-users (console-users.toml)" in production
    assert "WARNING: authentication is off" not in production
