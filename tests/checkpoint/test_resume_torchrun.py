"""Checkpoints under torchrun (2 processes, gloo, CPU).

* Exact resume at DP=2 and EP=2 (TP=2: the feature matrix's world-2 runs): the straight run's
  step-3 checkpoint resumed, bit-identical records and final state. (At
  EP=2 every rank clips with the global gradient norm, ``train.step.global_grad_norm``
  (tests/optim/test_global_grad_norm.py): with each rank's own norm the replicated dense
  parameters would drift apart, and the checkpoint, which keeps one replica, would hand rank 1
  rank 0's copy.)
* Resharding: saved at world 1 (EP=1, 2 microbatches per step), resumed at world 2 with DP=2,
  EP=2 (1 microbatch per rank: the same global batch) or TP=2 (each rank loads its shards). The resumed steps equal an uninterrupted
  run at that layout within fp32 tolerance (rel 2e-4: world 1 and world 2 sum gradients in a
  different order, as in the two-processes test below); the restored records of the first steps are the
  world-1 run's, exactly.
* Two processes match one: the first steps of the DP=2 and EP=2 runs equal the world-1 run of the
  same global batch within the same tolerance.

The runs are shared within the module (each is a torchrun of the main job, ~25 s here): the DP=2
and EP=2 uninterrupted runs serve as the exact-resume reference, the resharding reference and
the two-processes side; one world-1 checkpoint per model serves every layout resumed from it.
"""

import shutil

import pytest
import torch


STEPS, STOP = 6, 3
MAIN_JOB_COMMON = [f"training.steps={STEPS}", "data.num_samples=192", "data.max_tokens=128",
                   "data.max_len=48", "data.max_seqs=8", "model.num_layers=2", "model.hidden_size=64",
                   "model.ffn_hidden_size=96", "model.moe_ffn_hidden_size=32"]
LAYOUTS = {"dp2": ["model=tiny_dense", "parallel=single"], "ep2": ["model=tiny_moe", "parallel=ep2"],
           "tp2": ["model=tiny_dense", "parallel=single", "parallel.tensor_model_parallel_size=2"]}
# micro-batches per rank for a global batch of 2 (TP ranks share their microbatches)
PER_RANK = {"dp2": 1, "ep2": 1, "tp2": 2}
REL_TOL = 2e-4


@pytest.fixture
def runs(main_job_runs):
    """name -> the main job's run (summary, output), each run once per module."""
    return main_job_runs


def straight(runs, layout):
    """The uninterrupted two-process run at ``layout`` with 1 microbatch per rank, saving at
    step STOP (``checkpoint.interval``; the async save is written while the next step trains)
    and at the end."""
    return runs(f"straight-{layout}", LAYOUTS[layout] + ["training.micro_batches=1", f"checkpoint.interval={STOP}",
                                                          f"checkpoint.dir={{root}}/straight-{layout}/ckpt"], 2)


def world1(runs, model):
    """One process, 2 microbatches per step (the global batch of two ranks), stopped at STOP."""
    name = f"world1-{model.removeprefix('model=')}"
    return runs(name, [model, "training.micro_batches=2", f"checkpoint.dir={{root}}/{name}/ckpt",
                       f"training.stop_at_step={STOP}"], 1)


def _first_line(out):
    """The job's own first line (other ranks' Megatron log records may come earlier)."""
    return next(line for line in out.splitlines() if not line.startswith("[20"))


def _records(summary):
    return [(r["step"], r["loss"], r["lr"]) for r in summary["records"]]


def _close(a_records, b_records):
    for a, b in zip(a_records, b_records, strict=True):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) <= REL_TOL * abs(b["loss"]), (a["step"], a["loss"], b["loss"])


@pytest.mark.integration
# TP=2's exact resume is the feature matrix's: every TP=2 combination it trains is run straight and
# resumed and compared bit for bit (tests/support/matrix_runs.py straight_vs_resumed)
@pytest.mark.parametrize("layout", ["dp2", pytest.param("ep2", marks=pytest.mark.every_line)])
def test_exact_resume_two_processes(runs, layout):
    """The straight run's step-STOP checkpoint, copied alone into a fresh directory, resumed:
    the records (the restored ones and the resumed steps') and the final parameters and
    optimizer state equal the straight run's bit for bit. (A run stopped by
    ``training.stop_at_step`` and resumed under torchrun: test_context_parallel_torchrun.py
    test_resume_at_cp2_is_exact_and_cp2_reshards_to_cp1; here the world-1 runs stop so.)"""
    ref = straight(runs, layout).summary
    assert [s["step"] for s in ref["checkpoint_saves"]] == [STOP, STEPS], ref["checkpoint_saves"]
    ckpt, step_dir = runs.root / f"exact-{layout}", f"step_{STOP:08d}"
    if not ckpt.exists():
        shutil.copytree(runs.root / f"straight-{layout}" / "ckpt" / step_dir, ckpt / step_dir)
    resumed = runs(f"resumed-{layout}", LAYOUTS[layout] + ["training.micro_batches=1", f"checkpoint.dir={ckpt}"], 2)
    assert _first_line(resumed.stdout).startswith(f"resuming from {ckpt}/step_{STOP:08d}")
    assert resumed.summary["world_size"] == 2
    assert _records(resumed.summary) == _records(ref)
    assert [r["grad_norm"] for r in resumed.summary["records"]] == [r["grad_norm"] for r in ref["records"]]
    final = f"step_{STEPS:08d}/model"  # final parameters and optimizer state, every tensor
    a = _tensors(ckpt / final, runs.root / f"resumed-{layout}")
    b = _tensors(runs.root / f"straight-{layout}" / "ckpt" / final, runs.root / f"straight-{layout}")
    assert sorted(a) == sorted(b) and len(a) > 10
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def _tensors(model_dir, out_dir):
    """Every tensor of a torch_dist checkpoint directory (torch DCP), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = out_dir / "final_tensors.pt"
    dcp_to_torch_save(str(model_dir), str(out))
    return {k: v for k, v in torch.load(out, weights_only=True).items() if isinstance(v, torch.Tensor)}


@pytest.mark.integration
@pytest.mark.parametrize("layout", [pytest.param("dp2", marks=pytest.mark.smoke), "ep2"])
def test_two_processes_match_one(runs, layout):
    """Data / expert parallel over two processes gives the losses of one process running the
    same global batch (2 microbatches)."""
    multi, out = straight(runs, layout).summary, straight(runs, layout).stdout
    single = world1(runs, LAYOUTS[layout][0]).summary
    assert multi["world_size"] == 2 and single["world_size"] == 1
    _close(multi["records"][:STOP], single["records"])
    assert multi["last_loss"] < multi["first_loss"]
    assert {"ep2": "ep 2", "dp2": "dp 2"}[layout] in out


@pytest.mark.integration
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_world1_checkpoint_resumes_resharded_at_world2(runs, layout):
    model = LAYOUTS[layout][0]
    one = world1(runs, model)
    ckpt = runs.root / f"reshard-{layout}"  # a copy: the resumed run adds its own checkpoints
    shutil.copytree(runs.root / f"world1-{model.removeprefix('model=')}" / "ckpt", ckpt)
    per_rank = [f"training.micro_batches={PER_RANK[layout]}"]
    resumed = runs(f"reshard-resumed-{layout}", LAYOUTS[layout] + per_rank + [f"checkpoint.dir={ckpt}"], 2)
    # the uninterrupted run at that layout (DP=2 / EP=2: the straight run, same settings)
    reference = (straight(runs, layout) if PER_RANK[layout] == 1
                 else runs(f"reference-{layout}", LAYOUTS[layout] + per_rank, 2)).summary
    out = resumed.stdout
    assert _first_line(out).startswith(f"resuming from {ckpt}/step_{STOP:08d}")
    assert "RNG states not restored: saved at world 1, now 2" in out
    assert {"ep2": "ep 2", "dp2": "dp 2", "tp2": "tp 2"}[layout] in out
    assert _records(resumed.summary)[:STOP] == _records(one.summary)  # restored from world 1
    _close(resumed.summary["records"][STOP:], reference["records"][STOP:])
    assert len(resumed.summary["records"]) == STEPS
