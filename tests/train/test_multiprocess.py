"""torchrun --nproc_per_node=2 runs of the main job on CPU (gloo): data parallel and expert
parallel give the same per-step losses as one process running the same global batch."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.subproc import child_env, free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

COMMON = ["training.steps=6", "data.num_samples=192", "data.max_tokens=128", "data.max_len=48",
          "data.max_seqs=8", "model.num_layers=2", "model.hidden_size=64",
          "model.ffn_hidden_size=96", "model.moe_ffn_hidden_size=32"]


def _run(tmp_path, name, overrides, nproc=1):
    out = tmp_path / f"{name}.json"
    entry = ["-m", "megatron_fastpath.train", *COMMON, *overrides, f"training.summary_json={out}"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", *entry]
    else:
        cmd = [sys.executable, *entry]
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f), proc.stdout


@pytest.mark.parametrize(
    "name, model, parallel",
    [("dp2", "tiny_dense", "single"), ("ep2", "tiny_moe", "ep2")],
)
def test_two_processes_match_one(tmp_path, name, model, parallel):
    multi, out = _run(tmp_path, name, [f"model={model}", f"parallel={parallel}",
                                       "training.micro_batches=1"], nproc=2)
    single, _ = _run(tmp_path, name + "_single", [f"model={model}", "training.micro_batches=2"])
    assert multi["world_size"] == 2 and single["world_size"] == 1
    assert len(multi["records"]) == len(single["records"]) == 6
    for a, b in zip(multi["records"], single["records"]):
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) <= 2e-4 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    assert multi["last_loss"] < multi["first_loss"]
    assert "ep 2" in out if name == "ep2" else "dp 2" in out
