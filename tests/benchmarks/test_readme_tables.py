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


def test_moe_layer_table_brackets_the_baseline_counts_only_where_they_differ():
    def run(syncs, ops, ms, version=None):
        rows = [dict(expert_width=32, experts=8, topk=2, layer=layer, host_syncs_per_layer=s,
                     host_reads_cpu=s + 4, aten_ops=o, fwd_ms=t / 2, fwd_bwd_ms=t,
                     fwd_bwd_ratio_vs_ours=t / ms[-1], out_max_abs_diff=0.0, grad_max_abs_diff=0.0)
                for layer, s, o, t in zip(readme_tables.MOE_LAYER_LABELS, syncs, ops, ms)]
        return {"results": rows, "environment": {"megatron_core": version}}

    new = run([1, 2, 0], [363, 324, 112], [30.0, 20.0, 10.0], "0.19.2")
    old = run([3, 3, 0], [362, 324, 112], [60.0, 40.0, 20.0])
    rows = readme_tables.moe_layer_versions(new, old).splitlines()
    assert "host syncs / layer (GPU), 0.19.2 (0.16.1)" in rows[0]
    assert rows[2] == "| 32 | 8 | 2 | Megatron `MoELayer`, `alltoall` | 1 (3) | 5 (7) | 363 (362) | 30.0 | 3.00 | 0.0e+00, 0.0e+00 |"  # noqa: E501
    assert rows[3] == "| 32 | 8 | 2 | Megatron `MoELayer`, `allgather` | 2 (3) | 6 (7) | 324 | 20.0 | 2.00 | 0.0e+00, 0.0e+00 |"  # noqa: E501
    assert rows[4] == "| 32 | 8 | 2 | ours, `FastpathMoELayer` | 0 | 4 | 112 | 10.0 | 1.00 | 0.0e+00, 0.0e+00 |"  # noqa: E501
