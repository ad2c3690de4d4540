"""Broker replica groups in the Helm chart (``broker.replication``), without a Kubernetes cluster.

With ``replicasPerGroup`` above 1 every broker name is a StatefulSet of its own whose pods all
carry that name, keep a claim each, advertise their own DNS names, hold the group's Lease
through the chart's Role, spread over nodes and keep a quorum through a disruption budget. With
1 the chart renders the lone brokers it always rendered, under the same names. The probes' health
services are asked of a real replica group (a leader and a follower), as the kubelet would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apogee.common.settings import load
from apogee.rpc.server import check_health
from apogee.service.lease_group import group_lease_name
from apogee.testkit.waiting import eventually
from apogee_broker.settings import BrokerSettings
from e2e.chart_support import (
    GROUP_LABEL,
    NAMESPACE,
    Obj,
    Pod,
    broker_groups,
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
from e2e.replication_support import Replica, ReplicaGroup

pytestmark = [pytest.mark.e2e]

GROUPS = {"broker": {"replicas": 3, "replication": {"replicasPerGroup": 3}}}
GROUP_NAMES = ["apogee-broker-0", "apogee-broker-1", "apogee-broker-2"]


def _grouped(**replication: Any) -> dict[str, Any]:
    return {"broker": {"replicas": 3, "replication": {"replicasPerGroup": 3, **replication}}}


def _pods(sts: Obj) -> list[str]:
    return [f"{sts['metadata']['name']}-{n}" for n in range(sts["spec"]["replicas"])]


def _broker_objects(objs: list[Obj]) -> list[tuple[str, str]]:
    return sorted(
        (o["kind"], o["metadata"]["name"])
        for o in objs
        if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "broker"
    )


def test_one_statefulset_of_three_pods_per_group() -> None:
    objs = render(GROUPS)
    groups = broker_groups(objs)
    assert sorted(groups) == GROUP_NAMES
    assert not [o for o in objects(objs, "StatefulSet") if o["metadata"]["name"] == "apogee-broker"]
    headless = one(objs, "Service", "apogee-broker")
    assert headless["spec"]["clusterIP"] == "None"
    advertised: set[str] = set()
    for name, sts in groups.items():
        assert sts["spec"]["replicas"] == 3
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert labels[GROUP_LABEL] == name
        assert sts["spec"]["selector"]["matchLabels"][GROUP_LABEL] == name
        # one headless Service governs every group: each pod resolves under it
        assert sts["spec"]["serviceName"] == "apogee-broker"
        assert headless["spec"]["selector"].items() <= labels.items()
        for pod in _pods(sts):
            settings = load(BrokerSettings, "broker", env=container_env(container(sts), pod))
            assert settings.broker_name == name
            assert settings.advertised_address == f"{pod_dns_name(pod, 'apogee-broker')}:10911"
            advertised.add(settings.advertised_address)
    assert len(advertised) == 9


def test_every_replica_has_its_own_claim() -> None:
    objs = render(GROUPS)
    claims: set[str] = set()
    for name, sts in broker_groups(objs).items():
        (template,) = sts["spec"]["volumeClaimTemplates"]
        assert template["metadata"]["name"] == "data"
        assert template["metadata"]["labels"][GROUP_LABEL] == name
        assert template["spec"]["resources"]["requests"]["storage"] == "20Gi"
        # the data volume comes from the claim template, not from a volume the pods share
        assert "data" not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in container(sts)["volumeMounts"]}
        assert mounts["data"] == "/var/lib/apogee/data"
        # the StatefulSet names each pod's claim <template>-<pod>
        claims.update(f"data-{pod}" for pod in _pods(sts))
    assert len(claims) == 9
    assert "data-apogee-broker-0-2" in claims
    values = _grouped()
    values["broker"]["persistence"] = {"enabled": False}
    for sts in broker_groups(render(values)).values():
        assert "volumeClaimTemplates" not in sts["spec"]
        volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert volumes["data"] == {"name": "data", "emptyDir": {}}


def test_the_replicas_environment() -> None:
    objs = render(_grouped(acks="leader", minInsyncReplicas=3, leaseSeconds=5))
    sts = broker_groups(objs)["apogee-broker-1"]
    c = container(sts)
    pod = "apogee-broker-1-2"
    env = container_env(c, pod)
    assert env["APOGEE_BROKER_REPLICATION"] == "lease"
    assert env["APOGEE_BROKER_REPLICAS"] == "3"
    assert env["APOGEE_BROKER_ACKS"] == "leader"
    assert env["APOGEE_BROKER_MIN_INSYNC_REPLICAS"] == "3"
    assert env["APOGEE_BROKER_REPLICA_LEASE_S"] == "5"
    assert env["APOGEE_BROKER_LEASE_PREFIX"] == "apogee-replicas"
    # the Lease's namespace: unset, the broker takes $POD_NAMESPACE (the downward API)
    assert "APOGEE_BROKER_LEASE_NAMESPACE" not in env
    assert env["POD_NAMESPACE"] == NAMESPACE
    (namespace_var,) = [v for v in c["env"] if v["name"] == "POD_NAMESPACE"]
    assert namespace_var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    settings = load(BrokerSettings, "broker", env=env)
    assert settings.replication == "lease"
    assert settings.replicas == 3
    assert settings.acks == "leader"
    assert settings.min_insync_replicas == 3
    assert settings.replica_lease_s == 5.0
    assert settings.lease_namespace == ""
    assert group_lease_name(settings.lease_prefix, settings.broker_name) == (
        "apogee-replicas-apogee-broker-1"
    )
    # the defaults: acks=all, two in sync, a 2 s lease
    env = container_env(container(broker_groups(render(GROUPS))["apogee-broker-0"]), "p")
    assert env["APOGEE_BROKER_ACKS"] == "all"
    assert env["APOGEE_BROKER_MIN_INSYNC_REPLICAS"] == "2"
    assert env["APOGEE_BROKER_REPLICA_LEASE_S"] == "2"


def test_a_groups_pods_spread_over_nodes() -> None:
    for preset, key in (
        ("soft", "preferredDuringSchedulingIgnoredDuringExecution"),
        ("hard", "requiredDuringSchedulingIgnoredDuringExecution"),
    ):
        values = _grouped()
        values["broker"]["podAntiAffinity"] = preset
        groups = broker_groups(render(values))
        for name, sts in groups.items():
            (term,) = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][key]
            term = term.get("podAffinityTerm", term)
            assert term["topologyKey"] == "kubernetes.io/hostname"
            selector = term["labelSelector"]["matchLabels"]
            assert selector[GROUP_LABEL] == name
            # it selects the pods of its own group, not those of the others
            for other, other_sts in groups.items():
                labels = other_sts["spec"]["template"]["metadata"]["labels"]
                assert (selector.items() <= labels.items()) is (other == name)
    values = _grouped()
    values["broker"]["podAntiAffinity"] = "none"
    for sts in broker_groups(render(values)).values():
        assert "affinity" not in sts["spec"]["template"]["spec"]


def test_a_disruption_budget_per_group_keeps_min_insync_replicas() -> None:
    objs = render(_grouped(minInsyncReplicas=2))
    groups = broker_groups(objs)
    budgets = {
        p["metadata"]["name"]: p
        for p in objects(objs, "PodDisruptionBudget")
        if p["metadata"]["labels"]["app.kubernetes.io/component"] == "broker"
    }
    assert sorted(budgets) == GROUP_NAMES
    for name, pdb in budgets.items():
        assert pdb["spec"] == {"minAvailable": 2, "selector": pdb["spec"]["selector"]}
        selector = pdb["spec"]["selector"]["matchLabels"]
        for other, sts in groups.items():
            labels = sts["spec"]["template"]["metadata"]["labels"]
            assert (selector.items() <= labels.items()) is (other == name)
    three = objects(render(_grouped(minInsyncReplicas=3)), "PodDisruptionBudget")
    assert {
        p["spec"].get("minAvailable") for p in three if "apogee-broker" in p["metadata"]["name"]
    } == {3}
    values = _grouped()
    values["broker"]["pdb"] = {"enabled": False}
    assert not [
        p
        for p in objects(render(values), "PodDisruptionBudget")
        if "broker" in p["metadata"]["name"]
    ]


def test_the_brokers_may_read_and_write_the_leases() -> None:
    # also with the schedule service and the checker on lock files, which need no Lease
    for values in (
        GROUPS,
        {
            **GROUPS,
            "leadership": {"mode": "file"},
            "schedule": {"replicas": 1},
            "txnChecker": {"replicas": 1},
        },
    ):
        objs = render(values)
        role = one(objs, "Role", "apogee-leases")
        assert role["rules"] == [
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "verbs": ["get", "create", "update"],
            }
        ]
        binding = one(objs, "RoleBinding", "apogee-leases")
        assert binding["roleRef"]["name"] == "apogee-leases"
        for sts in broker_groups(objs).values():
            spec = sts["spec"]["template"]["spec"]
            account = spec["serviceAccountName"]
            assert {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in (
                binding["subjects"]
            )
            one(objs, "ServiceAccount", account)
            assert spec["automountServiceAccountToken"] is True
    # lone brokers need no API access and mount no token
    lone = render(
        {"leadership": {"mode": "file"}, "schedule": {"replicas": 1}, "txnChecker": {"replicas": 1}}
    )
    assert not objects(lone, "Role")
    spec = one(lone, "StatefulSet", "apogee-broker")["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in spec


def test_replicas_reach_each_other_and_the_api_server() -> None:
    objs = render(GROUPS)
    policies = objects(objs, "NetworkPolicy")
    pods = chart_pods(objs)
    replica = Pod("broker-2", {**pods["broker"].labels, GROUP_LABEL: "apogee-broker-2"})
    assert may_connect(policies, pods["broker"], replica, 10911)
    assert may_connect(policies, replica, pods["broker"], 10911)
    assert may_connect(policies, pods["broker"], None, 443)
    assert not may_connect(policies, pods["stranger"], pods["broker"], 10911)
    assert may_connect(policies, pods["client"], pods["broker"], 10911)
    lone = render()
    policies = objects(lone, "NetworkPolicy")
    pods = chart_pods(lone)
    assert not may_connect(policies, pods["broker"], pods["broker"], 10911)
    assert not may_connect(policies, pods["broker"], None, 443)


def test_probes_pass_on_followers_and_readiness_means_in_sync() -> None:
    for sts in broker_groups(render(GROUPS)).values():
        c = container(sts)
        # startup and liveness: the Replication service, SERVING on every replica (a follower
        # catching up a long log is alive and started); readiness: the overall status, SERVING
        # on the leader and on followers in the in-sync set
        assert c["startupProbe"]["grpc"]["service"] == "apogee.v1.Replication"
        assert c["livenessProbe"]["grpc"]["service"] == "apogee.v1.Replication"
        assert "service" not in c["readinessProbe"]["grpc"]
    lone = container(one(render(), "StatefulSet", "apogee-broker"))
    assert "service" not in lone["startupProbe"]["grpc"]
    assert lone["livenessProbe"]["grpc"]["service"] == "apogee.v1.Broker"


def test_bad_replication_values_are_refused() -> None:
    error = render_error(_grouped(minInsyncReplicas=4))
    assert (
        "broker.replication.minInsyncReplicas: is 4, more than "
        "broker.replication.replicasPerGroup (3)"
    ) in error
    # lone brokers do not use it: the default 2 is fine with 1 replica per group
    render({"broker": {"replication": {"replicasPerGroup": 1, "minInsyncReplicas": 2}}})
    refused: list[tuple[dict[str, Any], str]] = [
        (_grouped(acks="some"), "at '/broker/replication/acks': value must be one of 'all'"),
        (_grouped(leaseSeconds=0), "at '/broker/replication/leaseSeconds': minimum: got 0"),
        (_grouped(leaseSeconds=61), "at '/broker/replication/leaseSeconds': maximum: got 61"),
        ({"broker": {"replication": {"replicasPerGroup": 17}}}, "maximum: got 17, want 16"),
        ({"broker": {"replication": {"replicas": 3}}}, "additional properties 'replicas'"),
    ]
    for values, message in refused:
        assert message in render_error(values), message
    owned = _grouped()
    owned["broker"]["settings"] = {"acks": "leader", "replication": "etcd"}
    error = render_error(owned)
    assert "broker.settings.acks: is set by the chart from broker.replication.acks" in error
    assert (
        "broker.settings.replication: is set by the chart from broker.replication.replicasPerGroup"
    ) in error


def test_one_replica_per_group_renders_the_lone_brokers_unchanged() -> None:
    lone = {"broker": {"replicas": 3}}
    objs = render(lone)
    assert _broker_objects(objs) == [
        ("NetworkPolicy", "apogee-broker"),
        ("PodDisruptionBudget", "apogee-broker"),
        ("Service", "apogee-broker"),
        ("Service", "apogee-endpoint"),
        ("StatefulSet", "apogee-broker"),
    ]
    sts = one(objs, "StatefulSet", "apogee-broker")
    assert sts["spec"]["replicas"] == 3
    assert GROUP_LABEL not in sts["spec"]["selector"]["matchLabels"]
    env = container_env(container(sts), "apogee-broker-1")
    assert env["APOGEE_BROKER_BROKER_NAME"] == "apogee-broker-1"
    assert not [k for k in env if "REPLICA" in k or k.endswith(("_ACKS", "_LEASE_PREFIX"))]
    assert one(objs, "PodDisruptionBudget", "apogee-broker")["spec"]["maxUnavailable"] == 1
    # the other replication values change nothing while replicasPerGroup is 1
    explicit = {
        "broker": {
            "replicas": 3,
            "replication": {
                "replicasPerGroup": 1,
                "acks": "leader",
                "minInsyncReplicas": 5,
                "leaseSeconds": 9,
            },
        }
    }
    assert render(explicit) == objs


def test_production_values_run_groups_of_three_on_separate_nodes() -> None:
    objs = render(ci_values("production-values.yaml"))
    groups = broker_groups(objs)
    assert sorted(groups) == GROUP_NAMES
    for name, sts in groups.items():
        assert sts["spec"]["replicas"] == 3
        spec = sts["spec"]["template"]["spec"]
        (term,) = spec["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["labelSelector"]["matchLabels"][GROUP_LABEL] == name
        env = container_env(container(sts), f"{name}-0")
        assert env["APOGEE_BROKER_ACKS"] == "all"
        assert env["APOGEE_BROKER_MIN_INSYNC_REPLICAS"] == "2"
        assert one(objs, "PodDisruptionBudget", name)["spec"]["minAvailable"] == 2


def test_notes_name_each_group() -> None:
    notes = render_files(GROUPS)["apogee/templates/NOTES.txt"]
    assert "3 broker(s) of 3 replicas each" in notes
    for name in GROUP_NAMES:
        assert f"rollout status statefulset/{name}\n" in notes
        assert f"apogee-replicas-{name}" in notes
    assert "may pick a follower: it answers a client's route query" in notes
    lone = render_files()["apogee/templates/NOTES.txt"]
    assert "rollout status statefulset/apogee-broker\n" in lone
    assert "follower" not in lone


@pytest.mark.integration
async def test_the_probes_health_services_answer_on_a_leader_and_a_follower(
    tmp_path: Path,
) -> None:
    """The probes of a group's pods, asked of a real group of two replicas (the file
    coordination: the health services are the same whatever keeps the record): all pass on
    both; the lone brokers' liveness service would fail on the follower."""
    sts = broker_groups(render(GROUPS))["apogee-broker-0"]
    probes = {
        p: container(sts)[p]["grpc"].get("service", "")
        for p in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    async with ReplicaGroup(tmp_path, replicas=2) as group:
        leader = await group.wait_leader()
        await group.wait_in_sync(2)
        (follower,) = [r for r in group.replicas if r is not leader]
        for replica in (leader, follower):
            for probe, service in probes.items():

                async def passes(replica: Replica = replica, service: str = service) -> bool:
                    return await check_health(replica.address, 2.0, service)

                # the follower learns that it is in sync at its next look at the record
                await eventually(passes, 10, f"{probe} {service!r} on replica {replica.index}")
        assert await check_health(leader.address, 2.0, "apogee.v1.Broker")
        assert not await check_health(follower.address, 2.0, "apogee.v1.Broker")
