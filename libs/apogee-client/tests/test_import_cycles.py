"""The SDK's modules import one another one way: no module imports, even only for type checking
or inside a function, a module that imports it back (directly or through others). Metrics, for
one, take what they measure through small interfaces (apogee.client.metrics.SettledSend and a
callback), not by importing the producer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import apogee.client

pytestmark = pytest.mark.unit

ROOT = Path(apogee.client.__file__).parent
PACKAGE = "apogee.client"


def _module_of(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The SDK modules ``path`` imports anywhere in it (``from pkg import mod`` names the
    module ``mod``; a name that is not a module names the package)."""
    me = _module_of(path)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = me.split(".")[: len(me.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif base in modules:
                    found.add(base)
    found.discard(me)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph``, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_no_import_cycle_in_the_sdk() -> None:
    files = {_module_of(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    graph = {m: _imports(p, modules) for m, p in files.items()}
    # the package's __init__ re-exports the public names: every module is below it
    graph = {m: {n for n in deps if n != PACKAGE} for m, deps in graph.items()}
    assert "apogee.client.producer.producer" in graph["apogee.client.producer.transaction"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_metrics_import_nothing_they_measure() -> None:
    files = {_module_of(p): p for p in ROOT.rglob("*.py")}
    deps = _imports(files["apogee.client.metrics"], set(files))
    assert not {
        d for d in deps if d.startswith(("apogee.client.producer", "apogee.client.consumer"))
    }
