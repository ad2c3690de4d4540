"""What a subscription selects of a queue: tags, an SQL92 condition on properties, or both.

A consumer subscribes with a tag expression (:mod:`apogee.common.tags`), an SQL92 condition
(:mod:`apogee.common.selector`), or both, and a message is selected when it matches both. The
broker filters with it before records leave it; one definition for the SDK and the broker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from apogee.common.errors import InvalidArgumentError
from apogee.common.selector import SqlFilter, compile_sql
from apogee.common.tags import parse_tag_expression


@dataclass(frozen=True, slots=True)
class Selection:
    """The tags selected (None: every message, tagged or not) and the SQL92 condition the
    properties must meet (None: no condition)."""

    tags: frozenset[str] | None = None
    sql: SqlFilter | None = None

    @property
    def everything(self) -> bool:
        """Whether every message is selected."""
        return self.tags is None and self.sql is None

    def matches(self, tag: str | None, properties: Mapping[str, str]) -> bool:
        """Whether a message with ``tag`` and ``properties`` (its tags and keys among them, as
        ``TAGS`` and ``KEYS``) is selected."""
        if self.tags is not None and (tag is None or tag not in self.tags):
            return False
        return self.sql is None or self.sql.matches(properties)


#: What a subscription with neither tags nor condition selects.
EVERYTHING = Selection()


def parse_selection(tag_expression: str, sql_expression: str, field: str = "") -> Selection:
    """The selection of a tag expression and an SQL92 condition (``""``: none); ``field``
    prefixes the names errors give (``"subscriptions[2]."``). Raises
    :class:`InvalidArgumentError` naming the expression at fault and, for a condition that
    does not parse, the position."""
    if not isinstance(sql_expression, str):
        raise InvalidArgumentError(
            field=f"{field}sql_expression",
            rule=f"must be a string, got {type(sql_expression).__name__}",
        )
    tags = parse_tag_expression(tag_expression, f"{field}tag_expression")
    if not sql_expression:
        return EVERYTHING if tags is None else Selection(tags)
    return Selection(tags, compile_sql(sql_expression, f"{field}sql_expression"))
