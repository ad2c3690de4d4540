"""Write the "Parameters" part of charts/apogee/README.md from charts/apogee/values.yaml.

    uv run python scripts/gen_chart_readme.py           # rewrite the part between the markers
    uv run python scripts/gen_chart_readme.py --check   # exit 1 when the README is out of date

values.yaml carries the metadata of bitnami's readme-generator-for-helm: ``## @section <title>``
opens a section, and every value has a ``## @param <name> <description>`` line (``<name>``
dotted, e.g. ``broker.persistence.size``; a map or list may be documented whole). The ``##``
lines right after a section's title describe the section.

Between ``<!-- parameters:start -->`` and ``<!-- parameters:end -->`` the README gets, for each
section, its title (``###``), its description and a table Name | Description | Value, the rows
in the order of the @param lines. The value is the default as the readme-generator writes it:
an empty string as ``""``, other strings as they are (quoted only when YAML would read them as
something else, e.g. ``"1"``), booleans ``true``/``false``, maps and lists as JSON (``{}``,
``[]``; a non-empty one with a space after each comma and colon, so that a long one wraps).
Outside code spans, ``<``, ``*`` and ``\\`` are escaped (``APOGEE_BROKER_<NAME>`` would
otherwise be an HTML tag), and ``|`` everywhere, so no description breaks its table. The rest
of the README is written by hand and left as it is.

A @param naming no value, a value without a @param (nor one on a map or list holding it), a
@param twice or a null default is refused with a sentence naming it (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "apogee"
VALUES = CHART / "values.yaml"
README = CHART / "README.md"

START = "<!-- parameters:start -->"
END = "<!-- parameters:end -->"
NOTICE = (
    "<!-- Generated from values.yaml by scripts/gen_chart_readme.py: edit the @param comments "
    "there, not this part. -->"
)
COMMAND = "uv run python scripts/gen_chart_readme.py"

_SECTION = re.compile(r"^\s*##\s*@section\s+(?P<title>\S.*?)\s*$")
_PARAM = re.compile(r"^\s*##\s*@param\b\s*(?P<name>\S*)\s*(?P<description>.*?)\s*$")
_DESCRIPTION = re.compile(r"^##(?: (?P<text>.*))?$")
_TAG = re.compile(r"^\s*##\s*@\w")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_MISSING = object()


class MetadataError(Exception):
    """values.yaml's @section/@param comments do not match its values."""


@dataclass(frozen=True)
class Param:
    name: str
    description: str
    value: object


@dataclass
class Section:
    title: str
    description: list[str] = field(default_factory=list)
    params: list[Param] = field(default_factory=list)


def _lookup(values: Mapping[str, object], name: str) -> object:
    node: object = values
    for key in name.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _leaves(tree: Mapping[str, object], prefix: str = "") -> Iterator[str]:
    """Dotted names of every value that is not a non-empty map."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{name}.")
        else:
            yield name


def load_sections(values_text: str) -> list[Section]:
    """The sections of values.yaml, their parameters and defaults, checked against the values."""
    values = yaml.safe_load(values_text) or {}
    if not isinstance(values, Mapping):
        raise MetadataError("values.yaml: is not a map of values")
    sections: list[Section] = []
    seen: set[str] = set()
    describing = False
    for number, line in enumerate(values_text.splitlines(), start=1):
        if match := _SECTION.match(line):
            sections.append(Section(match["title"]))
            describing = True
            continue
        if match := _PARAM.match(line):
            describing = False
            name, description = match["name"], match["description"]
            where = f"values.yaml line {number}"
            if not name or not description:
                raise MetadataError(f"{where}: a @param line needs a name and a description")
            if not sections:
                raise MetadataError(f"{where}: @param {name} comes before any @section")
            if name in seen:
                raise MetadataError(f"{where}: @param {name} is documented twice")
            value = _lookup(values, name)
            if value is _MISSING:
                raise MetadataError(f"{where}: @param {name} names no value of values.yaml")
            if value is None:
                raise MetadataError(f"{where}: {name} is null; give it a default of its type")
            seen.add(name)
            sections[-1].params.append(Param(name, description, value))
            continue
        if describing and (match := _DESCRIPTION.match(line)) and not _TAG.match(line):
            sections[-1].description.append(match["text"] or "")
            continue
        describing = False
    undocumented = [
        leaf
        for leaf in _leaves(values)
        if not any(leaf == name or leaf.startswith(f"{name}.") for name in seen)
    ]
    if undocumented:
        raise MetadataError(
            "values.yaml: no @param line for " + ", ".join(undocumented) + "; add one for each"
        )
    return sections


def format_value(value: object) -> str:
    """A default as bitnami's readme-generator writes it (before the backticks around it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        if value == "":
            return '""'
        try:
            reads_back = yaml.safe_load(value) == value
        except yaml.YAMLError:
            reads_back = False
        return value if reads_back and value == value.strip() else json.dumps(value)
    if isinstance(value, (Mapping, list)):
        return json.dumps(value)
    return str(value)


def _code(text: str) -> str:
    """``text`` as a code span (longer fences when it holds backticks), ``|`` escaped."""
    fence = "`"
    while fence in text:
        fence += "`"
    padded = f" {text} " if text.startswith("`") or text.endswith("`") else text
    return f"{fence}{padded}{fence}".replace("|", "\\|")


def escape(text: str) -> str:
    """Markdown text safe in a table cell: code spans kept, ``<``, ``*``, ``\\`` escaped outside
    them, ``|`` escaped everywhere (GitHub's tables split on it even inside code spans)."""
    out: list[str] = []
    last = 0
    for match in _CODE_SPAN.finditer(text):
        out.append(_escape_plain(text[last : match.start()]))
        out.append(match.group(0))
        last = match.end()
    out.append(_escape_plain(text[last:]))
    return "".join(out).replace("|", "\\|")


def _escape_plain(text: str) -> str:
    return text.replace("\\", "\\\\").replace("<", "&lt;").replace("*", "\\*")


def render_parameters(sections: Sequence[Section]) -> str:
    """The generated part of the README, markers excluded: one table per section."""
    lines = [NOTICE]
    for section in sections:
        lines += ["", f"### {escape(section.title)}", ""]
        description = [escape(line) for line in section.description]
        while description and not description[-1]:
            description.pop()
        if description:
            lines += [*description, ""]
        lines += ["| Name | Description | Value |", "| --- | --- | --- |"]
        lines += [
            f"| {_code(p.name)} | {escape(p.description)} | {_code(format_value(p.value))} |"
            for p in section.params
        ]
    return "\n".join(lines)


def splice(readme: str, parameters: str) -> str:
    """``readme`` with ``parameters`` between its markers, the rest unchanged."""
    starts, ends = readme.count(START), readme.count(END)
    if starts != 1 or ends != 1:
        raise MetadataError(
            f"README.md: needs exactly one {START} and one {END} line (found {starts} and {ends})"
        )
    head, rest = readme.split(START)
    if END not in rest:
        raise MetadataError(f"README.md: {END} comes before {START}")
    _, tail = rest.split(END)
    return f"{head}{START}\n{parameters}\n{END}{tail}"


def generate(values_text: str, readme_text: str) -> str:
    """The README as it should be for these values."""
    return splice(readme_text, render_parameters(load_sections(values_text)))


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Write the Parameters tables of the chart's README from values.yaml."
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if the README is out of date")
    ap.add_argument("--values", type=Path, default=VALUES, help="default: the chart's values.yaml")
    ap.add_argument("--readme", type=Path, default=README, help="default: the chart's README.md")
    args = ap.parse_args(argv)
    values_path: Path = args.values
    readme_path: Path = args.readme
    current = readme_path.read_text()
    try:
        fresh = generate(values_path.read_text(), current)
    except MetadataError as exc:
        print(f"gen_chart_readme: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if fresh != current:
            print(
                f"{_shown(readme_path)} is out of date with {_shown(values_path)}: run `{COMMAND}`",
                file=sys.stderr,
            )
            return 1
        print(f"{_shown(readme_path)} is up to date")
        return 0
    if fresh != current:
        readme_path.write_text(fresh)
        print(f"wrote {_shown(readme_path)}")
    else:
        print(f"{_shown(readme_path)} was up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
