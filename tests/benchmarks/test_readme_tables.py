"""The benchmarks page's tables (docs/benchmarks.md, linked from the README) are the ones
``benchmarks/readme_tables.py`` prints from the committed results JSON, verbatim: no figure in
the docs is typed by hand or left stale."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

import readme_tables  # noqa: E402


# a later megatron-core's tables, for the runs committed under benchmarks/results/
VERSIONED = [f"{n}_mcore{v}" for n, v, _ in readme_tables.VERSIONED
             if (REPO / "benchmarks" / "results" / readme_tables.results_name(n, v)).exists()]


@pytest.mark.parametrize("name", [n for n, _ in readme_tables.TABLES] + VERSIONED)
def test_readme_holds_the_table_printed_from_the_json(name):
    line, table = readme_tables.tables()[name]
    assert table.count("\n") >= 4
    assert table in (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8"), (
        f"docs/benchmarks.md's {name} table differs from `python benchmarks/readme_tables.py`:\n{table}")


def _packed(syncs, meta, ms):
    return {"results": [dict(variant=v, layers=4, host_syncs_per_step=syncs[i],
                             metadata_ops_per_step=meta[i], aten_ops_per_step=1000 + i,
                             fwd_bwd_ms=ms[i])
                        for i, v in enumerate(readme_tables.PACKED_NAMES)]}


def test_versioned_table_brackets_the_baseline_only_where_it_differs():
    """A later megatron-core's figure first; 0.16.1's in brackets only where it differs."""
    new = _packed([0, 12, 16], [25, 1219, 500], [100.0, 110.0, 90.0]) | {"megatron_core": "0.19.2"}
    old = _packed([0, 12, 16], [25, 1219, 488], [200.0, 220.0, 180.0])
    rows = readme_tables.packed_seq_versions(new, old).splitlines()
    assert "0.19.2 (0.16.1)" in rows[0]
    assert rows[2] == "| 4 | ours (cache) | 0 | 25 | 1000 | 100 | 1.000 |"
    assert rows[3] == "| 4 | (a) rebuild per layer | 12 | 1219 | 1001 | 110 | 1.100 |"
    assert rows[4] == "| 4 | (b) Megatron THD RoPE | 16 | 500 (488) | 1002 | 90 | 0.900 |"
