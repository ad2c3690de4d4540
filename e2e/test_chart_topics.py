"""Topics and consumer groups declared in the Helm chart's values (``operator.topics``,
``operator.consumerGroups``), without a Kubernetes cluster: each entry becomes one
``apogee.io/v1alpha1`` Topic or ConsumerGroup in the release's namespace, with the chart's
labels and a valid object name of its own; the resources are created, through the real
``kubernetes`` client, on the stand-in API server (``apogee.testkit.apiserver``) serving the
chart's CRDs, which checks them against the CRDs' OpenAPI schemas and fills in their defaults,
and the operator reads from them the topics and groups the values named. ``values.schema.json``
refuses bad entries naming the field, with the CRDs' own rules; the chart refuses entries
without the operator, and a name listed twice. Lint and validity of the other objects with
these values (``ci/operator-values.yaml``) are :mod:`e2e.test_chart`'s."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from apogee.common.topics import READ_WRITE, MessageType, Perm
from apogee.testkit.apiserver import FakeApiServer
from apogee_operator.core.resources import (
    CONSUMER_GROUPS,
    GROUP,
    TOPICS,
    VERSION,
    ConsumeFrom,
    ConsumeMode,
    parse_group,
    parse_topic,
)
from e2e.chart_support import (
    CHART,
    NAMESPACE,
    RELEASE,
    Obj,
    ci_values,
    crds,
    objects,
    render,
    render_error,
)

pytestmark = [pytest.mark.e2e]

#: Two topics, one FIFO with its queues set, one with only a permission (the rest: the CRD's
#: defaults); a group starting at the oldest message of the first.
VALUES: dict[str, Any] = {
    "operator": {
        "enabled": True,
        "topics": [
            {"name": "Orders", "queues": 16, "messageType": "FIFO"},
            {"name": "audit", "perm": "r"},
        ],
        "consumerGroups": [{"name": "billing", "topics": ["Orders"], "consumeFrom": "earliest"}],
    }
}
#: A Kubernetes object name (DNS-1123 subdomain), as the API server requires of custom resources.
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
NOT_WITHOUT_OPERATOR = (
    "operator.topics: is set, but operator.enabled=false: nothing would reconcile the Topic "
    "resources made from it, and no topic would reach the brokers; set operator.enabled=true "
    "or empty operator.topics"
)


@pytest.fixture
def custom_objects() -> Iterator[Any]:
    """The CustomObjectsApi of a stand-in API server serving the chart's CRDs, empty."""
    with FakeApiServer(crds()) as api, api.api_client() as api_client:
        yield client.CustomObjectsApi(api_client)


def _create(custom_objects: Any, obj: Obj) -> Obj:
    """``obj`` created as ``helm install`` creates it; the API server's copy (defaults filled
    in, unknown fields pruned)."""
    plural = {TOPICS.kind: TOPICS.plural, CONSUMER_GROUPS.kind: CONSUMER_GROUPS.plural}[obj["kind"]]
    created: Obj = custom_objects.create_namespaced_custom_object(
        GROUP, VERSION, obj["metadata"]["namespace"], plural, obj
    )
    return created


def _kept(rendered: Obj, created: Obj) -> None:
    """Every field of the rendered spec is in the created object as rendered: the CRD's schema
    knows them all (it prunes what it does not know, silently)."""
    assert created["spec"].items() >= rendered["spec"].items(), (rendered, created)


# -- rendered resources ----------------------------------------------------------------------


def test_each_topic_of_the_values_is_a_topic_resource(custom_objects: Any) -> None:
    objs = render(VALUES)
    topics = {t["spec"]["name"]: t for t in objects(objs, "Topic")}
    assert set(topics) == {"Orders", "audit"}
    assert topics["Orders"]["spec"] == {"name": "Orders", "queues": 16, "messageType": "FIFO"}
    assert topics["audit"]["spec"] == {"name": "audit", "perm": "r"}
    assert topics["audit"]["metadata"]["name"] == f"{RELEASE}-audit"
    for topic in topics.values():
        assert topic["apiVersion"] == "apogee.io/v1alpha1"
        meta = topic["metadata"]
        assert meta["namespace"] == NAMESPACE
        assert DNS_SUBDOMAIN.fullmatch(meta["name"]), meta["name"]
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert meta["labels"]["app.kubernetes.io/component"] == "operator"

    orders = _create(custom_objects, topics["Orders"])
    _kept(topics["Orders"], orders)
    audit = _create(custom_objects, topics["audit"])
    _kept(topics["audit"], audit)
    # what the operator puts on every broker
    fifo, read_only = parse_topic(orders), parse_topic(audit)
    assert (fifo.name, fifo.queues, fifo.perm, fifo.message_type) == (
        "Orders",
        16,
        READ_WRITE,
        MessageType.FIFO,
    )
    assert (read_only.name, read_only.queues, read_only.perm, read_only.message_type) == (
        "audit",
        8,
        Perm.READ,
        MessageType.MIXED,
    )
    assert audit["spec"]["deletionPolicy"] == "orphan"  # uninstalling never deletes messages


def test_each_consumer_group_of_the_values_is_a_consumer_group_resource(
    custom_objects: Any,
) -> None:
    (group,) = objects(render(VALUES), "ConsumerGroup")
    assert group["apiVersion"] == "apogee.io/v1alpha1"
    assert group["metadata"]["name"] == f"{RELEASE}-billing"
    assert group["metadata"]["namespace"] == NAMESPACE
    assert group["spec"] == {"name": "billing", "topics": ["Orders"], "consumeFrom": "earliest"}
    created = _create(custom_objects, group)
    _kept(group, created)
    parsed = parse_group(created)
    assert (parsed.name, parsed.topics, parsed.consume_from, parsed.consume_mode) == (
        "billing",
        ("Orders",),
        ConsumeFrom.EARLIEST,
        ConsumeMode.CLUSTERING,
    )

    at = {
        "name": "replay",
        "topics": ["Orders", "audit"],
        "consumeFrom": "timestamp",
        "consumeTimestamp": "2026-01-31T08:00:00Z",
        "consumeMode": "broadcasting",
    }
    (replay,) = objects(
        render({"operator": {"enabled": True, "consumerGroups": [at]}}), "ConsumerGroup"
    )
    assert replay["spec"] == at
    parsed = parse_group(_create(custom_objects, replay))
    assert parsed.consume_timestamp_ms == 1_769_846_400_000
    assert parsed.consume_mode is ConsumeMode.BROADCASTING


def test_names_that_are_no_object_names_get_distinct_valid_ones(custom_objects: Any) -> None:
    names = ["Orders", "orders", "ORDERS", "orders_", "%RETRY%billing", "a|b", "x" * 127]
    values = {"operator": {"enabled": True, "topics": [{"name": n} for n in names]}}
    topics = objects(render(values), "Topic")
    assert [t["spec"]["name"] for t in topics] == names
    object_names = [t["metadata"]["name"] for t in topics]
    assert len(set(object_names)) == len(names), object_names
    for name in object_names:
        assert DNS_SUBDOMAIN.fullmatch(name), name
        assert len(name) <= 253
        assert name.startswith(f"{RELEASE}-")
    assert object_names[1] == f"{RELEASE}-orders"  # a lower-case DNS label is kept as it is
    assert re.fullmatch(rf"{RELEASE}-orders-[0-9a-f]{{8}}", object_names[0])
    for topic in topics:
        assert _create(custom_objects, topic)["spec"]["name"] == topic["spec"]["name"]
    # the object's name depends on its own entry only: adding one renames no other
    again = objects(
        render({"operator": {"enabled": True, "topics": [{"name": "Orders"}]}}), "Topic"
    )
    assert again[0]["metadata"]["name"] == object_names[0]
    # another release's objects have names of their own
    other = objects(render(values, release="shop"), "Topic")
    assert {t["metadata"]["name"] for t in other}.isdisjoint(object_names)


def test_no_resources_by_default_nor_without_entries() -> None:
    for values in ({}, {"operator": {"enabled": True}}):
        objs = render(values)
        assert not objects(objs, "Topic")
        assert not objects(objs, "ConsumerGroup")


def test_the_ci_values_resources_are_accepted(custom_objects: Any) -> None:
    objs = render(ci_values("operator-values.yaml"))
    types = sorted(t["spec"].get("messageType", "MIXED") for t in objects(objs, "Topic"))
    assert types == ["FIFO", "NORMAL"]
    assert len(objects(objs, "ConsumerGroup")) == 1
    for obj in [*objects(objs, "Topic"), *objects(objs, "ConsumerGroup")]:
        _kept(obj, _create(custom_objects, obj))


# -- refused values --------------------------------------------------------------------------


def test_topics_without_the_operator_are_refused() -> None:
    error = render_error({"operator": {"topics": [{"name": "Orders"}]}})
    assert "Apogee chart: bad values:" in error
    assert NOT_WITHOUT_OPERATOR in error
    error = render_error({"operator": {"consumerGroups": [{"name": "billing"}]}})
    assert "operator.consumerGroups: is set, but operator.enabled=false" in error
    assert "no consumer group would reach the brokers" in error


def test_a_name_listed_twice_is_refused() -> None:
    twice = [{"name": "Orders"}, {"name": "Orders", "queues": 4}, {"name": "Orders"}]
    error = render_error({"operator": {"enabled": True, "topics": twice}})
    assert error.count('operator.topics: the topic "Orders" is listed more than once') == 1
    error = render_error(
        {"operator": {"enabled": True, "consumerGroups": [{"name": "g"}, {"name": "g"}]}}
    )
    assert 'operator.consumerGroups: the consumer group "g" is listed more than once' in error


def _topic(**entry: Any) -> dict[str, Any]:
    return {"operator": {"enabled": True, "topics": [{"name": "Orders", **entry}]}}


def _group(**entry: Any) -> dict[str, Any]:
    return {"operator": {"enabled": True, "consumerGroups": [{"name": "billing", **entry}]}}


BAD_ENTRIES: list[tuple[dict[str, Any], str]] = [
    (
        _topic(messageType="ORDERED"),
        "at '/operator/topics/0/messageType': value must be one of 'NORMAL', 'FIFO', 'DELAY', "
        "'TRANSACTION', 'MIXED'",
    ),
    (_topic(messageType="fifo"), "at '/operator/topics/0/messageType': value must be one of"),
    (_topic(queues=0), "at '/operator/topics/0/queues': minimum: got 0, want 1"),
    (_topic(queues=1025), "at '/operator/topics/0/queues': maximum: got 1,025, want 1,024"),
    (_topic(queues="8"), "at '/operator/topics/0/queues': got string, want integer"),
    (_topic(perm="rx"), "at '/operator/topics/0/perm': value must be one of 'rw', 'r', 'w'"),
    (_topic(name="Orders Eu"), "at '/operator/topics/0/name': 'Orders Eu' does not match"),
    (_topic(name="x" * 128), "at '/operator/topics/0/name': maxLength: got 128, want 127"),
    (_topic(name=""), "at '/operator/topics/0/name': minLength: got 0, want 1"),
    (
        {"operator": {"enabled": True, "topics": [{"queues": 8}]}},
        "at '/operator/topics/0': missing property 'name'",
    ),
    (
        _topic(deletionPolicy="delete"),
        "at '/operator/topics/0': additional properties 'deletionPolicy' not allowed",
    ),
    (
        {"operator": {"enabled": True, "topics": {"Orders": {}}}},
        "at '/operator/topics': got object, want array",
    ),
    (_group(consumeFrom="middle"), "at '/operator/consumerGroups/0/consumeFrom': value must be"),
    (
        _group(consumeFrom="timestamp"),
        "at '/operator/consumerGroups/0': missing property 'consumeTimestamp'",
    ),
    (
        _group(consumeFrom="timestamp", consumeTimestamp="yesterday"),
        "at '/operator/consumerGroups/0/consumeTimestamp': 'yesterday' is not valid date-time",
    ),
    (_group(consumeMode="fanout"), "at '/operator/consumerGroups/0/consumeMode': value must be"),
    (_group(name="g" * 121), "at '/operator/consumerGroups/0/name': maxLength: got 121, want 120"),
    (_group(topics=["ok", "not ok"]), "at '/operator/consumerGroups/0/topics/1': 'not ok'"),
    (
        _group(topics=[f"t{i}" for i in range(65)]),
        "at '/operator/consumerGroups/0/topics': maxItems: got 65, want 64",
    ),
]


@pytest.mark.parametrize(("values", "message"), BAD_ENTRIES, ids=[m for _, m in BAD_ENTRIES])
def test_the_schema_refuses_bad_entries_naming_the_field(
    values: dict[str, Any], message: str
) -> None:
    error = render_error(values)
    assert "values don't meet the specifications of the schema" in error
    assert message in error, error


def _crd_spec(plural: str) -> dict[str, Any]:
    (crd,) = (c for c in crds() if c["spec"]["names"]["plural"] == plural)
    (version,) = crd["spec"]["versions"]
    spec: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec


@pytest.mark.parametrize(
    ("key", "plural"), [("topics", TOPICS.plural), ("consumerGroups", CONSUMER_GROUPS.plural)]
)
def test_the_values_schema_has_the_crds_rules(key: str, plural: str) -> None:
    """Each field an entry may have is the CRD's, with the CRD's enum, range, length and pattern:
    what values.schema.json accepts the API server accepts."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    items = schema["properties"]["operator"]["properties"][key]["items"]
    crd = _crd_spec(plural)["properties"]

    def resolved(node: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        return node

    assert items["required"] == ["name"]
    assert items["additionalProperties"] is False
    for field, node in items["properties"].items():
        assert field in crd, f"{key}[].{field}: no such field in the {plural} CRD"
        ours, theirs = resolved(node), crd[field]
        for rule in ("type", "enum", "minimum", "maximum", "minLength", "maxLength", "maxItems"):
            assert ours.get(rule) == theirs.get(rule), f"{key}[].{field}: {rule}"
        if "pattern" in theirs:
            assert ours["pattern"] == theirs["pattern"], f"{key}[].{field}: pattern"
        if "items" in theirs:
            item = resolved(ours["items"])
            for rule in ("type", "pattern", "minLength", "maxLength"):
                assert item.get(rule) == theirs["items"].get(rule), f"{key}[].{field}[]: {rule}"
