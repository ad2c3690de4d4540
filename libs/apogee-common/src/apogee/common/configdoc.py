"""Render the configuration reference from settings dataclasses (``metadata["doc"]`` per field).

``scripts/gen_config_docs.py`` rewrites ``docs/configuration.md`` from every package's section; a
test per package fails when the file and its classes disagree.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


def _value(v: Any) -> str:
    if isinstance(v, enum.Enum):
        return f"`{v.value}`"
    if isinstance(v, tuple):
        if v == tuple(range(24)):
            return "all hours"
        return "`" + ",".join(str(x) for x in v) + "`"
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1 << 20 and v % (1 << 20) == 0:
        return f"`{v}` ({v >> 20} MiB)"
    return f"`{v}`"


def render_class(cls: type[Any], title: str, intro: str) -> str:
    lines = [f"## {title}", "", intro, "", "| setting | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        doc = f.metadata.get("doc", "")
        lines.append(f"| `{f.name}` | {_value(default)} | {doc} |")
    return "\n".join(lines) + "\n"


HEADER = (
    "# Configuration reference\n\n"
    "Generated from the settings classes by `python scripts/gen_config_docs.py`; "
    "do not edit by hand.\n\n"
)
