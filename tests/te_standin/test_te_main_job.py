"""The main job with ``fastpath.linear_impl=te`` on the fake Transformer Engine
(``tests/support/fake_te``), on the GPU path inside the GPU stand-ins (``tests/workers/te_job_worker.py``, a
child process or torchrun, composed by Hydra): it builds TE's linears and trains with each FP8
recipe; TP=2 with sequence parallelism matches TP=1; graphs replay the eager losses. Exact
resume on TE's linears, with and without FP8, is the feature matrix's check
(``tests/train/test_feature_matrix.py``: every accepted TE-world combination, straight vs
resumed, bit for bit), not repeated here."""

import subprocess
import sys

import pytest
import torch

from tests.support.fake_te.activate import te_env
from tests.support.hydra_compose import features_on
from tests.support.main_job import main_job_cmd

pytestmark = pytest.mark.integration

STEPS = 4
GPU = ["training.device=cuda", "training.skip_memory_check=true", "cluster.backend=gloo",
       "fastpath.linear_impl=te", "fastpath.attention_backend=sdpa",
       # TE's RNG tracker is not what these tests are about: Megatron's graph-safe one
       "cuda_graphs.use_te_rng_tracker=false"]
BASE = [f"training.steps={STEPS}", "training.micro_batches=2", "training.warmup_steps=1",
        "data.num_samples=64", "data.max_tokens=64", "data.max_len=24", "data.max_seqs=8",
        "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", *GPU]
TE_CLASSES = {"TELayerNormColumnParallelLinear", "TERowParallelLinear"}


def job(tmp_path, name, overrides, nproc=1, base=BASE) -> list:
    """The te_job_worker's outputs, one per rank."""
    out = tmp_path / name
    cmd = main_job_cmd([str(out), *features_on([*base, *overrides]), f"hydra.run.dir={tmp_path}/hydra-{name}"],
                       nproc=nproc, entry=["-m", "tests.workers.te_job_worker"])
    proc = subprocess.run(cmd, cwd=tmp_path, env=te_env(WANDB_MODE="offline"), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(nproc)]


def records(run) -> list:
    return [(r["step"], r["loss"], r["lr"]) for r in run["summary"]["records"]]


def trained(tmp_path, overrides) -> dict:
    """One run of STEPS steps on TE's linears. (Its exact resume -- straight vs a checkpoint at
    step 3 resumed, bit for bit -- is the feature matrix's: tests/train/test_feature_matrix.py
    runs every accepted TE-world combination, these ``TE2.10.0 dense sdpa te-linears bf16
    [fp8:<recipe>] 1`` among them.)"""
    (run,) = job(tmp_path, "straight", overrides)
    assert TE_CLASSES <= set(run["types"])
    assert len(records(run)) == STEPS
    return run


def test_te_linears_bf16_train(tmp_path):
    losses = [r[1] for r in records(trained(tmp_path, ["training.dtype=bfloat16"]))]
    assert losses[-1] < losses[0]


def test_te_tp2_sequence_parallel_matches_tp1(tmp_path):
    fp32 = ["training.dtype=float32"]
    (one,) = job(tmp_path, "tp1", fp32)
    two = job(tmp_path, "tp2", fp32 + ["parallel.tensor_model_parallel_size=2",
                                       "parallel.sequence_parallel=true"], nproc=2)
    assert TE_CLASSES <= set(two[0]["types"])
    assert records(two[0]) == records(two[1])
    for (s1, l1, lr1), (s2, l2, lr2) in zip(records(one), records(two[0]), strict=True):
        assert (s1, lr1) == (s2, lr2)
        assert l2 == pytest.approx(l1, rel=1e-5), (s1, l1, l2)


# ------------------------------------------------------------------------------------ FP8
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "mxfp8", "blockwise"])
def test_fp8_recipe_trains(tmp_path, recipe):
    """fastpath.fp8=true: Megatron opens the fake's fp8_autocast with its recipe
    (``fp8_utils.get_fp8_recipe``), the TE linears quantise; delayed scaling's amax histories and
    scales move and are in the model's state (its ``_extra_state``, which the feature matrix's
    resumed runs restore bit for bit)."""
    cls = {"delayed": "TEDelayedScaling", "tensorwise": "Float8CurrentScaling",
           "mxfp8": "MXFP8BlockScaling", "blockwise": "Float8BlockScaling"}[recipe]
    straight = trained(tmp_path, ["training.dtype=bfloat16", "fastpath.fp8=true", f"fp8.recipe={recipe}"])
    meta = straight["fp8_meta"]
    assert len(meta) == 4 * 2 and {m["recipe"] for m in meta.values()} == {cls}  # 4 linears a layer
    if recipe == "delayed":  # scales moved off their initial 1 (amax seen at the autocast exits)
        assert all(m["scale_fwd"][:2].ne(1).all() for m in meta.values())
        assert any(k.endswith("_extra_state/amax_history_fwd") for k in straight["state"])


def test_fp8_delayed_tp2_sequence_parallel(tmp_path):
    """Delayed scaling under TP=2 + SP: amaxes max-reduced over the amax group Megatron hands the
    autocast, so both ranks hold the same scales; losses agree across ranks and stay close to
    TP=1 (FP8 + bf16: not bit-equal)."""
    fp8 = ["training.dtype=bfloat16", "fastpath.fp8=true", "fp8.recipe=delayed"]
    (one,) = job(tmp_path, "tp1", fp8)
    two = job(tmp_path, "tp2", fp8 + ["parallel.tensor_model_parallel_size=2",
                                      "parallel.sequence_parallel=true"], nproc=2)
    assert records(two[0]) == records(two[1])
    for name, m in two[0]["fp8_meta"].items():
        assert torch.equal(m["scale_fwd"], two[1]["fp8_meta"][name]["scale_fwd"]), name
    for (s1, l1, _), (s2, l2, _) in zip(records(one), records(two[0]), strict=True):
        assert l2 == pytest.approx(l1, rel=2e-3), (s1, l1, l2)


# ---------------------------------------------------------------------------- CUDA graphs
@pytest.mark.parametrize("fp8", [[], ["fastpath.fp8=true", "fp8.recipe=delayed"]],
                         ids=["bf16", "fp8-delayed"])
def test_cuda_graphs_with_te_replay_equals_eager(tmp_path, fp8):
    """fastpath.cuda_graphs=true with TE present: Megatron's cuda_graphs.py takes its TE paths
    (HAVE_TE_GRAPHS: capture flags, weak references, FP8 meta save / restore around capture) and
    the TE RNG tracker (cuda_graphs.use_te_rng_tracker, the default); the replayed steps give the
    eager run's losses bit for bit."""
    common = ["training.dtype=bfloat16", *fp8]
    (eager,) = job(tmp_path, "eager", common)
    (graphs,) = job(tmp_path, "graphs", common + ["fastpath.cuda_graphs=true",
                                                  "cuda_graphs.use_te_rng_tracker=true"])
    assert records(graphs) == records(eager)


# ------------------------------------------------------------------- Hugging Face checkpoint
def test_hf_checkpoint_lora_te_layout_equals_local(tmp_path):
    """model=hf with LoRA: the checkpoint's norms land in TE's fused layer_norm_weight
    (hf/convert.py), the adapters read TE's LayerNormLinear normalised input
    (return_layernorm_output, compat/te.py); losses and the evaluation equal the local linears'
    bit for bit in bf16."""
    import make_tiny_hf_llama

    ckpt = str(tmp_path / "tiny-llama")
    make_tiny_hf_llama.main(ckpt)
    common = ["training.dtype=bfloat16", "training.steps=3", "data.eval_every=0",
              "metrics.tensorboard=false", "metrics.wandb=off", "model=hf", f"model.path={ckpt}",
              "data=jsonl", f"data.path={make_tiny_hf_llama.__file__.rsplit('/', 1)[0]}/data/arith_chat.jsonl",
              "fastpath.lora=true"]
    (local,) = job(tmp_path, "local", common + ["fastpath.linear_impl=local"], base=GPU)
    (te,) = job(tmp_path, "te", common, base=GPU)
    assert TE_CLASSES <= set(te["types"]) and not TE_CLASSES & set(local["types"])
    assert records(te) == records(local)
    assert te["summary"]["eval_loss"] == local["summary"]["eval_loss"]


def test_te_standin_main_entry_reexecs_with_the_fake(tmp_path):
    """``python -m tests.workers.te_standin_main`` started without the fake on PYTHONPATH (the
    plain child environment) re-executes itself with it and runs the main job on TE linears."""
    from tests.support.main_job import job_env, run_main_job

    base = [o for o in BASE if not o.startswith("training.steps=")]
    run = run_main_job(features_on([*base, "training.steps=2", "training.dtype=bfloat16"]), tmp_path,
                       env=job_env(), entry=["-m", "tests.workers.te_standin_main"])
    assert len(run.summary["records"]) == 2
    assert "linear_fc1.layer_norm_weight" in run.output  # the TE layout's fused norm parameter
