"""The enable_cuda_graph path of the main job: config plumbing, refused combinations, and on
CPU the strict graph-safety audit in place of capture -- dense and MoE, LoRA, offload on/off --
with zero host syncs over the whole step."""

import os

import pytest
import torch
from tests.support.hydra_compose import compose_job, features_on
from tests.support.cuda_as_cpu import device_capability_standin, device_name_standin

from megatron_fastpath import compat
from megatron_fastpath._optional import MissingDependencyError, have
from megatron_fastpath.fp8 import FP8Config
from megatron_fastpath.graphs.config import CudaGraphConfig, plan_graphs_and_fp8
from tests.support.main_job import run_main_job


SMALL = ["training.steps=4", "training.micro_batches=1", "data.num_samples=96",
         "data.max_tokens=128", "data.max_len=48", "data.max_seqs=8", "model.num_layers=2",
         "model.hidden_size=64", "model.ffn_hidden_size=96", "model.moe_ffn_hidden_size=32",
         "offload.min_offload_bytes=0", "cuda_graphs.audit_steps=3"]


def cfg(overrides):
    return compose_job(features_on(SMALL + list(overrides)))


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe"])
@pytest.mark.parametrize("offload", [False, True])
def test_strict_audit_passes_lora_packed_with_and_without_offload(mcore_parallel, capsys, model, offload):
    from megatron_fastpath.train import run

    summary = run(cfg([f"model={model}", "fastpath.lora=true", "fastpath.cuda_graphs=true",
                       f"fastpath.offload={str(offload).lower()}"]))
    out = capsys.readouterr().out
    assert summary.audit_ok is True, summary.audit
    assert "graph-safety audit over 3 steps: PASS" in out
    assert summary.syncs_per_step == 0 and summary.syncs_fwd_bwd_per_step == 0
    assert 0 < summary.trainable_params < summary.total_params / 10  # only adapters train
    if offload:
        assert all(r.offload_mode == "double" and r.offload_bytes > 0 for r in summary.records)
        assert "offload: mode double" in out


def test_full_step_dense_packed_lora_has_zero_host_syncs(mcore_parallel):
    """Forward, backward, clipping, fused AdamW and LR schedule: 0 syncs; loss/tok/s are read
    back one step late outside the step."""
    from megatron_fastpath.train import run

    summary = run(cfg(["fastpath.lora=true", "training.steps=5", "training.sync_check=every"]))
    assert [r.syncs_step for r in summary.records] == [0] * 5
    assert all(r.sync_sites == () for r in summary.records)


def test_graph_plan_on_cuda_sets_megatron_fields_and_env():
    plan = plan_graphs_and_fp8(CudaGraphConfig(warmup_steps=2, use_te_rng_tracker=False),
                               None, torch.device("cuda"))
    assert plan.capture and not plan.audit
    assert plan.transformer_config == dict(cuda_graph_impl="local", cuda_graph_warmup_steps=2,
                                           use_te_rng_tracker=False, cuda_graph_scope=[])
    assert plan.env["NCCL_GRAPH_REGISTER"] == "0"
    assert plan.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert plan.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert ("TORCH_NCCL_AVOID_RECORD_STREAMS" in plan.env) == (compat.TORCH_RELEASE < (2, 8))
    from megatron_fastpath.model import ModelConfig, build_transformer_config

    tc = build_transformer_config(ModelConfig(), **plan.transformer_config)
    assert tc.cuda_graph_impl == "local" and tc.cuda_graph_warmup_steps == 2


def test_lora_graphs_with_zero_warmup_planned():
    from megatron_fastpath import rules

    facts = rules.RunFacts(names=rules.NAMES["main"], graphs_requested=True, graphs_captured=True,
                           lora=True, graph_warmup_steps=0)
    assert rules.refusals(facts) == []
    plan = plan_graphs_and_fp8(CudaGraphConfig(warmup_steps=0, use_te_rng_tracker=False), None,
                               torch.device("cuda"))
    assert plan.capture and plan.transformer_config["cuda_graph_warmup_steps"] == 0


@pytest.mark.parametrize("lora, warmup", [(True, 0), (False, 3)])
def test_default_warmup_is_zero_with_lora_on_cuda(lora, warmup):
    """The main job's LoRA + per-layer graphs job at the default ``cuda_graphs.warmup_steps``
    parses on CUDA (stand-ins): the default resolves to 0 with LoRA, 3 without (3 with LoRA is refused
    by ``rules._lora_graph_warmup`` whenever graphs are captured)."""
    from megatron_fastpath.train import parse_job_config
    from tests.support.graph_safe_standins import gpu_standins

    job = compose_job(features_on(["fastpath.cuda_graphs=true", f"fastpath.lora={str(lora).lower()}",
                                   "cuda_graphs.use_te_rng_tracker=false", "lora.dropout=0.0",
                                   "training.dtype=bfloat16", "training.device=cuda",
                                   "training.skip_memory_check=true", "cluster.backend=gloo"]))
    with gpu_standins():
        plan = parse_job_config(job).plan
    assert plan.capture and plan.transformer_config["cuda_graph_warmup_steps"] == warmup


def test_explicit_warmup_with_lora_on_cuda_still_refused():
    from megatron_fastpath.train import parse_job_config
    from tests.support.graph_safe_standins import gpu_standins

    job = compose_job(["fastpath.cuda_graphs=true", "fastpath.lora=true", "cuda_graphs.warmup_steps=3",
                       "cuda_graphs.use_te_rng_tracker=false", "lora.dropout=0.0",
                       "training.dtype=bfloat16", "training.device=cuda",
                       "training.skip_memory_check=true", "cluster.backend=gloo"])
    with gpu_standins(), pytest.raises(ValueError, match="LoRA with CUDA graphs needs cuda_graphs.warmup_steps=0"):
        parse_job_config(job)


def test_te_attention_without_te_rng_tracker_runs_full_iteration_graphs():
    """TE asserts its RNG tracker only while its own capture flag is set, which Megatron sets in
    per-layer capture and FullCudaGraphWrapper never does: full-iteration graphs with TE
    attention and Megatron's tracker are planned; per-layer graphs are still refused."""
    full = CudaGraphConfig(use_te_rng_tracker=False, scope="full_iteration")
    plan = plan_graphs_and_fp8(full, None, torch.device("cuda"), attention_backend="te")
    assert plan.full_iteration and plan.transformer_config["use_te_rng_tracker"] is False
    with pytest.raises(ValueError, match="needs cuda_graphs.use_te_rng_tracker=true"):
        plan_graphs_and_fp8(CudaGraphConfig(use_te_rng_tracker=False), None, torch.device("cuda"),
                            attention_backend="te")


def test_graph_plan_on_cpu_runs_the_audit_instead():
    plan = plan_graphs_and_fp8(CudaGraphConfig(), None, torch.device("cpu"))
    assert plan.audit and not plan.capture and plan.transformer_config == {} and plan.env == {}


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(graphs=CudaGraphConfig(use_te_rng_tracker=False), lora_dropout=0.1),
         ValueError, "need a graph-safe RNG tracker"),
        (dict(graphs=CudaGraphConfig(), megatron_cpu_offloading=True),
         ValueError, "keep offload off"),
        (dict(graphs=CudaGraphConfig(use_te_rng_tracker=False), offload=True),
         ValueError, "activation offload cannot run inside captured layer graphs"),
        (dict(fp8=FP8Config(), linear_impl="te"), MissingDependencyError,
         "transformer-engine"),
        # TE attention asserts its own RNG tracker class while a graph is captured
        (dict(graphs=CudaGraphConfig(use_te_rng_tracker=False, warmup_steps=0), attention_backend="te"),
         ValueError, "needs cuda_graphs.use_te_rng_tracker=true"),
    ],
)
def test_bad_graph_and_fp8_combinations_refused(kwargs, exc, match):
    if exc is MissingDependencyError and have("transformer_engine.pytorch"):
        pytest.skip("TE installed")
    graphs = kwargs.pop("graphs", None)
    fp8 = kwargs.pop("fp8", None)
    with pytest.raises(exc, match=match):
        plan_graphs_and_fp8(graphs, fp8, torch.device("cuda"), **kwargs)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["fastpath.cuda_graphs=true", "fastpath.lora=true", "cuda_graphs.use_te_rng_tracker=false"],
         "graph-safe RNG tracker"),
        (["fastpath.fp8=true"], "FP8"),
        (["model=tiny_moe", "fastpath.cuda_graphs=true", "parallel=ep2"], "capacity_factor"),
        (["fastpath.moe_capacity_factor=1.5"], "has no experts"),
        # one home per setting: the offload group cannot switch offload (fastpath.offload does)
        (["fastpath.offload=true", "+offload.enabled=false"], r"enabled is set by fastpath.offload"),
        (["fastpath.cuda_graphs=true", "+cuda_graphs.enabled=false"], r"unknown key\(s\) \['enabled'\]"),
        (["fp8.recipe=bogus"], None),
    ],
)
def test_bad_configs_refused_before_any_step(mcore_parallel, capsys, overrides, match):
    from megatron_fastpath.train import run

    if match is None:  # fp8 settings are validated only when fp8 is on
        run(cfg(overrides + ["training.steps=1"]))
        return
    with pytest.raises((ValueError, ImportError), match=match):
        run(cfg(overrides))
    assert "step " not in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe"])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graph_capture_matches_eager(model, fp8, tmp_path):
    """On a GPU: 20 steps with per-layer CUDA graphs (LoRA, packed) equal eager within
    tolerance; sync debug mode is clean inside the layers."""
    if fp8 and not have("transformer_engine.pytorch"):
        pytest.skip("FP8 needs Transformer Engine")

    losses = {}
    for graphs in ("false", "true"):
        run = run_main_job(
            [f"model={model}", "training.steps=20", "training.device=cuda",
             "training.dtype=bfloat16", "fastpath.lora=true",
             "fastpath.attention_backend=te" if fp8 else "fastpath.attention_backend=auto",
             f"fastpath.fp8={str(fp8).lower()}", f"fastpath.cuda_graphs={graphs}",
             "fastpath.moe_capacity_factor=2.0" if model == "tiny_moe" else "fastpath.lora=true"],
            tmp_path, name=f"graphs-{graphs}")
        losses[graphs] = [r["loss"] for r in run.summary["records"]]
        assert "host syncs: fwd+bwd 0" in run.stdout
    torch.testing.assert_close(torch.tensor(losses["true"]), torch.tensor(losses["false"]),
                               rtol=2e-2, atol=2e-2)


def test_allocator_env_is_set_before_anything_initialises_cuda(monkeypatch):
    """PYTORCH_CUDA_ALLOC_CONF is read once, when CUDA initialises (the caching
    allocator's config; torch.cuda.get_device_properties calls _lazy_init first): the
    preflight sets the graph plan's environment before its memory check initialises CUDA. A
    stand-in CUDA records the environment at that first initialising call."""
    import types

    from megatron_fastpath.train import parse_job_config, preflight

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "NCCL_GRAPH_REGISTER", "CUDA_DEVICE_MAX_CONNECTIONS",
                "TORCH_NCCL_AVOID_RECORD_STREAMS"):
        monkeypatch.delenv(var, raising=False)  # restored after the test
    seen = []

    def get_device_properties(device=None):  # the first call that initialises CUDA
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        return types.SimpleNamespace(total_memory=80 * 2**30)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    monkeypatch.setattr(torch.cuda, "get_device_name", device_name_standin("stand-in GPU"))
    job = parse_job_config(cfg(["training.device=cuda", "fastpath.cuda_graphs=true",
                                "cuda_graphs.use_te_rng_tracker=false", "cuda_graphs.warmup_steps=0"]))
    assert seen == [] and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # the parse sets nothing
    preflight(job)
    assert seen and seen[0] == "expandable_segments:True"


@pytest.mark.parametrize("dtype,capability,ok", [
    ("float32", (9, 0), False), ("bfloat16", (8, 0), False), ("bfloat16", (8, 9), False),
    ("bfloat16", (12, 0), False), ("bfloat16", (9, 0), True), ("bfloat16", (10, 0), True)])
def test_moe_graphs_need_grouped_mms_sync_free_path(monkeypatch, dtype, capability, ok):
    """torch._grouped_mm is sync-free only for bf16 on sm90 / sm100; elsewhere its fallback
    reads the offsets to the host per group, inside a captured layer. Stand-in CUDA of the
    given capability; the MoE job with graphs is refused by the preflight (which asks the GPU's
    capability) where the path syncs."""
    import types

    from megatron_fastpath.train import parse_job_config, preflight

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "NCCL_GRAPH_REGISTER", "CUDA_DEVICE_MAX_CONNECTIONS",
                "TORCH_NCCL_AVOID_RECORD_STREAMS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", device_capability_standin(capability))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", device_name_standin("stand-in GPU"))
    overrides = ["model=tiny_moe", "training.device=cuda", f"training.dtype={dtype}",
                 "fastpath.cuda_graphs=true", "cuda_graphs.use_te_rng_tracker=false",
                 "fastpath.attention_backend=sdpa"]
    job = parse_job_config(cfg(overrides))  # the capability is not asked at parse
    assert job.plan.capture
    if ok:
        preflight(job)
    else:
        with pytest.raises(ValueError, match=f"this run is {dtype} on sm{capability[0]}{capability[1]}.*"
                                             "training.dtype=bfloat16"):
            preflight(job)
