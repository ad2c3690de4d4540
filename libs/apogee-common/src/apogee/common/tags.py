"""Tag expressions, as consumers subscribe with them and brokers filter by them.

``""`` and ``"*"`` select every message. Otherwise the expression is tags separated by ``||``
(``"TagA || TagB"``); spaces around each tag are ignored. A message matches when its tag is one
of them; a message without a tag matches only ``*``. One definition for the SDK and the broker.
"""

from __future__ import annotations

from apogee.common.errors import InvalidArgumentError

#: Longest tag expression accepted.
MAX_TAG_EXPRESSION = 4096


def parse_tag_expression(expression: str, field: str = "tag_expression") -> frozenset[str] | None:
    """The set of tags ``expression`` selects, or None for every message.

    Raises :class:`InvalidArgumentError` naming ``field`` for an empty tag (``"A || || B"``)
    or an expression over :data:`MAX_TAG_EXPRESSION` characters."""
    if len(expression) > MAX_TAG_EXPRESSION:
        raise InvalidArgumentError(
            field=field, rule=f"is {len(expression)} characters, at most {MAX_TAG_EXPRESSION}"
        )
    text = expression.strip()
    if text in ("", "*"):
        return None
    tags = [t.strip() for t in text.split("||")]
    if any(not t for t in tags):
        raise InvalidArgumentError(
            field=field,
            rule=f"{expression!r} has an empty tag: write tags separated by '||', e.g. 'A || B'",
        )
    if "*" in tags:
        raise InvalidArgumentError(
            field=field, rule=f"{expression!r}: '*' selects everything and stands alone"
        )
    return frozenset(tags)


def tag_matches(selected: frozenset[str] | None, tag: str | None) -> bool:
    """Whether a message with ``tag`` passes the selection ``selected``."""
    return selected is None or (tag is not None and tag in selected)
