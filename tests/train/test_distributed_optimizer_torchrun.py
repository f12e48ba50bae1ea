"""Megatron's distributed optimizer (ZeRO-1) in the main job at DP 2, under torchrun (2
processes, gloo, CPU) on the GPU step path (the GPU stand-ins: Megatron's real DDP, optimizer and
schedule on CUDA-as-CPU), with the sync-free optimizer step:

* per-step losses, gradient norms and final parameters equal the plain data-parallel run's (DP 2,
  Megatron's FP32Optimizer) within float tolerance -- the distributed optimizer reduce-scatters
  where plain DDP all-reduces (the same two-term sums) and takes the gradient norm as the root of
  the two ranks' squared shard norms summed, where the plain optimizer takes it over the whole
  gradient: the norms differ in the last bits (measured: relative 1.6e-7 at most), so does the
  clip factor (training.clip_grad below every norm: every step clips), and the parameters by
  1.2e-7 at most (magnitudes up to 1); the losses were equal. Tolerances: REL 1e-6 on losses and
  norms, ATOL 1e-6 on parameters;
* with the gradient reduce and the parameter all-gather overlapped and not, several buckets
  (parallel.bucket_size), with activation offload, per-layer CUDA graphs on top and the
  full-iteration graphs (the reduce-scatter, the shard's update and the all-gather captured; no
  overlap: DDP's hooks do nothing in a capture), for a dense full fine-tune, LoRA (only the
  adapters are in DDP's buckets and sharded), CP 2 (DP 1: Megatron shards over DP x CP, the two
  CP ranks) and MoE at EP 2 -- at a world of 2 the only EP 2 layout is DP 2 for the dense
  parameters (sharded over both ranks) and expert DP 1 (each rank's experts' optimizer is a
  DistributedOptimizer over one rank: nothing to shard; expert data parallelism shards from a
  world of 4 at EP 2);
* 0 host syncs in every step (training.sync_check=every), the optimizer step included;
* checkpoints of the sharded state: a DP 2 run stopped at step STOP and resumed gives the straight
  run's records bit for bit; the same step-STOP checkpoint resumed at DP 1 (one process, 2 x the
  microbatches: the same global batch) gives the restored records of the DP 2 run exactly and
  then the straight DP 1 run's losses within REL_RESHARD (DP 2 and DP 1 sum the gradients in
  another order, as tests/checkpoint/test_resume_torchrun.py's resharding).

The DP 2 runs share one torchrun launch, the DP 1 runs one process
(tests/workers/dist_opt_worker.py; about a minute here).
"""

import json
import subprocess

import pytest
import torch

from tests.support.main_job import job_env, main_job_cmd

STEPS = 4
COMMON = [f"training.steps={STEPS}", "data.num_samples=64", "data.max_tokens=128", "data.max_len=48",
          "data.max_seqs=8", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=96",
          "training.micro_batches=2", "training.device=cuda", "training.skip_memory_check=true",
          "cluster.backend=gloo", "training.sync_check=every", "training.optimizer_step=sync_free",
          "training.clip_grad=0.1"]  # below every step's norm: the clip factor is in play
PLAIN = ["parallel.distributed_optimizer=false"]
DIST = ["parallel.distributed_optimizer=true", "parallel.overlap_grad_reduce=false",
        "parallel.overlap_param_gather=false"]
# null: resolved on at DP 2 on CUDA; a small bucket size gives several buckets to overlap
DIST_OVERLAP = ["parallel.distributed_optimizer=true", "parallel.bucket_size=4096"]
GRAPHS = ["fastpath.cuda_graphs=true", "cuda_graphs.use_te_rng_tracker=false"]
FAMILIES = {
    "dense": ["model=tiny_dense"],
    # no LoRA dropout: its RNG-tracker fork reads the stand-in CUDA generator's state back
    # (megatron-core tensor_parallel/random.py:264), a sync the step would count in the forward
    "lora": ["model=tiny_dense", "fastpath.lora=true", "lora.dropout=0.0"],
    "moe": ["model=tiny_moe", "parallel=ep2", "model.moe_ffn_hidden_size=32",
            "fastpath.moe_capacity_factor=2.0"],  # capacity mode: dropless EP reads split sizes
    # CP 2 at a world of 2: DP 1, Megatron shards over DP x CP (the two CP ranks)
    "cp": ["model=tiny_dense", "parallel.context_parallel_size=2", "fastpath.attention_backend=sdpa"],
}
RUNS = {
    "dense-plain": FAMILIES["dense"] + PLAIN,
    "dense-dist": FAMILIES["dense"] + DIST,
    # stopped at its last step: no export, whose parameter gather would hide a stale read
    "dense-dist-overlap": FAMILIES["dense"] + DIST_OVERLAP + [f"training.stop_at_step={STEPS}"],
    "dense-dist-overlap-graphs": FAMILIES["dense"] + DIST_OVERLAP + GRAPHS,
    "dense-dist-overlap-offload": FAMILIES["dense"] + DIST_OVERLAP + ["fastpath.offload=true"],
    # the step as two CUDA graphs: the reduce-scatter captured with the backward, the shard's
    # update and the parameter all-gather in the optimizer graph (the overlaps resolve off)
    "dense-dist-full": FAMILIES["dense"] + ["parallel.distributed_optimizer=true",
                                            "fastpath.cuda_graphs=true",
                                            "cuda_graphs.scope=full_iteration",
                                            "cuda_graphs.use_te_rng_tracker=false"],
    "lora-plain": FAMILIES["lora"] + PLAIN,
    "lora-dist": FAMILIES["lora"] + DIST,
    "lora-dist-overlap": FAMILIES["lora"] + DIST_OVERLAP,
    "moe-plain": FAMILIES["moe"] + PLAIN,
    "moe-dist": FAMILIES["moe"] + DIST,
    "moe-dist-overlap": FAMILIES["moe"] + DIST_OVERLAP,
    "cp-plain": FAMILIES["cp"] + PLAIN,
    "cp-dist-overlap": FAMILIES["cp"] + DIST_OVERLAP,
}
REL = 1e-6
ATOL = 1e-6
STOP = 2
REL_RESHARD = 2e-4
# the DP 2 runs that save (checkpoint.dir under the test's root, filled in by the fixture): one
# stopped at STOP and resumed (exact resume), one stopped at STOP for the DP 1 resume
SAVING = {
    "dense-dist-stop": FAMILIES["dense"] + DIST + ["checkpoint.dir={root}/ckpt-exact",
                                                   f"training.stop_at_step={STOP}"],
    "dense-dist-resumed": FAMILIES["dense"] + DIST + ["checkpoint.dir={root}/ckpt-exact"],
    "dense-dist-straight-saving": FAMILIES["dense"] + DIST + ["checkpoint.dir={root}/ckpt-straight"],
    "dense-dist-stop-for-dp1": FAMILIES["dense"] + DIST + ["checkpoint.dir={root}/ckpt-dp1",
                                                           f"training.stop_at_step={STOP}"],
}
# DP 1, the global batch of DP 2 (2 microbatches per rank): 4 microbatches per step
DP1 = FAMILIES["dense"] + ["parallel.distributed_optimizer=true", "training.micro_batches=4"]
DP1_RUNS = {"dp1-resumed": DP1 + ["checkpoint.dir={root}/ckpt-dp1"], "dp1-straight": DP1}


def _launch(root, runs: dict, nproc: int, name: str) -> dict:
    spec = root / f"{name}.json"
    spec.write_text(json.dumps([{"name": n, "overrides": [x.replace("{root}", str(root))
                                                          for x in COMMON + o]}
                                for n, o in runs.items()]))
    proc = subprocess.run(main_job_cmd([str(spec), str(root)], nproc=nproc,
                                       entry=["-m", "tests.workers.dist_opt_worker"]),
                          cwd=root, env=job_env(), capture_output=True, text=True, timeout=1500)
    out = {}
    for run in runs:
        pair = []
        for rank in range(nproc):
            path = root / f"{run}.rank{rank}.pt"
            assert path.exists(), f"{run}: no result\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
            r = torch.load(path, weights_only=False)
            assert "error" not in r, f"{run} rank {rank}: {r['error']}"
            pair.append(r)
        out[run] = tuple(pair)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out[f"stdout-{name}"] = proc.stdout
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{run name: (rank 0's result, rank 1's result)}: the DP 2 runs in one torchrun launch, the
    DP 1 runs (one result each) in one process after it."""
    root = tmp_path_factory.mktemp("dist-opt")
    out = _launch(root, {**RUNS, **SAVING}, 2, "dp2")
    out["stdout"] = out.pop("stdout-dp2")
    out.update(_launch(root, DP1_RUNS, 1, "dp1"))
    return out


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * abs(b)


@pytest.mark.integration
@pytest.mark.parametrize("name", [n for n in RUNS if "-dist" in n])
def test_equal_to_plain_data_parallel(results, name):
    ref = results[name.split("-")[0] + "-plain"]
    for rank in (0, 1):
        got, want = results[name][rank], ref[rank]
        assert [r["step"] for r in got["records"]] == list(range(1, STEPS + 1))
        for g, w in zip(got["records"], want["records"], strict=True):
            assert _close(g["loss"], w["loss"]), (name, rank, g, w)
            assert _close(g["grad_norm"], w["grad_norm"]), (name, rank, g, w)
            assert g["lr"] == w["lr"]
        assert got["params"].keys() == want["params"].keys()
        for k, p in got["params"].items():
            torch.testing.assert_close(p, want["params"][k], rtol=0, atol=ATOL, msg=f"{name} {k}")
    # the runs trained: the final parameters moved away from the plain run's first step's start
    assert results[name][0]["records"][0]["loss"] != results[name][0]["records"][-1]["loss"]
    # the full-iteration run: step 1 eager, both graphs captured at step 2 and replayed after
    launches = [r["graph_launches"] for r in results[name][0]["records"]]
    assert launches == ([0] + [2] * (STEPS - 1) if name.endswith("-full") else [None] * STEPS)


@pytest.mark.integration
@pytest.mark.parametrize("name", list(RUNS))
def test_no_host_sync_in_any_step(results, name):
    for r in results[name]:
        assert r["sync_checked_steps"] == STEPS
        assert [(s["syncs_fwd_bwd"], s["syncs_step"]) for s in r["records"]] == [(0, 0)] * STEPS, (
            r["records"][0]["sync_sites"])


@pytest.mark.integration
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_optimizer_state_is_sharded_over_data_parallelism(results, family):
    """The distributed runs' leaves update this rank's shard: the dense (or adapter) parameters
    split over the two ranks; the plain runs' leaves hold every parameter on each rank."""
    plain = results[f"{family}-plain"]
    for name in [n for n in (f"{family}-dist", f"{family}-dist-overlap") if n in RUNS]:
        r0, r1 = (r["optimizer"] for r in results[name])
        trainable = results[name][0]["trainable"]
        if family == "moe":  # ChainedOptimizer: dense leaf, then the experts' (expert DP 1)
            assert r0["leaves"] == r1["leaves"] == ["DistributedOptimizer"] * 2
            assert r0["shard_numel"][1] == r1["shard_numel"][1] > 0
            dense = trainable - r0["shard_numel"][1]
            assert r0["shard_numel"][0] + r1["shard_numel"][0] == dense
            assert 0 < r0["shard_numel"][0] < dense
        else:
            assert r0["leaves"] == r1["leaves"] == ["DistributedOptimizer"]
            assert r0["shard_numel"][0] + r1["shard_numel"][0] == trainable
            assert 0 < r0["shard_numel"][0] < trainable
        assert sum(plain[0]["optimizer"]["shard_numel"]) == plain[0]["trainable"] == trainable
    if family == "lora":  # only the adapters train (and are in the buckets)
        base = results["dense-plain"][0]["trainable"]
        assert trainable < base / 4


@pytest.mark.integration
@pytest.mark.parametrize("name", [n for n in RUNS if "-dist" in n])
def test_overlap_settings_reach_megatron(results, name):
    opt = results[name][0]["optimizer"]
    overlap = "overlap" in name
    assert (opt["overlap_grad_reduce"], opt["overlap_param_gather"]) == (overlap, overlap)
    if overlap:  # several buckets, DDP's forward pre-hooks installed (the gather in the forward)
        assert opt["bucket_size"] == 4096 and opt["buckets"] > 1 and opt["forward_hooks"] > 0
    else:
        assert opt["bucket_size"] is None and opt["buckets"] == 1 and opt["forward_hooks"] == 0


@pytest.mark.integration
@pytest.mark.parametrize("name", list(RUNS))
def test_parameters_are_read_gathered(results, name):
    """With the overlapped gather the last step's update reaches the other rank's copy only at
    the next forward (DDP's pre-hooks) or in ``params_current`` (what evaluation, saves and
    exports run in): read before it, the run stopped at its last step holds stale parameters;
    every other run has gathered already -- the optimizer step did, or the export's
    ``params_current`` at the end of the run."""
    for r in results[name]:
        if name == "dense-dist-overlap":
            assert len(r["stale"]) > 0
        else:
            assert r["stale"] == [], r["stale"]


@pytest.mark.integration
def test_the_header_says_what_runs(results):
    lines = [line.strip() for line in results["stdout"].splitlines() if "data parallel:" in line]
    # rank 0 prints the header: once per run with the distributed optimizer or an overlap
    assert lines.count(
        "data parallel: distributed optimizer (optimizer state sharded over 2 ranks), gradient "
        "reduce overlapped with the backward, parameter gather overlapped with the forward, "
        "buckets of 4096 elements") == 6
    assert lines.count("data parallel: distributed optimizer (optimizer state sharded over 2 "
                       "ranks)") == 4 + len(SAVING)
    assert len(lines) == 10 + len(SAVING)


def _records(result):
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in result["records"]]


@pytest.mark.integration
def test_sharded_state_resumes_exactly_at_dp2(results):
    stopped, resumed = results["dense-dist-stop"], results["dense-dist-resumed"]
    straight = results["dense-dist-straight-saving"]
    for rank in (0, 1):
        assert len(stopped[rank]["records"]) == STOP
        assert _records(resumed[rank]) == _records(straight[rank])
        assert resumed[rank]["params"].keys() == straight[rank]["params"].keys()
        assert [k for k, p in resumed[rank]["params"].items()
                if not torch.equal(p, straight[rank]["params"][k])] == []


@pytest.mark.integration
def test_sharded_state_saved_at_dp2_resumes_at_dp1_as_the_straight_dp1_run(results):
    (resumed,), (straight,) = results["dp1-resumed"], results["dp1-straight"]
    dp2 = results["dense-dist-straight-saving"][0]
    assert f"ckpt-dp1/step_{STOP:08d}: {STOP} of {STEPS} steps done" in results["stdout-dp1"]
    # the first steps are the DP 2 run's, restored; the rest continue as the straight DP 1 run
    assert _records(resumed)[:STOP] == _records(dp2)[:STOP]
    assert len(resumed["records"]) == len(straight["records"]) == STEPS
    for g, w in zip(resumed["records"][STOP:], straight["records"][STOP:], strict=True):
        assert g["step"] == w["step"] and g["lr"] == w["lr"]
        assert abs(g["loss"] - w["loss"]) <= REL_RESHARD * abs(w["loss"]), (g, w)
    # DP 1 is the straight DP 2 run's global batch: its losses are DP 2's too
    for g, w in zip(straight["records"], dp2["records"], strict=True):
        assert abs(g["loss"] - w["loss"]) <= REL_RESHARD * abs(w["loss"]), (g, w)
