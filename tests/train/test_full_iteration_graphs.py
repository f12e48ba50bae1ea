"""Full-iteration CUDA graphs: the main job's GPU step (``training.device=cuda``, run
on the CPU inside the GPU stand-ins: CUDA-as-CPU mode and the fake CUDA graph, whose capture
runs nothing a replay does not) with ``cuda_graphs.scope=full_iteration``.

6 steps of 3 microbatches, each step a different packing: step 1 eager, step 2 captured (the
forward+backward of all microbatches by Megatron's ``FullCudaGraphWrapper``, the sync-free
optimizer step with the device LR schedule as a second graph) and replayed, steps 3-6 replay
both. Per-step losses, learning rates and final parameters equal the eager GPU step's (graphs
off) for dense, MoE (dropless and capacity) and LoRA; a host read planted in either captured
region fails the capture; a checkpoint saved between replays resumes exactly.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.hydra_compose import features_on
from tests.support.matrix_runs import params

pytestmark = pytest.mark.integration

STEPS = 6
BASE = ["training.device=cuda", f"training.steps={STEPS}", "training.micro_batches=3",
        "data.num_samples=160", "data.max_tokens=128", "data.max_len=48", "data.max_seqs=8",
        "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=96",
        "model.moe_ffn_hidden_size=32", "training.warmup_steps=2", "cuda_graphs.use_te_rng_tracker=false",
        "training.sync_check=every", "training.skip_memory_check=true", "cluster.backend=gloo",
        "fastpath.linear_impl=local", "lora.dropout=0.0"]
FULL = ["fastpath.cuda_graphs=true", "cuda_graphs.scope=full_iteration"]
# MoE in bf16: CUDA graphs with the grouped_mm experts need torch._grouped_mm's sync-free path,
# bf16 on sm90 / sm100 only (rules._grouped_mm_in_graphs; the stand-in GPU answers sm90). The
# bf16 runs are compared bit for bit, the fp32 ones within rtol 1e-6.
KINDS = {
    "dense": [],
    "moe_dropless": ["model=tiny_moe", "training.dtype=bfloat16"],
    "moe_capacity": ["model=tiny_moe", "fastpath.moe_capacity_factor=2.0", "training.dtype=bfloat16"],
    "lora": ["fastpath.lora=true"],
}


def _train(overrides):
    """(summary, job) of the main job in this process, inside the GPU stand-ins."""
    from tests.support.hydra_compose import compose_job
    from tests.support.main_job import train_in_standins

    return train_in_standins(compose_job(features_on(BASE + list(overrides))))


def _assert_same_run(graphed, eager, job_g, job_e, rtol=1e-6, atol=1e-7):
    assert len(graphed.records) == len(eager.records) == STEPS
    for g, e in zip(graphed.records, eager.records):
        assert g.lr == e.lr, (g.step, g.lr, e.lr)
        assert g.loss == pytest.approx(e.loss, rel=rtol, abs=atol), (g.step, g.loss, e.loss)
    pg, pe = params(job_g), params(job_e)
    assert pg.keys() == pe.keys()
    for k in pg:
        torch.testing.assert_close(pg[k], pe[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.every_line) if k == "lora" else k
                                  for k in KINDS])
def test_full_iteration_equals_eager(mcore_parallel, kind):
    from megatron_fastpath.compat.graphs import full_cuda_graph_captured

    eager, job_e = _train(KINDS[kind])
    graphed, job_g = _train(KINDS[kind] + FULL)
    exact = "training.dtype=bfloat16" in KINDS[kind]
    _assert_same_run(graphed, eager, job_g, job_e, *((0, 0) if exact else ()))
    # step 1 eager, then two graph launches per step; 0 host syncs in every step
    assert [r.graph_launches for r in graphed.records] == [0] + [2] * (STEPS - 1)
    assert [r.syncs_step for r in graphed.records] == [0] * STEPS
    steps = job_g.step.graphs
    fwd_bwd = full_cuda_graph_captured()
    assert fwd_bwd.captured and steps.opt_graph.captured
    assert fwd_bwd.replays == steps.opt_graph.replays == STEPS - 1  # capture runs nothing itself
    # every step's packings differ (3 microbatches of other lengths): the graph read each one
    assert len({r.loss for r in graphed.records}) == STEPS
    # the cache's derived tensors are built inside the graph: once per microbatch per kind
    assert len({r.cache_builds for r in graphed.records}) == 1 and graphed.records[0].cache_builds > 0
    assert eager.records[0].graph_launches is None


def test_lr_schedule_advances_on_the_device(mcore_parallel):
    """The LR the captured optimizer applies comes from the device schedule, which equals
    Megatron's host scheduler after every step (warm-up and cosine decay both crossed)."""
    summary, job = _train(FULL)
    steps = job.step.graphs
    host = job.step.scheduler
    assert host.num_steps == STEPS
    for group, lr_0 in zip(host.optimizer.param_groups, steps.lr.lrs):
        assert float(lr_0) == group["lr"]
    assert len({r.lr for r in summary.records}) == STEPS  # the LR changed at every step


@pytest.mark.parametrize("region", ["forward", "optimizer"])
def test_planted_host_read_in_a_captured_region_fails(mcore_parallel, monkeypatch, region):
    from megatron_fastpath.train import full_iteration
    from tests.support.fake_cuda_graph import HostReadDuringCapture

    if region == "forward":
        real = full_iteration.masked_loss_sum

        def planted(per_token_1T, mask_1T):
            loss = real(per_token_1T, mask_1T)
            float(loss.detach())  # a host read of the loss inside the captured forward
            return loss

        monkeypatch.setattr(full_iteration, "masked_loss_sum", planted)
    else:
        real_body = full_iteration.FullIterationStep._optimizer_body

        def planted_body(self):
            real_body(self)
            self.last_grad_norm.item()  # a host read of the norm inside the optimizer graph

        monkeypatch.setattr(full_iteration.FullIterationStep, "_optimizer_body", planted_body)
    with pytest.raises(HostReadDuringCapture):
        _train(FULL)


def test_checkpoint_between_replays_resumes_exactly(mcore_parallel, tmp_path):
    """Stop after step 4 (steps 3-4 replayed), save, resume in a new job: it runs step 5
    eagerly, captures at step 6 from the restored parameters and optimizer states; records
    and final parameters equal the straight run's."""
    straight, job_s = _train(FULL + ["fastpath.lora=true"])
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}"]
    first, _ = _train(FULL + ["fastpath.lora=true"] + ckpt + ["training.stop_at_step=4"])
    assert first.stopped == "stop_at_step" and [r.graph_launches for r in first.records] == [0, 2, 2, 2]
    resumed, job_r = _train(FULL + ["fastpath.lora=true"] + ckpt)
    assert resumed.resumed_from.endswith("step_00000004")
    assert [(r.step, r.loss, r.lr) for r in resumed.records] == \
        [(r.step, r.loss, r.lr) for r in straight.records]
    a, b = params(job_s), params(job_r)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_refusals_at_parse():
    from megatron_fastpath.train import parse_job_config
    from tests.support.graph_safe_standins import gpu_standins
    from tests.support.hydra_compose import compose_job

    cases = [
        (["training.device=cpu"], "needs training.device=cuda"),
        (["fastpath.attention_backend=flex"], "flex attention backend with cuda_graphs.scope=full_iteration"),
        (["fastpath.offload=true"], "activation offload"),
        (["training.optimizer_step=megatron"], "sync_free"),
        (["parallel.pipeline_model_parallel_size=2"], "pipeline parallelism"),
    ]
    with gpu_standins():
        for extra, match in cases:
            with pytest.raises(ValueError, match=match):
                parse_job_config(compose_job(features_on(BASE + FULL + extra)))


# --------------------------------------------------------------- 2 processes (torchrun)
WORLD2 = {  # layout -> overrides: the collectives of each captured inside the graphs
    "data_parallel": ["fastpath.lora=true"],
    "context_parallel": ["fastpath.lora=true", "parallel.context_parallel_size=2",
                         "fastpath.attention_backend=sdpa"],
    "expert_parallel": ["model=tiny_moe", "fastpath.moe_capacity_factor=2.0",
                        "training.dtype=bfloat16", "parallel.expert_model_parallel_size=2"],
}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.every_line)
                                    if k == "expert_parallel" else k for k in WORLD2])
def test_two_processes_full_iteration_equals_eager(tmp_path, layout):
    """Under torchrun (2 processes, gloo, GPU stand-ins; the fake graph re-issues the captured
    c10d collectives at replay): the gradient all-reduce over DP (and DP x CP), the K/V
    all-gather of CP and the expert all-to-all of EP are captured in the graphs; per-step
    losses, learning rates and gradient norms and each rank's final parameters equal the eager
    GPU step's (fp32 rtol 1e-6; the bf16 MoE run bit for bit)."""
    import json
    import subprocess

    from tests.support.main_job import job_env, main_job_cmd

    out = tmp_path / "run"
    cmd = main_job_cmd([str(out), *BASE, *WORLD2[layout], f"hydra.run.dir={tmp_path}/hydra"],
                       nproc=2, entry=["-m", "tests.workers.full_iteration_worker"])
    proc = subprocess.run(cmd, cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    exact = "training.dtype=bfloat16" in WORLD2[layout]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"run.rank{rank}.json").read_text())
        eager, full = got["records"]["eager"], got["records"]["full"]
        assert [r[4] for r in full] == [0] + [2] * (STEPS - 1) and len(eager) == STEPS
        for (s, loss_e, lr_e, gn_e, _), (_, loss_f, lr_f, gn_f, _) in zip(eager, full):
            assert lr_f == lr_e, s
            assert loss_f == (loss_e if exact else pytest.approx(loss_e, rel=1e-6)), s
            assert gn_f == (gn_e if exact else pytest.approx(gn_e, rel=1e-6)), s
        assert got["max_param_rel_diff"] <= (0.0 if exact else 1e-6), got["max_param_rel_diff"]


def test_static_input_copies_wait_for_the_previous_step(mcore_parallel, monkeypatch):
    """Megatron's StaticBufferLoader copies the next step's inputs on its own stream; that stream
    first waits for the current stream, so the copies cannot overtake the previous step's
    replay (a GPU run is sync-free: the host runs ahead). megatron-core 0.19 waits before each
    microbatch's copy itself (0.19.2 full_cuda_graph.py:115, :129) and the step path adds
    nothing; on 0.16 the step path waits once per step."""
    from megatron_fastpath.compat.graphs import static_inputs_wait_upstream
    from tests.support import cuda_as_cpu

    waits = []
    monkeypatch.setattr(cuda_as_cpu._FakeStream, "wait_stream",
                        lambda self, other: waits.append((self, other)))
    _, job = _train(FULL)
    loader_stream = job.step.graphs.wrapper.static_loader.stream
    per_step = job.step.graphs.n if static_inputs_wait_upstream() else 1
    assert sum(w[0] is loader_stream for w in waits) == STEPS * per_step


def test_moe_fp32_numerics_with_the_gpu_only_rule_lifted(mcore_parallel, monkeypatch):
    """The fp32 check for MoE. On a GPU, MoE under CUDA graphs is bf16-only (torch's fp32
    ``_grouped_mm`` loops over the groups with host reads: rules._grouped_mm_in_graphs refuses
    it, test_full_iteration_equals_eager runs MoE in bf16). The CPU stand-in's grouped GEMM
    reads nothing on the host, so with that GPU-only rule lifted here the captured fp32 MoE step
    is checked as the dense one is: losses and final parameters within rtol 1e-6 of eager."""
    from megatron_fastpath.moe import experts

    monkeypatch.setattr(experts, "grouped_mm_sync_free_refusal", lambda *a, **k: None)
    eager, job_e = _train(["model=tiny_moe"])
    graphed, job_g = _train(["model=tiny_moe"] + FULL)
    _assert_same_run(graphed, eager, job_g, job_e)
    assert [r.graph_launches for r in graphed.records] == [0] + [2] * (STEPS - 1)
