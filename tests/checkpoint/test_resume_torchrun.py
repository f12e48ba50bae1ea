"""Checkpoints under torchrun (2 processes, gloo, CPU).

* Exact resume at DP=2, EP=2 and TP=2: straight vs stop_at_step + rerun, bit-identical records. (At
  EP=2 this once held for the first resumed step only: each rank clipped with its own gradient
  norm, so the replicated dense parameters drifted apart and the checkpoint, which keeps one
  replica, handed rank 1 rank 0's copy. The CPU path now clips with the global norm,
  ``train.step.global_grad_norm``; tests/optim/test_global_grad_norm.py.)
* Resharding: saved at world 1 (EP=1, 2 microbatches per step), resumed at world 2 with DP=2,
  EP=2 (1 microbatch per rank: the same global batch) or TP=2 (each rank loads its shards). The resumed steps equal an uninterrupted
  run at that layout within fp32 tolerance (rel 2e-4: world 1 and world 2 sum gradients in a
  different order, as in test_multiprocess.py); the restored records of the first steps are the
  world-1 run's, exactly.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.subproc import child_env, free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
STEPS, STOP = 6, 3
COMMON = [f"training.steps={STEPS}", "data.num_samples=192", "data.max_tokens=128", "data.max_len=48",
          "data.max_seqs=8", "model.num_layers=2", "model.hidden_size=64",
          "model.ffn_hidden_size=96", "model.moe_ffn_hidden_size=32"]
LAYOUTS = {"dp2": ["model=tiny_dense", "parallel=single"], "ep2": ["model=tiny_moe", "parallel=ep2"],
           "tp2": ["model=tiny_dense", "parallel=single", "parallel.tensor_model_parallel_size=2"]}
REL_TOL = 2e-4


def _run(tmp_path, name, overrides, nproc):
    out = tmp_path / f"{name}.json"
    entry = ["-m", "megatron_fastpath.train", *COMMON, *overrides, f"training.summary_json={out}",
             f"hydra.run.dir={tmp_path}/hydra-{name}"]
    cmd = [sys.executable, *entry]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", *entry]
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f), proc.stdout


def _first_line(out):
    """The job's own first line (other ranks' Megatron log records may come earlier)."""
    return next(line for line in out.splitlines() if not line.startswith("[20"))


def _records(summary):
    return [(r["step"], r["loss"], r["lr"]) for r in summary["records"]]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_exact_resume_two_processes(tmp_path, layout):
    par = LAYOUTS[layout] + ["training.micro_batches=1"]
    ckpt = [f"checkpoint.dir={tmp_path}/ckpt"]
    straight, _ = _run(tmp_path, "straight", par + [f"checkpoint.dir={tmp_path}/straight_ckpt"], 2)
    first, _ = _run(tmp_path, "first", par + ckpt + [f"training.stop_at_step={STOP}"], 2)
    assert first["stopped"] == "stop_at_step" and len(first["records"]) == STOP
    resumed, out = _run(tmp_path, "resumed", par + ckpt, 2)
    assert _first_line(out).startswith(f"resuming from {tmp_path}/ckpt/step_{STOP:08d}")
    assert resumed["world_size"] == 2
    assert _records(resumed) == _records(straight)
    assert [r["grad_norm"] for r in resumed["records"]] == [r["grad_norm"] for r in straight["records"]]
    final = f"step_{STEPS:08d}/model"  # final parameters and optimizer state, every tensor
    a, b = _tensors(tmp_path / "ckpt" / final, tmp_path), _tensors(tmp_path / "straight_ckpt" / final, tmp_path)
    assert sorted(a) == sorted(b) and len(a) > 10
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def _tensors(model_dir, tmp_path):
    """Every tensor of a torch_dist checkpoint directory (torch DCP), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{model_dir.parent.parent.name}.pt"
    dcp_to_torch_save(str(model_dir), str(out))
    return {k: v for k, v in torch.load(out, weights_only=True).items() if isinstance(v, torch.Tensor)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_world1_checkpoint_resumes_resharded_at_world2(tmp_path, layout):
    model = LAYOUTS[layout][:1]
    ckpt = [f"checkpoint.dir={tmp_path}/ckpt"]
    one, _ = _run(tmp_path, "world1", model + ["training.micro_batches=2", *ckpt,
                                              f"training.stop_at_step={STOP}"], 1)
    per_rank = [f"training.micro_batches={2 if layout == 'tp2' else 1}"]  # global batch: 2
    resumed, out = _run(tmp_path, "resumed", LAYOUTS[layout] + per_rank + ckpt, 2)
    reference, _ = _run(tmp_path, "reference", LAYOUTS[layout] + per_rank, 2)
    assert _first_line(out).startswith(f"resuming from {tmp_path}/ckpt/step_{STOP:08d}")
    assert "RNG states not restored: saved at world 1, now 2" in out
    assert {"ep2": "ep 2", "dp2": "dp 2", "tp2": "tp 2"}[layout] in out
    assert _records(resumed)[:STOP] == _records(one)  # restored from the world-1 checkpoint
    for a, b in zip(resumed["records"][STOP:], reference["records"][STOP:]):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) <= REL_TOL * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    assert len(resumed["records"]) == STEPS
