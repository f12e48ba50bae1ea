"""benchmarks/packed_seq.py in its tiny --quick configuration: JSON schema, exact host-sync
counts per variant, metadata ops of our cache independent of L, the difference method against
a direct count, and numerics agreement across the three variants."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_fastpath.sync import SyncSentinel

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

BENCH_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "packed_seq.py"


@pytest.fixture(scope="module")
def bench():
    name = "packed_seq_benchmark"
    spec = importlib.util.spec_from_file_location(name, BENCH_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def quick_report(bench, tmp_path_factory, mcore_parallel):
    path = tmp_path_factory.mktemp("bench") / "packed_seq.json"
    bench.main(["--quick", "--layers", "1", "3", "--repeats", "1", "--json", str(path)])
    return json.loads(path.read_text())


def _rows(report):
    return {(r["variant"], r["layers"]): r for r in report["results"]}


def test_json_schema(quick_report, bench):
    rows = quick_report["results"]
    assert {(r["variant"], r["layers"]) for r in rows} == {
        (v, l) for v in bench.VARIANTS for l in (1, 3)
    }
    for r in rows:
        assert isinstance(r["variant"], str) and isinstance(r["layers"], int)
        assert isinstance(r["host_syncs_per_step"], int)
        assert isinstance(r["mask_tensors_saved_per_step"], int) and isinstance(r["cache_bytes"], int)
        assert r["fwd_ms"] == min(r["fwd_ms_all"]) or abs(r["fwd_ms"] - min(r["fwd_ms_all"])) < 0.01
        for key in ("metadata_ops_per_layer", "fwd_ms", "fwd_bwd_ms"):
            assert isinstance(r[key], float), key
        assert 0 < r["fwd_ms"] < r["fwd_bwd_ms"]
    assert {(q["layers"], q["baseline"]) for q in quick_report["ratios"]} == {
        (l, b) for l in (1, 3) for b in ("rebuild_per_layer", "megatron_thd_rope")
    }
    assert quick_report["anchor"]["fwd_gain_from_caching"] == pytest.approx(0.433)
    assert quick_report["ratio_direction"] == "baseline / ours: > 1 means ours is faster"
    assert isinstance(quick_report["noisy"], bool)
    assert quick_report["noisy"] == (quick_report["load_average_1min_at_start"] / quick_report["cores"] > 0.5
            or quick_report["external_cores_busy"] / quick_report["cores"] > 0.5)


def test_one_mask_saved_per_step_and_cache_bytes(quick_report, bench):
    """Ours saves ONE [T, T] mask for backward per step whatever L; a per-layer
    rebuild saves L. The cache holds the record, the [T, T] fp32 mask and the RoPE tables."""
    rows = _rows(quick_report)
    t = bench.QUICK["tokens"]
    for layers in (1, 3):
        assert rows[("cache", layers)]["mask_tensors_saved_per_step"] == 1
        assert rows[("megatron_thd_rope", layers)]["mask_tensors_saved_per_step"] == 1
        assert rows[("rebuild_per_layer", layers)]["mask_tensors_saved_per_step"] == layers
        assert rows[("rebuild_per_layer", layers)]["cache_bytes"] == 0
        assert t * t * 4 < rows[("cache", layers)]["cache_bytes"] < 2 * t * t * 4


def test_host_syncs_per_step_exact(quick_report):
    rows = _rows(quick_report)
    for layers in (1, 3):
        assert rows[("cache", layers)]["host_syncs_per_step"] == 0
        # max().item(), sum().item(), lengths.tolist() in every layer
        assert rows[("rebuild_per_layer", layers)]["host_syncs_per_step"] == 3 * layers
        # _apply_rotary_pos_emb_thd: .tolist() + tensor __bool__, for q and for k
        assert rows[("megatron_thd_rope", layers)]["host_syncs_per_step"] == 4 * layers
    locs = quick_report["sync_locations"]
    assert locs["cache@L=3"] == {}
    assert sum(n for w, n in locs["megatron_thd_rope@L=3"].items() if "rope_utils.py" in w) == 12


def test_cache_metadata_ops_independent_of_layers(quick_report):
    rows = _rows(quick_report)
    ours = [rows[("cache", l)] for l in (1, 3)]
    assert ours[0]["metadata_ops_per_step"] == ours[1]["metadata_ops_per_step"] > 0
    assert ours[1]["metadata_ops_per_layer"] == pytest.approx(ours[0]["metadata_ops_per_layer"] / 3)
    for name in ("rebuild_per_layer", "megatron_thd_rope"):
        grow = rows[(name, 3)]["metadata_ops_per_step"] - rows[(name, 1)]["metadata_ops_per_step"]
        assert grow > 0, name


def test_difference_method_matches_direct_count(quick_report, bench, mcore_parallel):
    """The per-layer slope of rebuild_per_layer's metadata ops (by difference against the
    cache forward) equals the ops of one ``rebuild`` call counted directly."""
    cfg = bench.BenchConfig(**bench.QUICK)
    lengths = quick_report["config"]["lengths"]
    variants = bench.build_variants(cfg, 1, torch.device("cpu"))
    layer = variants["rebuild_per_layer"].model.decoder.layers[0]
    core = layer.self_attention.core_attention
    core.lengths.lengths_N = torch.tensor(lengths, dtype=torch.int32)
    with SyncSentinel() as s:
        core.rebuild(cfg.tokens, torch.device("cpu"), torch.float32)
    assert s.num_syncs == 3
    rows = _rows(quick_report)
    slope = (rows[("rebuild_per_layer", 3)]["metadata_ops_per_step"]
             - rows[("rebuild_per_layer", 1)]["metadata_ops_per_step"]) / 2
    assert slope == s.aten_ops


def test_numerics_agree_across_variants(quick_report):
    for check in quick_report["numerics"]:
        assert check["ok"], check
        ref = check["losses"]["cache"]
        for loss in check["losses"].values():
            assert loss == pytest.approx(ref, rel=1e-5)
        assert check["gptmodel_forward_loss"] == pytest.approx(ref, rel=1e-5)
        assert all(v <= 1e-4 for v in check["max_grad_rel_diff"].values())


def test_bad_config_refused(bench):
    with pytest.raises(ValueError, match="num-seqs"):
        bench.BenchConfig(tokens=8, num_seqs=9, max_seqs=16)
    with pytest.raises(ValueError, match="max-seqs"):
        bench.BenchConfig(num_seqs=65, max_seqs=64)
