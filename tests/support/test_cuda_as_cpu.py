"""The test-only CUDA-as-CPU mode: what it rewrites, that the Megatron sites it was written
for are still where it says, and that the package never imports it."""

import os
import subprocess
import sys

import pytest
import torch

from tests.support.cuda_as_cpu import MEGATRON_SITES, cuda_as_cpu, moved_megatron_sites


def test_device_arguments_stay_on_cpu():
    with cuda_as_cpu():
        x = torch.zeros(3, device="cuda")
        assert x.device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.cuda().device.type == "cpu"
        assert x.to("cuda").device.type == "cpu"
        assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.tensor([1], device=torch.device("cuda:0")).device.type == "cpu"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    # outside the block nothing is rewritten
    assert torch.zeros(1).type() == "torch.FloatTensor"
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")


def test_covered_sites_still_exist():
    """Each Megatron line the mode was written for says what it says in the installed release
    (0.16.1 or 0.19.2, each site citing both lines)."""
    moved = moved_megatron_sites(MEGATRON_SITES)
    assert not moved, "megatron-core moved the CUDA sites this mode covers:\n" + "\n".join(moved)


@pytest.mark.integration  # a child process imports the package
def test_package_never_imports_the_mode():
    code = (
        "import sys, megatron_fastpath, megatron_fastpath.train, megatron_fastpath.compat\n"
        "bad = [m for m in sys.modules if 'cuda_as_cpu' in m or 'fake_cuda_graph' in m]\n"
        "assert not bad, bad\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    for root, _, files in os.walk(os.path.join(repo, "megatron_fastpath")):
        for f in files:
            if f.endswith(".py"):
                src = open(os.path.join(root, f), encoding="utf-8").read()
                assert "cuda_as_cpu" not in src and "fake_cuda_graph" not in src, f


def test_packed_cache_on_cuda_device_runs_with_pinned_staging():
    """The cache pins its host staging record when its device is CUDA; the mode keeps that on
    plain host memory, so the main job's cache builds and loads batches here."""
    from tests.support.cuda_as_cpu import cuda_as_cpu

    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    with cuda_as_cpu():
        cache = PackedSeqCache(PackedSeqConfig(max_tokens=16, max_seqs=4, num_slots=2),
                               device=torch.device("cuda"))
        cache.register("sdpa_mask")
        with cache.batch([5, 3]) as pb:
            assert pb.packed_seq_params.cu_seqlens_q.tolist()[:4] == [0, 5, 8, 16]
        assert torch.ones(2).pin_memory().device.type == "cpu"


def test_explicit_device_waits_counted():
    from tests.support.cuda_as_cpu import CALLS

    before = CALLS["torch.cuda.synchronize"]
    with cuda_as_cpu():
        torch.cuda.synchronize()
        torch.cuda.synchronize(0)
    assert CALLS["torch.cuda.synchronize"] - before == 2


def test_accelerator_stream_calls_are_the_stand_in_gpus():
    """torch 2.13's optimizers ask ``torch.accelerator.current_stream().is_capturing()`` on a CUDA
    build (optim/optimizer.py:448-466): the stand-in GPU answers, with the real argument checks."""
    with cuda_as_cpu():
        assert torch.accelerator.current_device_index() == 0
        assert torch.accelerator.current_stream() is torch.cuda.current_stream()
        assert torch.accelerator.current_stream(0) is torch.cuda.current_stream()
        assert torch.accelerator.current_stream().is_capturing() is False
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            assert torch.accelerator.current_stream("cuda") is s
        with pytest.raises(ValueError, match="^cpu doesn't match the current accelerator cuda.$"):
            torch.accelerator.current_stream("cpu")
        with pytest.raises(RuntimeError, match=r"^Device index value 1 is out of index range \[0, 1\)$"):
            torch.accelerator.current_stream(1)
        torch.accelerator.synchronize()
        p = torch.nn.Parameter(torch.ones(2, device="cuda"))
        p.grad = torch.ones(2, device="cuda")
        torch.optim.AdamW([p], lr=0.1).step()  # the capture health check runs on a CUDA build
    ref = torch.nn.Parameter(torch.ones(2))  # the same step on the CPU, outside the block
    ref.grad = torch.ones(2)
    torch.optim.AdamW([ref], lr=0.1).step()
    assert torch.equal(p.detach(), ref.detach())
