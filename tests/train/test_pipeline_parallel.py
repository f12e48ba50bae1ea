"""Pipeline parallel for real on CPU: PP=2 with 4 microbatches under torchrun (2 processes,
gloo, Megatron's 1F1B schedule with p2p over gloo, inside the CUDA-as-CPU mode via
tests/workers/pp_worker.py) against PP=1 from the same initial parameters, for dense, tiny_moe
and LoRA: losses, step-1 gradients and final parameters equal; each stage's cache holds exactly the slots 1F1B needs
(2 on stage 0, 1 on stage 1), never runs out and never refills a slot before its backward."""

import os
import subprocess
import sys

import pytest
import torch

from tests.workers import pp_worker
from tests.support.subproc import child_env, free_port

COMMON = ["training.steps=3", "data.num_samples=128", "model.num_layers=2", "model.hidden_size=64",
          "model.ffn_hidden_size=96", "data.max_tokens=128", "data.max_len=48", "data.max_seqs=8",
          "training.lr=5e-3", "cluster.backend=gloo", "training.device=cuda",
          "training.micro_batches=4",
          "training.skip_memory_check=true"]  # reads GPU properties; the mode has no GPU
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Measured: losses, gradients and parameters bit-identical; the grad norm (a sum of per-stage
# squares all-reduced over the pipeline group instead of one norm) within 1e-7 relative.
TOL = dict(atol=1e-6, rtol=1e-6)


def _torchrun(tmp_path, overrides, init):
    out = str(tmp_path / "pp.pt")
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO, PP_WORKER_INIT=init)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", "-m", "tests.workers.pp_worker", out, *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(f"{out}.rank{r}") for r in (0, 1)]


MODELS = {
    "dense": [],
    "tiny_moe": ["model=tiny_moe", "model.moe_ffn_hidden_size=32"],
    # LoRA dropout masks come from each stage's own RNG stream (PP=1 draws them in another
    # order), so the comparison runs without dropout.
    "lora": ["fastpath.lora=true", "lora.dropout=0.0"],
}


@pytest.mark.integration
@pytest.mark.parametrize("name", list(MODELS))
def test_pp2_1f1b_equals_pp1(mcore_parallel, tmp_path, name):
    init = str(tmp_path / "init.pt")
    overrides = COMMON + MODELS[name]
    ref = pp_worker.collect(overrides, save_init=init)
    stages = _torchrun(tmp_path, overrides + ["parallel.pipeline_model_parallel_size=2"], init)
    assert [s["pp_rank"] for s in stages] == [0, 1]

    for s in stages:  # the loss is all-reduced over the pipeline group: both stages log it
        torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(ref["losses"]), **TOL)
        torch.testing.assert_close(torch.tensor(s["grad_norms"]), torch.tensor(ref["grad_norms"]),
                                   atol=0, rtol=1e-6)
        assert all(x == (0, 0) for x in s["syncs"]), s["syncs"]  # sync-free optimizer step
        # and no torch.cuda.synchronize either (Megatron's batch_p2p_sync is turned off)
        assert s["device_waits"] == [0, 0, 0], s["device_waits"]
    grads = {**stages[0]["grads"], **stages[1]["grads"]}
    params = {**stages[0]["params"], **stages[1]["params"]}
    assert not stages[0]["grads"].keys() & stages[1]["grads"].keys()  # each layer on one stage
    assert grads.keys() == ref["grads"].keys() and params.keys() == ref["params"].keys()
    for n, g in ref["grads"].items():
        assert g.abs().sum() > 0 or n.endswith("lora_A"), n  # B = 0 at init: A's grad is 0
        torch.testing.assert_close(grads[n], g, **TOL, msg=n)
    for n, p in ref["params"].items():
        torch.testing.assert_close(params[n], p, **TOL, msg=n)

    # 1F1B slots: P - r per stage, all of them used every step, every backward checked its slot
    assert [s["num_slots"] for s in stages] == [2, 1] and ref["num_slots"] == 1
    assert stages[0]["max_in_flight"] == [2, 2, 2] and stages[1]["max_in_flight"] == [1, 1, 1]
    assert all(s["backward_checks"] == [4, 4, 4] for s in stages)
