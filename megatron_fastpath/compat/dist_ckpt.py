"""dist_checkpointing on a CPU (checkpoint/manager.py, train/checkpointing.py)."""

from __future__ import annotations


from megatron_fastpath.compat import _require_checked_mcore


# ---------------------------------------------------------------------------------------------
# dist_checkpointing on a CPU
#
# megatron-core 0.16.x's torch_dist save path is written for GPUs: after staging tensors to the
# host it calls ``torch.cuda.synchronize()`` (strategies/filesystem_async.py:230,
# ``FileSystemWriterAsync.preload_tensors``) and it broadcasts its failure flag in a tensor made
# on ``torch.cuda.current_device()`` (strategies/state_dict_saver.py:252,
# ``save_state_dict_async_finalize``). On a machine without CUDA both raise "Torch not compiled
# with CUDA enabled", so the CPU main job could not checkpoint at all. While CUDA is unavailable,
# and only inside the block, ``dist_checkpointing_on_cpu`` makes the synchronize a no-op (the
# staged copies are plain CPU copies, already complete) and points ``current_device`` at the CPU
# (the flag is broadcast over gloo). With CUDA present it does nothing.
# ---------------------------------------------------------------------------------------------

DIST_CKPT_CPU_SITES = (
    ("dist_checkpointing/strategies/filesystem_async.py", "torch.cuda.synchronize()"),
    ("dist_checkpointing/strategies/state_dict_saver.py", "device=torch.cuda.current_device()"),
)


def dist_checkpointing_on_cpu():
    """Context manager around ``dist_checkpointing.save`` / ``load`` (see the section above)."""
    import contextlib
    from unittest import mock

    import torch

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    _require_checked_mcore(
        "dist_checkpointing_on_cpu",
        f"the torch.cuda calls of {', '.join(f for f, _ in DIST_CKPT_CPU_SITES)}")
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda device=None: None))
    stack.enter_context(
        mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu"))
    )
    return stack
