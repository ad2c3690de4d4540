"""The error registry: every kind is reachable, well formed, and renders its message."""

from __future__ import annotations

import pytest

from apogee.common import errors

pytestmark = pytest.mark.unit

GRPC_CODES = {
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "DATA_LOSS",
    "DEADLINE_EXCEEDED",
    "UNAVAILABLE",
    "FAILED_PRECONDITION",
    "RESOURCE_EXHAUSTED",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "INTERNAL",
}


def _all_error_classes() -> list[type[errors.ApogeeError]]:
    out: list[type[errors.ApogeeError]] = []
    todo: list[type[errors.ApogeeError]] = [errors.ApogeeError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def test_every_kind_has_a_grpc_code_and_every_class_a_kind() -> None:
    for kind in errors.KINDS.values():
        assert kind.code in GRPC_CODES, kind
        assert kind.template
    for cls in _all_error_classes():
        assert cls.kind_name in errors.KINDS, cls


def test_message_names_field_and_rule() -> None:
    err = errors.InvalidTopicError(value="a b", rule="has a character outside [%|a-zA-Z0-9_-]")
    assert str(err) == "topic 'a b': has a character outside [%|a-zA-Z0-9_-]"
    assert err.code == "INVALID_ARGUMENT"
    assert not err.retriable
    assert err.details["value"] == "a b"


def test_retriable_kinds_are_the_transient_ones() -> None:
    assert errors.FlushTimeoutError(timeout_s=5, offset=10).retriable
    assert errors.StoreClosedError(path="/x").retriable
    assert errors.DiskFullError(path="/x", detail="d").retriable
    assert not errors.CorruptRecordError(where="w", detail="d").retriable


def test_missing_detail_is_a_programming_error() -> None:
    with pytest.raises(KeyError):
        errors.InvalidTopicError(value="x")
