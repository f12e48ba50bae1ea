"""benchmarks/moe_layer.py's quick mode, in this process: Megatron-Core's own ``MoELayer`` with its
alltoall and allgather dispatchers and the fast path's layer, on one set of weights, give the
same output and gradients; the host syncs per layer a GPU run makes, per megatron-core line
(each Megatron site read in the installed source); the flex dispatcher's refusal at EP 1 as
Megatron raises it; the JSON and its table."""

import json

import pytest

from megatron_fastpath import compat


@pytest.fixture(scope="module")
def quick(mcore_parallel, tmp_path_factory):
    import moe_layer

    path = tmp_path_factory.mktemp("moe_layer") / "moe_layer.json"
    moe_layer.main(["--quick", "--json", str(path)])
    return json.loads(path.read_text()), path.with_suffix(".txt").read_text()


def test_megatron_layers_and_ours_agree(quick):
    doc, _ = quick
    rows = {r["layer"]: r for r in doc["results"]}
    assert set(rows) == {"megatron_alltoall", "megatron_allgather", "ours"}
    # the two dispatchers share one router and one SequentialMLP: the same kernels, bit for bit
    assert rows["megatron_allgather"]["out_max_abs_diff"] == 0.0
    assert rows["megatron_allgather"]["grad_max_abs_diff"] == 0.0
    # ours: grouped GEMMs on the same weights, output and every gradient (input, router with
    # the aux loss, expert weights) against Megatron's alltoall layer
    assert rows["ours"]["out_max_abs_diff"] <= 1e-6
    assert rows["ours"]["grad_max_abs_diff"] <= 1e-6


def test_host_syncs_per_layer_on_each_line(quick):
    """0.16.1: permute's two masked_selects (moe_utils.py:369, :372) + the alltoall dispatcher's
    wait on its d2h event; allgather: .cpu() of the counts (token_dispatcher.py:295), permute's
    masked_select, the probs' masked_select (:304). 0.19.2 permutes with argsort: alltoall
    waits on its event only; allgather: .cpu() (:317) and the probs' masked_select (:328)."""
    doc, _ = quick
    rows = {r["layer"]: r for r in doc["results"]}
    line = compat.mcore_line()
    syncs = {(0, 16): (3, 3), (0, 19): (1, 2)}[line]
    reads = {(0, 16): (9, 4), (0, 19): (7, 4)}[line]
    for name, n, m in zip(("megatron_alltoall", "megatron_allgather"), syncs, reads):
        assert rows[name]["host_syncs_per_layer"] == n, rows[name]["syncs"]
        assert rows[name]["host_reads_cpu"] == m
    assert rows["megatron_alltoall"]["event_waits"] == 1
    assert rows["megatron_allgather"]["event_waits"] == 0
    assert rows["ours"]["host_syncs_per_layer"] == rows["ours"]["host_reads_cpu"] == 0
    assert rows["ours"]["aten_ops"] < rows["megatron_allgather"]["aten_ops"]


def test_flex_refused_at_ep1_and_the_json(quick):
    doc, text = quick
    flex = doc["environment"]["flex"]
    if compat.mcore_line() == (0, 16):
        assert flex == {"flex": "AssertionError: Flex token dispatcher requires TPxEP > 1 when "
                                "instantiating MoELayer"}
    else:
        assert flex["deepep"] == "AssertionError: DeepEP dispatcher requires TPxEP > 1"
        assert flex["ncclep"] == "AssertionError: NCCL EP dispatcher requires TPxEP > 1"
        assert flex["hybridep"].startswith("ImportError: HybridEP is not installed.")
    assert isinstance(doc["environment"]["noisy"], bool)
    assert doc["environment"]["megatron_core"].startswith("{}.{}.".format(*compat.mcore_line()))
    for r in doc["results"]:
        assert r["fwd_bwd_ms"] > 0 and r["repeats"] == 1
    assert "host syncs/layer (GPU)" in text.splitlines()[0]
