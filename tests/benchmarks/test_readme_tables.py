"""The benchmarks page's tables (docs/benchmarks.md, linked from the README) are the ones
``benchmarks/readme_tables.py`` prints from the committed results JSON, verbatim: no figure in
the docs is typed by hand or left stale."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

import readme_tables  # noqa: E402


@pytest.mark.parametrize("name", [n for n, _ in readme_tables.TABLES])
def test_readme_holds_the_table_printed_from_the_json(name):
    line, table = readme_tables.tables()[name]
    assert table.count("\n") >= 4
    assert table in (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8"), (
        f"docs/benchmarks.md's {name} table differs from `python benchmarks/readme_tables.py`:\n{table}")
