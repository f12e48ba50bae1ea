"""compat.dist_ckpt.dist_checkpointing_on_cpu: needed (Megatron's save fails on a CPU without it), narrow
(only the two torch.cuda entry points, only while CUDA is unavailable, only inside the block),
and version-gated (another megatron-core minor line is refused loudly)."""

import contextlib
import os
from unittest import mock

import pytest
import torch
from packaging.version import Version

from megatron_fastpath import compat
from megatron_fastpath.compat import dist_ckpt as dist_ckpt_compat


def _mcore_dir():
    import megatron.core

    return os.path.dirname(megatron.core.__file__)


def test_patched_sites_still_exist_in_installed_megatron():
    for rel, text in dist_ckpt_compat.DIST_CKPT_CPU_SITES:
        with open(os.path.join(_mcore_dir(), rel)) as f:
            assert text in f.read(), f"{rel} no longer contains {text!r}: re-check the shim"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure it fixes exists only without CUDA")
def test_megatron_save_needs_it_on_cpu_and_works_with_it(mcore_parallel, tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3), replica_id=0)}
    (tmp_path / "a").mkdir()
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        dist_checkpointing.save(sd, str(tmp_path / "a"))
    (tmp_path / "b").mkdir()
    with dist_ckpt_compat.dist_checkpointing_on_cpu():
        dist_checkpointing.save(sd, str(tmp_path / "b"))
        out = dist_checkpointing.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), replica_id=0)},
            str(tmp_path / "b"),
        )
    assert torch.equal(out["w"], torch.arange(6.0).reshape(2, 3))


def test_patch_is_scoped_to_the_block():
    sync, current = torch.cuda.synchronize, torch.cuda.current_device
    with mock.patch.object(torch.cuda, "is_available", lambda: False):
        with dist_ckpt_compat.dist_checkpointing_on_cpu():
            assert torch.cuda.current_device() == torch.device("cpu")
            torch.cuda.synchronize()  # no-op, no error
    assert torch.cuda.synchronize is sync and torch.cuda.current_device is current


def test_inactive_when_cuda_is_available():
    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        ctx = dist_ckpt_compat.dist_checkpointing_on_cpu()
    assert isinstance(ctx, contextlib.nullcontext)


def test_other_megatron_line_is_refused():
    with mock.patch.object(torch.cuda, "is_available", lambda: False), \
            mock.patch.object(compat, "MCORE_VERSION", Version("0.17.0")):
        with pytest.raises(ImportError, match="0.16.x.*0.17.0"):
            dist_ckpt_compat.dist_checkpointing_on_cpu()
