"""``linear_cross_entropy`` at TP = 2 (torchrun, 2 gloo ranks; tests/workers/linear_cross_entropy_worker.py,
one launch for every case) equals Megatron's ``ColumnParallelLinear`` + ``vocab_parallel_cross_entropy``
with Megatron's parallel state at TP 2: on each rank the per-token loss, the hidden's gradient
(all-reduced over TP, or reduce-scattered to the rank's sequence shard with sequence
parallelism) and the rank's weight-shard gradient, for untied, tied and frozen weights, label
smoothing 0 and 0.1 (Megatron's smoothing term is per rank: its mean over the rank's partition),
chunked and in one chunk."""

import os
import subprocess
import sys

import pytest
import torch

from tests.support.subproc import child_env, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
S, B, H, V = 12, 2, 16, 64


@pytest.mark.integration
def test_tp2_equals_megatron_with_and_without_sequence_parallel(tmp_path):
    out = str(tmp_path / "lce.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", "-m", "tests.workers.linear_cross_entropy_worker", out]
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [torch.load(f"{out}.rank{r}") for r in (0, 1)]
    assert len(results[0]) == 24
    for case in results[0]:
        sp, kind, smoothing, chunk = case
        for r in (0, 1):
            ref, ours = results[r][case]["megatron"], results[r][case]["ours"]
            msg = f"rank {r} {case}"
            assert ours["loss"].shape == (B, S) and ours["loss"].dtype == torch.float32
            torch.testing.assert_close(ours["loss"], ref["loss"], rtol=1e-6, atol=1e-6, msg=msg)
            assert ref["grad_h"].shape == ((S // 2) if sp else S, B, H)
            torch.testing.assert_close(ours["grad_h"], ref["grad_h"], rtol=1e-5, atol=1e-7, msg=msg)
            if kind == "frozen":
                assert ours["grad_w"] is None and ref["grad_w"] is None
            else:
                assert ref["grad_w"].shape == (V // 2, H) and ref["grad_w"].abs().sum() > 0
                torch.testing.assert_close(ours["grad_w"], ref["grad_w"], rtol=1e-5, atol=1e-7, msg=msg)
        if smoothing == 0:  # the loss is the same on both ranks; smoothed, each rank's partition term
            assert torch.equal(results[0][case]["ours"]["loss"], results[1][case]["ours"]["loss"])
        else:
            assert not torch.allclose(results[0][case]["megatron"]["loss"], results[1][case]["megatron"]["loss"])
