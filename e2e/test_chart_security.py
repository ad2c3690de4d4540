"""The Helm chart's ``security`` values (TLS and authentication, ``ci/secure-values.yaml``),
without a Kubernetes cluster: every container's TLS and auth settings name files of the right
Secrets, mounted read-only; the probes become exec probes of the probe command (gRPC probes
cannot speak TLS), which pass against a real nameserver and broker started with the rendered
environment; the ServiceMonitor scrapes over https; the ``examples/`` Secrets and cert-manager
Certificate fit the values; and with security off, no pod gets any of it. The rest of the
chart: :mod:`e2e.test_chart`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from apogee.common.auth.users import Credentials, Users
from apogee.common.settings import load
from apogee.local import processes
from apogee.rpc import probe as probe_command
from apogee.testkit.ports import free_port
from apogee.testkit.tls import TestCa
from apogee.testkit.waiting import wait_until
from apogee_console.settings import ConsoleSettings
from apogee_operator.settings import OperatorSettings
from e2e.chart_support import (
    CHART,
    CONSOLE,
    EVERYTHING,
    NAMESPACE,
    WORKLOADS,
    Obj,
    container,
    container_env,
    dns_name_matches,
    objects,
    one,
    pod_dns_name,
    pod_specs,
    render,
    render_files,
    secret_file,
)
from e2e.harness import BROKER_ENV
from e2e.test_chart import KUBERNETES_VERSIONS, SECURE, SERVICES, VALUE_SETS

EXAMPLES = CHART / "examples"
#: The workloads with the operator's, and each one's settings, prefix and health service.
SECURED = {**WORKLOADS, "operator": ("Deployment", "apogee-operator")}
SECURED_SERVICES: dict[str, tuple[type[Any], str, str]] = {
    **SERVICES,
    "operator": (OperatorSettings, "operator", "apogee.operator.Process"),
}

pytestmark = [pytest.mark.e2e]


# -- TLS and authentication -------------------------------------------------------

#: The container files the chart points each security setting at, and the (Secret, key) of
#: ci/secure-values.yaml each must come from.
TLS_FILES = {
    "TLS_CERT_FILE": ("apogee-tls", "tls.crt"),
    "TLS_KEY_FILE": ("apogee-tls", "tls.key"),
    "TLS_CA_FILE": ("apogee-tls", "ca.crt"),
}
USERS = ("apogee-users", "users.toml")
SERVICE_CREDENTIALS = ("apogee-service-credentials", "credentials.toml")
#: Words of the variables security adds, none of which a default render may carry.
SECURITY_WORDS = ("TLS", "AUTH", "CREDENTIALS", "PROBE")


def _source(spec: Obj, c: Obj, path: str) -> tuple[str, str]:
    """(Secret, key) of a mounted file, which must be readable by the pod's group only."""
    name, key, mode = secret_file(spec, c, path)
    assert mode == 0o440, f"{path}: mode {mode:o}"
    return name, key


def _secured(objs: list[Obj], component: str) -> tuple[Obj, Obj, dict[str, str], str]:
    """(pod spec, container, environment, APOGEE_<SERVICE>_) of a secured component."""
    kind, name = SECURED[component]
    workload = one(objs, kind, name)
    c = container(workload)
    env = container_env(c, f"{name}-0")
    prefix = f"APOGEE_{SECURED_SERVICES[component][1].upper()}_"
    return workload["spec"]["template"]["spec"], c, env, prefix


@pytest.mark.parametrize("component", SECURED)
def test_security_gives_every_service_its_tls_and_auth_files(component: str) -> None:
    """Each setting names a file of the right Secret's key, mounted read-only, mode 0440; the
    service's own settings class accepts the environment and its security check passes; only
    the services that call others get the service credentials (not the nameservers)."""
    spec, c, env, prefix = _secured(render(SECURE), component)
    for setting, source in TLS_FILES.items():
        assert _source(spec, c, env[prefix + setting]) == source, setting
    assert env[prefix + "TLS_CLIENT_AUTH"] == "require"
    assert env[prefix + "AUTH_ENABLED"] == "true"
    assert _source(spec, c, env[prefix + "AUTH_USERS_FILE"]) == USERS
    calls_services = component != "nameserver"
    if calls_services:
        assert _source(spec, c, env[prefix + "AUTH_CREDENTIALS_FILE"]) == SERVICE_CREDENTIALS
    else:
        assert prefix + "AUTH_CREDENTIALS_FILE" not in env
        assert "credentials.toml" not in json.dumps(spec["volumes"])
    cls, settings_prefix, _ = SECURED_SERVICES[component]
    own = {k: v for k, v in env.items() if k.startswith(prefix)}
    settings = load(cls, settings_prefix, env=own)
    assert settings.tls_cert_file == "/etc/apogee/tls/tls.crt"
    assert settings.auth_enabled is True
    settings.check_security(calls_services=calls_services)
    # the probe's own variables: the CA, the name in the certificate, and (mutual TLS) the
    # service's own certificate
    assert _source(spec, c, env["APOGEE_PROBE_TLS_CA"]) == ("apogee-tls", "ca.crt")
    assert _source(spec, c, env["APOGEE_PROBE_TLS_CERT"]) == ("apogee-tls", "tls.crt")
    assert _source(spec, c, env["APOGEE_PROBE_TLS_KEY"]) == ("apogee-tls", "tls.key")
    server_name = pod_dns_name("apogee-broker-0", "apogee-broker")
    assert env["APOGEE_PROBE_TLS_SERVER_NAME"] == server_name
    # one TLS volume and one auth volume, both read-only under /etc/apogee
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["tls"] == {"name": "tls", "mountPath": "/etc/apogee/tls", "readOnly": True}
    assert mounts["auth"] == {"name": "auth", "mountPath": "/etc/apogee/auth", "readOnly": True}


def test_security_without_client_certificates_and_with_tls_or_auth_alone() -> None:
    values = {"security": {"tls": {"enabled": True, "existingSecret": "certs"}}}
    for component in SECURED:
        spec, c, env, prefix = _secured(
            render({**values, "operator": {"enabled": True}}), component
        )
        assert env[prefix + "TLS_CLIENT_AUTH"] == "none"
        assert _source(spec, c, env[prefix + "TLS_CA_FILE"]) == ("certs", "ca.crt")
        assert "APOGEE_PROBE_TLS_CERT" not in env
        assert not any(k.startswith(prefix + "AUTH_") or "CREDENTIALS" in k for k in env)
        assert "auth" not in {v["name"] for v in spec["volumes"]}
    (test_pod,) = objects(render(values), "Pod")
    env = container_env(test_pod["spec"]["containers"][0], "t")
    assert env["APOGEE_TLS_CA_FILE"] == "/etc/apogee/tls/ca.crt"
    assert "APOGEE_TLS_CERT_FILE" not in env
    auth = {
        "security": {"auth": {"enabled": True, "usersSecret": "u", "serviceCredentialsSecret": "s"}}
    }
    objs = render(auth)
    for component in WORKLOADS:
        spec, c, env, prefix = _secured(objs, component)
        assert env[prefix + "AUTH_ENABLED"] == "true"
        assert not any("TLS" in k for k in env), component
        assert "grpc" in c["livenessProbe"], "plaintext: Kubernetes' gRPC probes stay"
    # the helm test pod signs with the service credentials unless given its own
    (test_pod,) = objects(objs, "Pod")
    c = test_pod["spec"]["containers"][0]
    env = container_env(c, "t")
    assert _source(test_pod["spec"], c, env["APOGEE_CREDENTIALS_FILE"]) == ("s", "credentials.toml")
    notes = render_files(auth)["apogee/templates/NOTES.txt"]
    assert "WARNING: authentication is on without TLS" in notes


def test_security_gives_the_console_tls_logins_and_credentials() -> None:
    """The console gets what the services that call others get (TLS files, the users file it
    checks access-key logins against, the credentials it signs with), but asks browsers for
    no client certificate whatever security.tls.clientAuth says; its probes GET over HTTPS;
    console.credentialsSecret replaces the service credentials; its settings class accepts
    it all (and runs the security check itself)."""
    values = {**SECURE, "console": {"usersSecret": "apogee-console-users"}}
    objs = render(values)
    workload = one(objs, *CONSOLE)
    spec, c = workload["spec"]["template"]["spec"], container(workload)
    env = container_env(c, "apogee-console-0")
    prefix = "APOGEE_CONSOLE_"
    for setting, source in TLS_FILES.items():
        assert _source(spec, c, env[prefix + setting]) == source, setting
    assert env[prefix + "TLS_CLIENT_AUTH"] == "none"
    assert env[prefix + "AUTH_ENABLED"] == "true"
    assert _source(spec, c, env[prefix + "AUTH_USERS_FILE"]) == USERS
    assert _source(spec, c, env[prefix + "AUTH_CREDENTIALS_FILE"]) == SERVICE_CREDENTIALS
    assert _source(spec, c, env[prefix + "CONSOLE_USERS_FILE"]) == (
        "apogee-console-users",
        "console-users.toml",
    )
    own = {k: v for k, v in env.items() if k.startswith(prefix)}
    settings = load(ConsoleSettings, "console", env=own)
    assert settings.https
    assert settings.login_required
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS", probe
    service = one(objs, "Service", CONSOLE[1])
    assert {p["name"]: p["appProtocol"] for p in service["spec"]["ports"]}["http"] == "https"
    notes = render_files(values)["apogee/templates/NOTES.txt"]
    assert "https://127.0.0.1:8080/" in notes
    assert "an access key and secret key of a user of Secret apogee-users" in notes

    own_credentials = {**values, "console": {"credentialsSecret": "apogee-console-credentials"}}
    workload = one(render(own_credentials), *CONSOLE)
    spec, c = workload["spec"]["template"]["spec"], container(workload)
    env = container_env(c, "apogee-console-0")
    assert _source(spec, c, env[prefix + "AUTH_CREDENTIALS_FILE"]) == (
        "apogee-console-credentials",
        "credentials.toml",
    )
    # the other services keep the service credentials
    _, _, broker_env, _ = _secured(render(own_credentials), "broker")
    assert broker_env["APOGEE_BROKER_AUTH_CREDENTIALS_FILE"] == "/etc/apogee/auth/credentials.toml"
    assert "apogee-console-credentials" not in json.dumps(
        one(render(own_credentials), "StatefulSet", "apogee-broker")["spec"]
    )


def test_the_helm_test_pod_is_a_client_of_the_secured_cluster() -> None:
    """The CA, the client certificate (mutual TLS) and the client credentials, in the
    variables the `apogee` command reads; it gets neither the users file nor the services'
    credentials."""
    (test_pod,) = objects(render(SECURE), "Pod")
    spec = test_pod["spec"]
    (c,) = spec["containers"]
    env = container_env(c, test_pod["metadata"]["name"])
    assert _source(spec, c, env["APOGEE_TLS_CA_FILE"]) == ("apogee-tls", "ca.crt")
    assert _source(spec, c, env["APOGEE_TLS_CERT_FILE"]) == ("apogee-tls", "tls.crt")
    assert _source(spec, c, env["APOGEE_TLS_KEY_FILE"]) == ("apogee-tls", "tls.key")
    assert _source(spec, c, env["APOGEE_CREDENTIALS_FILE"]) == (
        "apogee-admin-credentials",
        "credentials.toml",
    )
    volumes = json.dumps(spec["volumes"])
    assert "users.toml" not in volumes
    assert "apogee-service-credentials" not in volumes
    notes = render_files(SECURE)["apogee/templates/NOTES.txt"]
    assert "APOGEE_TLS_CA_FILE" in notes
    assert "APOGEE_CREDENTIALS_FILE" in notes


@pytest.mark.parametrize("name", ["defaults", "everything"])
def test_without_security_no_pod_gets_security_variables_or_secrets(name: str) -> None:
    for where, _, spec in pod_specs(render(VALUE_SETS[name])):
        assert {v["name"] for v in spec["volumes"]} <= {"tmp", "data"}, where
        for c in spec["containers"]:
            names = [e["name"] for e in c.get("env", [])]
            assert not [n for n in names if any(w in n for w in SECURITY_WORDS)], where
            assert not any(m["mountPath"].startswith("/etc/apogee") for m in c["volumeMounts"])
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe not in c:
                    continue
                assert "exec" not in c[probe], f"{where} {probe}"
                if "httpGet" in c[probe]:  # the console's: plain HTTP
                    assert c[probe]["httpGet"]["scheme"] == "HTTP", f"{where} {probe}"
                else:
                    assert "grpc" in c[probe], f"{where} {probe}"
    assert "Security is on" not in render_files(VALUE_SETS[name])["apogee/templates/NOTES.txt"]


def _probe_args(command: list[str]) -> tuple[float, str, str]:
    """(--timeout, address, health service) of an exec probe's command."""
    assert command[:3] == ["python", "-m", "apogee.rpc.probe"], command
    args = command[3:]
    assert args[0] == "--timeout"
    positional = args[2:]
    assert 1 <= len(positional) <= 2, command
    return float(args[1]), positional[0], positional[1] if len(positional) > 1 else ""


@pytest.mark.parametrize("component", SECURED)
def test_with_tls_the_probes_run_the_probe_command_over_tls(component: str) -> None:
    """Kubernetes' gRPC probes cannot speak TLS: each becomes an exec probe of the same health
    service on the gRPC port (127.0.0.1), with the same timing, finishing within it; the
    command's TLS comes from the container's APOGEE_PROBE_TLS_* variables."""
    secure = render(SECURE)
    plain = render({"operator": {"enabled": True}})
    kind, name = SECURED[component]
    c = container(one(secure, kind, name))
    before = container(one(plain, kind, name))
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in c[probe], f"{name} {probe}"
        timeout, address, service = _probe_args(c[probe]["exec"]["command"])
        assert address == f"127.0.0.1:{grpc_port}"
        assert service == before[probe]["grpc"].get("service", "")
        timing = {k: v for k, v in c[probe].items() if k != "exec"}
        assert timing == {k: v for k, v in before[probe].items() if k != "grpc"}
        assert 0 < timeout < timing["timeoutSeconds"], f"{name} {probe}: --timeout {timeout}"
    env = container_env(c, f"{name}-0")
    # what the command makes of the container's environment (it has no TLS flags)
    flags = argparse.Namespace(tls=False, **dict.fromkeys(probe_command.TLS_ENV))
    tls = probe_command.tls_of(flags, env)
    assert tls is not None
    assert tls.ca_file == "/etc/apogee/tls/ca.crt"
    assert tls.cert_file == "/etc/apogee/tls/tls.crt"
    assert tls.server_name == pod_dns_name("apogee-broker-0", "apogee-broker")


def test_tls_server_name_can_be_set() -> None:
    values = {**SECURE, "security": {**SECURE["security"], "tls": {**SECURE["security"]["tls"]}}}
    values["security"]["tls"]["serverName"] = "localhost"
    objs = render(values)
    for component in WORKLOADS:
        _, _, env, _ = _secured(objs, component)
        assert env["APOGEE_PROBE_TLS_SERVER_NAME"] == "localhost"
    monitor = one(
        render({**values, "serviceMonitor": {"enabled": True}}), "ServiceMonitor", "apogee"
    )
    assert monitor["spec"]["endpoints"][0]["tlsConfig"]["serverName"] == "localhost"


def test_with_tls_the_service_monitor_scrapes_over_https() -> None:
    (endpoint,) = one(render(SECURE), "ServiceMonitor", "apogee")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "apogee-tls", "key": "ca.crt"}},
        "serverName": pod_dns_name("apogee-broker-0", "apogee-broker"),
        # clientAuth=require: the metrics ports ask Prometheus for a certificate too
        "cert": {"secret": {"name": "apogee-tls", "key": "tls.crt"}},
        "keySecret": {"name": "apogee-tls", "key": "tls.key"},
    }
    no_client_auth = {
        "serviceMonitor": {"enabled": True},
        "security": {"tls": {"enabled": True, "existingSecret": "certs"}},
    }
    (endpoint,) = one(render(no_client_auth), "ServiceMonitor", "apogee")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert set(endpoint["tlsConfig"]) == {"ca", "serverName"}
    (endpoint,) = one(render(EVERYTHING), "ServiceMonitor", "apogee")["spec"]["endpoints"]
    assert endpoint["scheme"] == "http"
    assert "tlsConfig" not in endpoint


def _example(name: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def test_the_example_secrets_fit_the_secure_values() -> None:
    """examples/security-secrets.yaml: valid Secrets named as ci/secure-values.yaml names
    them, a users file the services load, the service credentials of a service user, the
    helm test pod's of an admin that may create topics; every secret key a placeholder."""
    secrets = {s["metadata"]["name"]: s for s in _example("security-secrets.yaml")}
    for secret in secrets.values():
        kubernetes_validate.validate(secret, KUBERNETES_VERSIONS[-1], strict=True)
    auth = SECURE["security"]["auth"]
    users = Users.parse(secrets[auth["usersSecret"]]["stringData"]["users.toml"], "users.toml")
    for each in users:
        assert each.secret_key.startswith("EXAMPLE-ONLY-"), each.access_key
    service = Credentials.parse(
        secrets[auth["serviceCredentialsSecret"]]["stringData"]["credentials.toml"], "service"
    )
    client = Credentials.parse(
        secrets[auth["clientCredentialsSecret"]]["stringData"]["credentials.toml"], "client"
    )
    for credentials in (service, client):
        user = users.get(credentials.access_key)
        assert user is not None
        assert user.secret_key == credentials.secret_key
    service_user = users.get(service.access_key)
    assert service_user is not None
    assert service_user.service is True
    admin = users.get(client.access_key)
    assert admin is not None
    assert admin.may_admin(write=True)
    topic = yaml.safe_load((CHART / "values.yaml").read_text())["tests"]["topic"]
    assert admin.may("topic", topic, "PUB")
    assert admin.may("topic", topic, "SUB")
    assert admin.may("group", "apogee-helm-test-1764165600-42", "SUB")


def test_the_example_certificate_names_every_address_the_services_call() -> None:
    """examples/cert-manager.yaml's Certificate (for namespace `apogee`, here `mq`) writes the
    Secret of ci/secure-values.yaml and names what the services, the clients and the probes
    check: each nameserver and broker address, the endpoint Service, the probes' server name."""
    (certificate,) = (
        d
        for d in _example("cert-manager.yaml")
        if d["kind"] == "Certificate" and not d["spec"].get("isCA")
    )
    spec = certificate["spec"]
    assert spec["secretName"] == SECURE["security"]["tls"]["existingSecret"]
    assert {"server auth", "client auth"} <= set(spec["usages"])  # clientAuth: require
    names = _example_certificate_names()
    objs = render(SECURE)
    _, _, env, _ = _secured(objs, "broker")
    called = [a.rsplit(":", 1)[0] for a in env["APOGEE_BROKER_NAMESRV"].split(";")]
    called += [
        pod_dns_name(f"apogee-broker-{n}", "apogee-broker") for n in range(2)
    ]  # advertised addresses
    called += [
        env["APOGEE_PROBE_TLS_SERVER_NAME"],
        f"apogee-endpoint.{NAMESPACE}.svc.cluster.local",
    ]
    for host in called:
        assert any(dns_name_matches(n, host) for n in names), f"{host} not in {names}"


def _example_certificate_names() -> list[str]:
    """The DNS names of examples/cert-manager.yaml's services' Certificate, for this test's
    namespace instead of `apogee`."""
    certificate = next(
        d
        for d in _example("cert-manager.yaml")
        if d["kind"] == "Certificate" and not d["spec"].get("isCA")
    )
    return [
        n.replace(".apogee.svc.", f".{NAMESPACE}.svc.") for n in certificate["spec"]["dnsNames"]
    ]


@dataclass
class _Member:
    """A chart container run as a process: its container, environment (files and addresses
    moved here), gRPC port and process."""

    component: str
    c: Obj
    env: dict[str, str]
    port: int
    proc: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def _secured_members(tmp_path: Path) -> Iterator[dict[str, _Member]]:
    """The nameserver's and the first broker's containers of ci/secure-values.yaml, run as
    processes: their environment as rendered, with the mounted files made here (a CA, a
    certificate with the example Certificate's names, the example users and credentials) and
    the addresses moved to free ports on 127.0.0.1 (the broker then expects the name the
    certificate holds, as it would calling the nameservers' DNS names). Stopped gracefully."""
    objs = render(SECURE)
    ca = TestCa.create(tmp_path / "ca")
    issued = ca.issue(
        "apogee", tmp_path / "issued", hosts=_example_certificate_names(), client=True
    )
    secrets = {s["metadata"]["name"]: s for s in _example("security-secrets.yaml")}
    contents = {
        ("apogee-tls", "tls.crt"): issued.cert_file.read_text(),
        ("apogee-tls", "tls.key"): issued.key_file.read_text(),
        ("apogee-tls", "ca.crt"): ca.cert_file.read_text(),
    } | {
        (name, key): value
        for name, secret in secrets.items()
        for key, value in secret["stringData"].items()
    }
    ns_port = free_port()
    members: dict[str, _Member] = {}
    try:
        for component in ("nameserver", "broker"):
            spec, c, env, prefix = _secured(objs, component)
            env = _files_here(spec, c, env, contents, tmp_path / "root")
            port = ns_port if component == "nameserver" else free_port()
            env[prefix + "LISTEN"] = f"127.0.0.1:{port}"
            env[prefix + "METRICS_LISTEN"] = f"127.0.0.1:{free_port()}"
            if component == "broker":
                env = {**BROKER_ENV, **env}
                env[prefix + "NAMESRV"] = f"127.0.0.1:{ns_port}"
                env[prefix + "ADVERTISED_ADDRESS"] = f"127.0.0.1:{port}"
                env[prefix + "DATA_DIR"] = str(tmp_path / "data")
                env[prefix + "TLS_SERVER_NAME"] = env["APOGEE_PROBE_TLS_SERVER_NAME"]
            log = tmp_path / f"{component}.log"
            proc = processes.spawn(["-m", f"apogee_{component}"], log, env)
            members[component] = _Member(component, c, env, port, proc, log)
        yield members
    finally:
        for m in reversed(members.values()):
            m.proc.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for m in reversed(members.values()):
            try:
                codes.append(m.proc.wait(20))
            except subprocess.TimeoutExpired:
                codes.append(None)
        processes.kill_all([m.proc for m in members.values()])
    assert codes == [0] * len(codes), _member_logs(members)


def _files_here(
    spec: Obj, c: Obj, env: dict[str, str], contents: dict[tuple[str, str], str], root: Path
) -> dict[str, str]:
    """``env`` with every file of a mounted Secret written under ``root`` from ``contents``
    ((Secret, key) -> text) and named there."""
    moved = dict(env)
    for name, value in env.items():
        if value.startswith("/etc/apogee/"):
            path = root / value.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(contents[_source(spec, c, value)])
            moved[name] = str(path)
    return moved


def _member_logs(members: dict[str, _Member]) -> str:
    return "\n".join(
        f"==> {m.component} <==\n{processes.tail(m.log, 40)}" for m in members.values()
    )


def _run_probe(m: _Member, probe: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The exec probe's command, as the kubelet runs it in the container (its environment),
    against the member's port."""
    command = m.c[probe]["exec"]["command"]
    args = [f"127.0.0.1:{m.port}" if a.startswith("127.0.0.1:") else a for a in command[1:]]
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=m.c[probe]["timeoutSeconds"] + 5,
        check=False,
    )


@pytest.mark.integration
def test_the_tls_probes_pass_against_real_secured_services(tmp_path: Path) -> None:
    """Each exec probe of the nameserver and the broker passes against the service started
    with TLS (mutual) and authentication on; without the probe's TLS variables, expecting
    another name, or without a client certificate, it fails."""
    with _secured_members(tmp_path) as members:
        for m in members.values():

            def started(m: Any = m) -> bool:
                if _run_probe(m, "startupProbe", m.env).returncode == 0:
                    return True
                assert m.proc.poll() is None, f"{m.component} exited\n{_member_logs(members)}"
                return False

            # every 0.2 s: the kubelet's period, shortened
            wait_until(
                started,
                60,
                f"the startup probe of {m.component} passing",
                every=0.2,
                detail=lambda: _member_logs(members),
            )
            for probe in ("readinessProbe", "livenessProbe"):
                done = _run_probe(m, probe, m.env)
                assert done.returncode == 0, f"{m.component} {probe}: {done.stdout}{done.stderr}"
            plain = {k: v for k, v in m.env.items() if not k.startswith("APOGEE_PROBE_")}
            assert _run_probe(m, "livenessProbe", plain).returncode == 1
            other = {**m.env, "APOGEE_PROBE_TLS_SERVER_NAME": "apogee-elsewhere.example"}
            assert _run_probe(m, "livenessProbe", other).returncode == 1
            no_cert = {k: v for k, v in m.env.items() if not k.startswith("APOGEE_PROBE_TLS_CE")}
            no_cert.pop("APOGEE_PROBE_TLS_KEY")
            assert _run_probe(m, "livenessProbe", no_cert).returncode == 1  # clientAuth: require


@pytest.mark.integration
def test_the_helm_test_pod_script_passes_against_real_secured_services(tmp_path: Path) -> None:
    """The ``helm test`` pod's script with its environment of ci/secure-values.yaml (the CA,
    the client certificate, the example admin credentials, as mounted), against the secured
    nameserver and broker: it creates the topic, sends and consumes with the example users'
    rights; without the credentials it is refused."""
    pod = objects(render(SECURE), "Pod")[0]
    (c,) = pod["spec"]["containers"]
    secrets = {s["metadata"]["name"]: s for s in _example("security-secrets.yaml")}
    with _secured_members(tmp_path) as members:
        contents = {
            (name, key): value
            for name, secret in secrets.items()
            for key, value in secret["stringData"].items()
        } | {
            ("apogee-tls", key): Path(
                members["broker"].env[f"APOGEE_BROKER_TLS_{var}_FILE"]
            ).read_text()
            for key, var in (("tls.crt", "CERT"), ("tls.key", "KEY"), ("ca.crt", "CA"))
        }
        env = _files_here(
            pod["spec"], c, container_env(c, pod["metadata"]["name"]), contents, tmp_path / "test"
        )
        env.update(
            APOGEE_NAMESRV=f"127.0.0.1:{members['nameserver'].port}",
            # the certificate names the pods' DNS names, not 127.0.0.1
            APOGEE_TLS_SERVER_NAME=members["broker"].env["APOGEE_PROBE_TLS_SERVER_NAME"],
            TIMEOUT="45",
            HOME=str(tmp_path),
            TMPDIR=str(tmp_path),
            PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin",
        )

        def script(script_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["sh", "-c", c["args"][0]],
                env=script_env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )

        done = script(env)
        assert done.returncode == 0, done.stdout + done.stderr + _member_logs(members)
        assert "helm test: sent and consumed" in done.stdout
        unsigned = {k: v for k, v in env.items() if k != "APOGEE_CREDENTIALS_FILE"}
        done = script({**unsigned, "TIMEOUT": "3"})
        assert done.returncode != 0
        assert "not signed" in done.stderr
