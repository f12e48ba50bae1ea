"""benchmarks/gpu_step.py on the CPU: its model-FLOP count against torch's own FLOP counter
(``torch.utils.flop_counter.FlopCounterMode``) over a real step of the fast path, and its report
with the GPU-only sides named as skipped and why."""

import types

from torch.utils.flop_counter import FlopCounterMode

import gpu_step  # benchmarks/ is on pytest's pythonpath (pytest.ini)

TINY = dict(model="tiny_dense", layers=2, tokens=256, max_seqs=16, min_len=16, max_len=64,
            samples=64, steps=2, micro_batches=2, device="cpu")


def test_gemm_flops_equal_torchs_count_of_a_training_step(mcore_parallel):
    """Every GEMM of a forward + backward + optimizer step is an ``aten.mm`` on the CPU; torch
    counts 2 FLOPs per multiply-add. The step's GEMMs run over the padded bins (T tokens each),
    so the count is 3 x gemm_flops(T) exactly (backward: data and weight gradients)."""
    from megatron_fastpath.train import train_step

    args = types.SimpleNamespace(**TINY)
    job = gpu_step.build(args, [])
    batch = job.data.batch(1)
    with FlopCounterMode(display=False) as counter:
        train_step(job, batch, check_syncs=False)
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    padded = sum(mb.tokens_1T.shape[1] for mb in batch.microbatches)
    assert padded == 2 * 256
    assert counts == {"aten.mm": 3 * gpu_step.gemm_flops(gpu_step._shape(args), padded)}


def test_attention_flops_are_half_the_causal_square():
    shape = gpu_step.Shape(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=100)
    # one sequence of n: QK^T and PV, 2 x n x n x head_dim each per head, causal: half
    n = 10
    full = 2 * (2 * n * n * shape.head_dim) * shape.heads * shape.layers
    assert gpu_step.attention_flops(shape, [n]) == full / 2
    assert gpu_step.model_flops(shape, [n, 6]) == 3 * (gpu_step.gemm_flops(shape, 16)
                                                       + gpu_step.attention_flops(shape, [n, 6]))


def test_cpu_run_reports_ours_and_names_the_gpu_sides(tmp_path, mcore_parallel):
    out = tmp_path / "s.json"
    r = gpu_step.main(["--device", "cpu", "--model", "tiny_dense", "--layers", "2", "--tokens", "256",
                       "--max-seqs", "16", "--min-len", "16", "--max-len", "64", "--samples", "64",
                       "--reps", "2", "--json", str(out)])
    assert [row["side"] for row in r["results"]] == ["ours"]
    row = r["results"][0]
    assert row["host_syncs_per_step"] == 0 and len(row["step_ms_all"]) == 1
    assert row["tokens_per_s"] > 0 and 0 <= row["mfu"] < 1
    assert set(r["skipped"]) == {"ours_layer_graphs", "ours_full_iteration", "megatron"}
    assert "needs CUDA" in r["skipped"]["megatron"]
    assert r["load"]["cores"] >= 1 and out.exists()
