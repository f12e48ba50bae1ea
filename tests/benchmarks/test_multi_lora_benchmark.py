"""benchmarks/multi_lora.py's quick mode (tiny model, K = 1 and 3 adapters of 32 tokens each), in
this process: the joint step's per-adapter losses equal the sequential single-adapter steps'
over every step run; the joint step's aten ops do not depend on how the adapters' sequences are
mixed in the pack; the sequential side's ops are K times one single-adapter step's; the JSON and
its table. Integration: it builds 1 + K models per K and trains them (25 s on 2 shared cores)."""

import json

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def quick(mcore_parallel, tmp_path_factory):
    import multi_lora

    path = tmp_path_factory.mktemp("multi_lora") / "multi_lora.json"
    multi_lora.main(["--quick", "--json", str(path)])
    return json.loads(path.read_text()), path.with_suffix(".txt").read_text()


def test_joint_losses_equal_the_sequential_ones(quick):
    doc, _ = quick
    rows = doc["results"]
    assert [r["adapters"] for r in rows] == [1, 3]
    for r in rows:
        # 4 untimed rounds (AdamW state, counted, other mix, profiled) + 1 timed, each compared
        assert r["loss_checks"] == 5 * r["adapters"]
        # float32, the two sides attend over different packings (summation order only)
        assert r["loss_max_rel_diff"] <= 1e-5, r


def test_exact_op_counts(quick):
    doc, _ = quick
    by_k = {r["adapters"]: r for r in doc["results"]}
    single = by_k[1]["seq_ops_per_adapter"][0]
    for K, r in by_k.items():
        # static shapes: the same ops whichever adapter trains which sequence of the pack
        assert r["joint_aten_ops"] == r["joint_aten_ops_other_mix"]
        # K single-adapter steps of one packed batch each: K times one step's ops
        assert r["seq_ops_per_adapter"] == [single] * K
        assert r["seq_aten_ops"] == K * single
        assert r["graph_launches"] == "not measured"
    # one joint step for three adapters issues about one single step's ops, not three times
    assert by_k[3]["joint_aten_ops"] < 2 * single


def test_json_and_table(quick):
    doc, text = quick
    assert doc["config"]["adapters"] == [1, 3]
    assert {"load_average_1min_at_start", "noisy", "models", "lora"} <= set(doc["environment"])
    for r in doc["results"]:
        assert r["tokens_per_step"] == 32 * r["adapters"]
        assert r["joint_peak_bytes"] > 0 and r["seq_peak_bytes"] > 0
        assert r["tokens_per_s_ratio"] == pytest.approx(r["seq_ms"] / r["joint_ms"])
    assert "joint/seq tok/s" in text.splitlines()[0]
