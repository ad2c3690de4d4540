"""The CRDs of charts/apogee/crds/: served by the stand-in API server (not a real Kubernetes
API server; it applies the OpenAPI v3 subset its docstring lists, not CEL rules) and used
through the real ``kubernetes`` client, they refuse bad specs with 422 naming the field, fill
in the defaults; the operator's own reading of a spec refuses the same specs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from apogee.common.errors import InvalidArgumentError
from apogee.common.topics import MessageType
from apogee.testkit.apiserver import FakeApiServer
from apogee_operator.core.resources import (
    CONSUMER_GROUPS,
    FINALIZER,
    GROUP,
    TOPICS,
    VERSION,
    ConsumeFrom,
    DeletionPolicy,
    parse_group,
    parse_topic,
)

pytestmark = pytest.mark.unit

NS = "apogee"
CRDS = Path(__file__).resolve().parents[3] / "charts" / "apogee" / "crds"


def crds() -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted(CRDS.glob("*.yaml"))]


@pytest.fixture(scope="module")
def objects() -> Iterator[Any]:
    with FakeApiServer(crds()) as api:
        yield client.CustomObjectsApi(api.api_client())


def create(objects: Any, plural: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    kind = "Topic" if plural == "topics" else "ConsumerGroup"
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}}
    body["spec"] = spec
    result: dict[str, Any] = objects.create_namespaced_custom_object(
        GROUP, VERSION, NS, plural, body
    )
    return result


def test_the_crds_define_the_resources_the_operator_serves() -> None:
    found = {d["spec"]["names"]["plural"]: d for d in crds()}
    assert set(found) == {TOPICS.plural, CONSUMER_GROUPS.plural}
    for kind in (TOPICS, CONSUMER_GROUPS):
        crd = found[kind.plural]
        assert crd["metadata"]["name"] == f"{kind.plural}.{GROUP}"
        assert crd["spec"]["names"]["kind"] == kind.kind
        assert crd["spec"]["scope"] == "Namespaced"
        [version] = crd["spec"]["versions"]
        assert (version["name"], version["served"], version["storage"]) == (VERSION, True, True)
        assert version["subresources"] == {"status": {}}
    assert FINALIZER.startswith(GROUP)
    assert sorted(p.name for p in CRDS.glob("*.yaml")) == [
        "consumergroups.apogee.io.yaml",
        "topics.apogee.io.yaml",
    ]


def test_defaults_are_filled_in(objects: Any) -> None:
    topic = create(objects, "topics", "defaults", {})
    assert topic["spec"] == {
        "queues": 8,
        "perm": "rw",
        "messageType": "MIXED",
        "deletionPolicy": "orphan",
    }
    assert parse_topic(topic).name == "defaults"
    assert parse_topic(topic).message_type is MessageType.MIXED
    fifo = create(objects, "topics", "fifo", {"messageType": "FIFO"})
    assert parse_topic(fifo).message_type is MessageType.FIFO
    group = create(objects, "consumergroups", "defaults", {"topics": ["Orders"]})
    assert group["spec"] == {
        "consumeMode": "clustering",
        "consumeFrom": "latest",
        "topics": ["Orders"],
        "deletionPolicy": "orphan",
    }
    parsed = parse_group(group)
    assert (parsed.name, parsed.consume_from, parsed.topics) == (
        "defaults",
        ConsumeFrom.LATEST,
        ("Orders",),
    )
    assert parsed.deletion_policy is DeletionPolicy.ORPHAN


TOPIC_REFUSALS = [
    ({"queues": 0}, "spec.queues"),
    ({"queues": 1025}, "spec.queues"),
    ({"queues": "8"}, "spec.queues"),
    ({"perm": "rx"}, "spec.perm"),
    ({"name": "bad name"}, "spec.name"),
    ({"name": "x" * 128}, "spec.name"),
    ({"deletionPolicy": "later"}, "spec.deletionPolicy"),
    ({"messageType": "ORDERED"}, "spec.messageType"),
    ({"messageType": "fifo"}, "spec.messageType"),  # the enum's capitals, as kubectl shows them
]
GROUP_REFUSALS = [
    ({"name": "bad group!"}, "spec.name"),
    ({"name": "g" * 121}, "spec.name"),
    ({"consumeFrom": "middle"}, "spec.consumeFrom"),
    ({"consumeMode": "fanout"}, "spec.consumeMode"),
    ({"consumeFrom": "timestamp", "consumeTimestamp": "yesterday"}, "spec.consumeTimestamp"),
    ({"topics": ["ok", "not ok"]}, "spec.topics[1]"),
    ({"topics": [f"t{i}" for i in range(65)]}, "spec.topics"),
    ({"deletionPolicy": "sometimes"}, "spec.deletionPolicy"),
]


@pytest.mark.parametrize(("spec", "field"), TOPIC_REFUSALS)
def test_the_topic_schema_and_the_operator_refuse_bad_specs(
    objects: Any, spec: dict[str, Any], field: str
) -> None:
    with pytest.raises(ApiException) as err:
        create(objects, "topics", "bad", spec)
    assert err.value.status == 422
    assert f"{field}:" in str(err.value.body)
    with pytest.raises(InvalidArgumentError, match=field.replace("[", r"\[")):
        parse_topic({"metadata": {"name": "bad"}, "spec": spec})


@pytest.mark.parametrize(("spec", "field"), GROUP_REFUSALS)
def test_the_group_schema_and_the_operator_refuse_bad_specs(
    objects: Any, spec: dict[str, Any], field: str
) -> None:
    with pytest.raises(ApiException) as err:
        create(objects, "consumergroups", "bad", spec)
    assert err.value.status == 422
    assert f"{field}" in str(err.value.body)
    with pytest.raises(InvalidArgumentError, match=field.replace("[", r"\[")):
        parse_group({"metadata": {"name": "bad"}, "spec": spec})


def test_what_only_the_operator_checks() -> None:
    # CEL rules (x-kubernetes-validations) are the API server's; the stand-in does not run
    # them, the operator checks the same
    with pytest.raises(InvalidArgumentError, match=r"spec\.consumeTimestamp: is required"):
        parse_group({"metadata": {"name": "g"}, "spec": {"consumeFrom": "timestamp"}})
    with pytest.raises(InvalidArgumentError, match="has no time zone"):
        parse_group(
            {
                "spec": {
                    "name": "g",
                    "consumeFrom": "timestamp",
                    "consumeTimestamp": "2026-11-26T08:00",
                }
            }
        )
    parsed = parse_group(
        {
            "spec": {
                "name": "g",
                "consumeFrom": "timestamp",
                "consumeTimestamp": "1970-01-01T00:00:01Z",
            }
        }
    )
    assert parsed.consume_timestamp_ms == 1000


def test_the_crd_files_are_plain_yaml_documents() -> None:
    for path in CRDS.glob("*.yaml"):
        docs = list(yaml.safe_load_all(path.read_text()))
        assert len(docs) == 1, path
        assert docs[0]["apiVersion"] == "apiextensions.k8s.io/v1"
        assert docs[0]["kind"] == "CustomResourceDefinition"
