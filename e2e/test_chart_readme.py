"""The chart's README (``charts/apogee/README.md``): its Parameters tables are what
``scripts/gen_chart_readme.py`` writes from ``values.yaml``'s ``@section`` and ``@param``
comments, one row per @param, each a well-formed three-cell row; ``--check`` says when the README
is out of date; values are written as bitnami's readme-generator writes them; bad metadata is
refused, naming the value."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "apogee"
VALUES = CHART / "values.yaml"
README = CHART / "README.md"
STALE = "charts/apogee/README.md is out of date: run `uv run python scripts/gen_chart_readme.py`"


def _script(name: str) -> ModuleType:
    """A module of scripts/ (not a package: imported by path)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gen = _script("gen_chart_readme")


def _generated_part(readme: str) -> str:
    return readme.split(gen.START)[1].split(gen.END, maxsplit=1)[0]


def _cells(row: str) -> list[str]:
    """The cells of a Markdown table row, split on the pipes not escaped as ``\\|``."""
    assert row.startswith("| ")
    assert row.endswith(" |")
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row[1:-1])]


def test_readme_parameters_are_generated_from_values() -> None:
    readme = README.read_text()
    assert gen.generate(VALUES.read_text(), readme) == readme, STALE


def test_every_param_has_one_well_formed_row() -> None:
    params = re.findall(r"^\s*## @param (\S+) ", VALUES.read_text(), re.MULTILINE)
    rows = [
        line for line in _generated_part(README.read_text()).splitlines() if line.startswith("|")
    ]
    names = []
    for row in rows:
        cells = _cells(row)
        assert len(cells) == 3, f"a table row of the README does not have 3 cells: {row}"
        if cells[0] not in {"Name", "---"}:
            names.append(cells[0].strip("`"))
    assert params
    assert names == params


def test_check_mode_fails_on_a_stale_readme_and_writing_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(README.read_text().replace("| `2` |", "| `3` |", 1))
    argv = ["--readme", str(readme)]

    assert gen.main(["--check", *argv]) == 1
    err = capsys.readouterr().err
    assert "README.md is out of date with" in err
    assert "run `uv run python scripts/gen_chart_readme.py`" in err

    assert gen.main(argv) == 0
    assert readme.read_text() == README.read_text()
    assert gen.main(["--check", *argv]) == 0


def test_text_outside_the_markers_is_left_as_written(tmp_path: Path) -> None:
    hand = (
        f"# Title\n\nWritten | by hand <b>\n\n## Parameters\n\n{gen.START}\nold\n{gen.END}\n\nEnd\n"
    )
    values = "## @section One\n## @param a The a\na: 1\n"
    out = gen.generate(values, hand)
    assert out.startswith("# Title\n\nWritten | by hand <b>\n\n## Parameters\n\n" + gen.START)
    assert out.endswith(f"{gen.END}\n\nEnd\n")
    assert "old" not in out
    assert "| `a` | The a | `1` |" in out


def test_values_are_written_as_the_readme_generator_writes_them() -> None:
    cases: list[tuple[object, str]] = [
        ("", '""'),
        ("IfNotPresent", "IfNotPresent"),
        ("1", '"1"'),
        ("true", '"true"'),
        ([], "[]"),
        ({}, "{}"),
        (["ReadWriteOnce"], '["ReadWriteOnce"]'),
        ({"grafana_dashboard": "1"}, '{"grafana_dashboard": "1"}'),
        (True, "true"),
        (False, "false"),
        (9876, "9876"),
        (0.75, "0.75"),
    ]
    for value, written in cases:
        assert gen.format_value(value) == written, value


def test_pipes_and_angle_brackets_do_not_break_a_table() -> None:
    values = '## @section S\n## @param x As APOGEE_X_<NAME>, `a|b` or c | d (OTEL_*)\nx: "p|q"\n'
    block = gen.render_parameters(gen.load_sections(values))
    row = next(line for line in block.splitlines() if line.startswith("| `x`"))
    assert _cells(row) == [
        "`x`",
        "As APOGEE_X_&lt;NAME>, `a\\|b` or c \\| d (OTEL_\\*)",
        "`p\\|q`",
    ]


@pytest.mark.parametrize(
    ("values", "refusal"),
    [
        ("## @section S\na: 1\n", "no @param line for a"),
        ("## @section S\n## @param b The b\na: 1\n", "@param b names no value"),
        ("## @param a The a\na: 1\n", "@param a comes before any @section"),
        ("## @section S\n## @param a\na: 1\n", "needs a name and a description"),
        ("## @section S\n## @param a A\n## @param a A\na: 1\n", "@param a is documented twice"),
        ("## @section S\n## @param a The a\na:\n", "a is null"),
    ],
)
def test_metadata_that_does_not_match_the_values_is_refused(values: str, refusal: str) -> None:
    with pytest.raises(gen.MetadataError, match=re.escape(refusal)):
        gen.load_sections(values)


def test_a_map_documented_whole_covers_its_keys() -> None:
    (section,) = gen.load_sections("## @section S\n## @param m The m\nm: {k: 1, j: [2]}\n")
    assert [(p.name, p.value) for p in section.params] == [("m", {"k": 1, "j": [2]})]


def test_missing_markers_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# No markers\n")
    assert gen.main(["--check", "--readme", str(readme)]) == 2
    assert gen.START in capsys.readouterr().err
