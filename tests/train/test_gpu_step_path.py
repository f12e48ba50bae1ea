"""The main job's GPU step path (Megatron DDP, get_forward_backward_func, finalize_model_grads,
get_megatron_optimizer, optionally the sync-free optimizer step) run on CPU through the
test-only CUDA-as-CPU mode, against the CPU path (own microbatch loop, torch fused AdamW):
per-step losses and final parameters agree in fp32 (tolerance below), the step line shows the
path's host-sync count."""

import pytest
import torch

from tests.support.cuda_as_cpu import CALLS, PageableCopies, cuda_as_cpu
from tests.support.hydra_compose import compose_job
from tests.support.main_job import train_in_process

from megatron_fastpath.train import parse_job_config

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

FAST = ["training.steps=4", "data.num_samples=128", "model.num_layers=2", "model.hidden_size=64",
        "model.ffn_hidden_size=96", "data.max_tokens=128", "data.max_len=48", "data.max_seqs=8",
        "training.lr=5e-3", "cluster.backend=gloo",
        # the memory check reads the GPU's properties, which the CUDA-as-CPU mode has none of
        "training.skip_memory_check=true"]
MODELS = {
    "dense": [],
    "tiny_moe": ["model=tiny_moe", "model.moe_ffn_hidden_size=32"],
    # no dropout: on a GPU the row-parallel adapters' dropout draws from Megatron's model-parallel
    # stream, the CPU path's from the default generator (tests/lora/test_lora_dropout_rng.py)
    "lora": ["fastpath.lora=true", "lora.dropout=0.0"],
}
# fp32, 4 steps. The two paths differ in rounding only: fused vs single-tensor AdamW (last ulp),
# the loss scaled per microbatch (1/N_tokens vs n/N_tokens then /n by the schedule), gradients
# accumulated in .grad vs DDP's fp32 main_grad buffer, torch's vs Megatron's clipping.
# Measured: losses bit-identical; parameters within 1.2e-7 (dense), 6e-8 (tiny_moe),
# 6.1e-7 (LoRA adapters).
LOSS_RTOL = 1e-6
PARAM_ATOL, PARAM_RTOL = 2e-6, 1e-5


def _train(overrides):
    job, summary = train_in_process(FAST + overrides)
    params = {n: p.detach().clone() for n, p in job.model.named_parameters()}
    return summary, params, job


def _run_both(name, optimizer_step):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cpu, cpu_params, _ = _train(MODELS[name] + ["training.device=cpu"])
    waits = CALLS["torch.cuda.synchronize"]
    get_cuda_rng_tracker().reset()
    with cuda_as_cpu(), PageableCopies() as copies:
        gpu, gpu_params, job = _train(MODELS[name] + ["training.device=cuda",
                                                      f"training.optimizer_step={optimizer_step}"])
    # no explicit device-wide wait anywhere in the run (build included)
    assert CALLS["torch.cuda.synchronize"] == waits
    # No copy of the steps from pageable memory (a stream sync each on CUDA); the token
    # ids / labels and loss masks of every microbatch went through the pinned staging ring
    assert [site for site, _ in copies.syncs if "megatron_fastpath" in site and "/train/" in site] == []
    assert job.step.staging.stats.copies == gpu.steps * 2 and copies.pinned >= 2 * job.step.staging.stats.copies
    # the job seeded Megatron's CUDA RNG tracker, which LoRA dropout (and, under sequence
    # parallelism, the embedding dropout) fork on a GPU: unseeded, the first fork raises
    assert "model-parallel-rng" in get_cuda_rng_tracker().get_states()
    return cpu, cpu_params, gpu, gpu_params, job


@pytest.mark.parametrize("name", list(MODELS))
def test_gpu_path_matches_cpu_path(mcore_parallel, name, capsys):
    cpu, cpu_params, gpu, gpu_params, job = _run_both(name, "sync_free")
    out = capsys.readouterr().out
    assert gpu.device.startswith("cuda") and cpu.device == "cpu"
    assert type(job.step.optimizer).__name__ == "SyncFreeOptimizer"
    for a, b in zip(cpu.records, gpu.records):
        assert a.tokens == b.tokens
        assert abs(a.loss - b.loss) <= LOSS_RTOL * abs(a.loss), (name, a.step, a.loss, b.loss)
    assert gpu_params.keys() == cpu_params.keys()
    trained = 0
    for n, p in cpu_params.items():
        torch.testing.assert_close(gpu_params[n], p, atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=n)
        trained += p.requires_grad
    # the GPU path's step line: 0 host syncs in the whole step with the sync-free optimizer
    assert gpu.syncs_fwd_bwd_per_step == 0 and gpu.syncs_per_step == 0, gpu.records[0].sync_sites
    assert "host syncs: fwd+bwd 0, step 0" in out and "grad norm" in out
    assert all(r.grad_norm > 0 and r.skipped is False for r in gpu.records)
    # A GPU step's tok/s from its device time (timing events around the step,
    # read with its loss), not the host's issue time; the stand-in Event keeps CUDA's contract
    # (enable_timing on both, both recorded) and times the interval the events enclose
    for r in gpu.records:
        assert r.host_ms is not None and r.step_ms >= r.host_ms
        assert r.tokens_per_s == pytest.approx(r.tokens / (r.step_ms / 1e3))
    assert all(r.host_ms == r.step_ms for r in cpu.records)


def test_megatron_optimizer_step_syncs_shown(mcore_parallel, capsys):
    """Megatron's own step on the same path: same numbers, but its host reads in the step line
    (the grad norm twice -- clip_grads.py .item() and the local l2 norm's float() -- and torch
    AdamW's per-parameter step count without TE/Apex)."""
    cpu, cpu_params, gpu, gpu_params, job = _run_both("dense", "megatron")
    out = capsys.readouterr().out
    n_params = sum(1 for p in job.model.parameters() if p.requires_grad)
    assert gpu.syncs_fwd_bwd_per_step == 0
    # megatron-core 0.19's step also reads its grad-norm-group flag once, then caches it
    # (optimizer.py:319 has_grad_norm_group, flag.item()): one more host read in the first step
    from megatron_fastpath import compat

    first_only = 0 if compat.mcore_line() == (0, 16) else 1
    assert gpu.syncs_per_step == 2 + n_params + first_only / gpu.sync_checked_steps, gpu.records[0].sync_sites
    assert f"host syncs: fwd+bwd 0, step {2 + n_params} |" in out
    sites = " ".join(gpu.records[0].sync_sites)
    assert "clip_grads.py" in sites and "step_with_ready_grads" in sites
    for a, b in zip(cpu.records, gpu.records):
        assert abs(a.loss - b.loss) <= LOSS_RTOL * abs(a.loss)
    for n, p in cpu_params.items():
        torch.testing.assert_close(gpu_params[n], p, atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=n)


def test_pipeline_with_offload_refused():
    """PP=2 with activation offload: refused before any model is built (one pass in flight per
    offload manager; 1F1B has two on stage 0)."""
    with cuda_as_cpu():
        with pytest.raises(ValueError, match="offload with pipeline parallelism is not supported"):
            parse_job_config(compose_job(FAST + ["training.device=cuda", "fastpath.offload=true",
                                          "parallel.pipeline_model_parallel_size=2"]))


def test_bf16_sync_free_step_equals_megatron_step(mcore_parallel):
    """bf16 (Megatron's Float16OptimizerWithFloat16Params, fp32 main params) on the GPU path:
    the sync-free step gives exactly Megatron's losses and parameters, with 0 syncs."""
    runs = {}
    for mode in ("megatron", "sync_free"):
        with cuda_as_cpu():
            runs[mode] = _train(["training.device=cuda", "training.dtype=bfloat16",
                                 f"training.optimizer_step={mode}"])
    (ref, ref_params, _), (ours, our_params, our_job) = runs["megatron"], runs["sync_free"]
    assert [type(l).__name__ for l in our_job.step.optimizer.leaves] == [
        "Float16OptimizerWithFloat16Params"]
    assert [r.loss for r in ours.records] == [r.loss for r in ref.records]
    assert sum(p.dtype == torch.bfloat16 for p in ref_params.values()) > len(ref_params) // 2
    for n, p in ref_params.items():
        assert torch.equal(our_params[n], p), n
    assert ours.syncs_per_step == 0 and ref.syncs_per_step > 2


def test_bf16_gpu_path_saves_and_resumes_like_megatron(mcore_parallel, tmp_path):
    """bf16 full training on the GPU path: every parameter is bf16 before Megatron's optimizer
    sees it, as Megatron's ``Float16Module`` casts the model (the local spec builds its norms in
    fp32), so ``Float16OptimizerWithFloat16Params.sharded_state_dict`` maps all of them and a
    checkpoint saves. Before, the first save raised "Param id N does not match any model
    sharded param". Straight 3 steps == 2 steps + save + resume + 1."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_fastpath.train import run

    args = FAST + ["training.device=cuda", "training.dtype=bfloat16", "training.steps=3"]
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}"]
    runs = []
    for extra in ([], ckpt + ["training.stop_at_step=2"], ckpt):  # run(): the job's checkpointing
        get_cuda_rng_tracker().reset()
        with cuda_as_cpu():
            summary, job = run(compose_job(args + extra), return_job=True, announce=False)
        runs.append((summary, {n: p.detach().clone() for n, p in job.model.named_parameters()}, job))
    (straight, params, job), (first, _, _), (resumed, resumed_params, _) = runs
    assert {p.dtype for p in job.model.parameters()} == {torch.bfloat16}
    assert [s["step"] for s in first.checkpoint_saves] == [2]
    assert [(r.step, r.loss) for r in resumed.records] == [(r.step, r.loss) for r in straight.records]
    for n, p in params.items():
        assert torch.equal(resumed_params[n], p), n


def test_fp32_adapters_in_bf16_refused_on_the_gpu_path():
    """fp32 LoRA adapters next to bf16 weights would be "fp32_from_fp32" parameters, which
    Megatron's 16-bit optimizer cannot checkpoint: refused at parse, with the fix."""
    with cuda_as_cpu():
        with pytest.raises(ValueError, match="lora.dtype=float32 with training.dtype=bfloat16 on the GPU path"):
            parse_job_config(compose_job(FAST + ["training.device=cuda", "training.dtype=bfloat16",
                                                 "fastpath.lora=true", "lora.dtype=float32"]))
