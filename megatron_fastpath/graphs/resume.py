"""Resuming with per-layer CUDA graphs and FP8 delayed scaling: capture before the first step.

Megatron records per-layer graphs during a run's first schedule, which runs eagerly, and captures
them at its end (megatron-core 0.16.1 pipeline_parallel/schedules.py:698, 1940, 2329). An eager
step and a replayed one update Transformer Engine's delayed-scaling state on different
schedules: in a replay Megatron reduces and updates the backward amaxes after every layer's
backward graph (transformer/cuda_graphs.py:648-652), eagerly TE does it once, in the first FP8
module's backward (TE 2.10 pytorch/module/linear.py:969). A straight run's first step is eager
and every later one replays; a resumed run's first step would be eager again, so it would end
with other amax histories (and, with LoRA, other backward scales and adapters) than the straight
run. Other runs do not differ between the two (the feature matrix resumes them bit for bit).

So a resumed run with both records and captures its graphs on a forward and backward of its
first batch whose effects are undone, and its first step replays as the straight run's does.
Undone: every model buffer (the routers' expert bias and token counts), every TE module's
delayed-scaling state (scales, amax histories), every random-number generator (restored in place
into the graph-safe tracker's generators the captures registered), the gradients (dropped).
Parameters and the optimizer are not touched (no optimizer step); the data position is not
either (the batch is the first step's, read again by it).
"""

from __future__ import annotations

__all__ = ["capture_needed_on_resume", "capture_before_resumed_step"]


def capture_needed_on_resume(cfg) -> bool:
    """Per-layer graphs captured (CUDA, scope ``layers``) with FP8 delayed scaling."""
    return bool(cfg.plan.capture and not cfg.plan.full_iteration
                and cfg.fp8 is not None and cfg.fp8.recipe == "delayed")


def capture_before_resumed_step(job, batch) -> bool:
    """Record and capture ``job``'s per-layer graphs on ``batch`` (the resumed run's first
    step's), leaving the run's state as it was (see the module docstring). Returns whether it
    ran (False: ``capture_needed_on_resume`` says no, or the step path has no schedule to
    record with)."""
    record = getattr(job.step, "record_graphs", None)
    if not capture_needed_on_resume(job.cfg) or record is None:
        return False
    import torch
    from megatron.core.fp8_utils import get_fp8_recipe

    from megatron_fastpath.checkpoint.rng import capture_rng, restore_rng
    from megatron_fastpath.fp8 import collect_fp8_state, restore_fp8_state

    buffers = {name: b.detach().clone() for name, b in job.model.named_buffers()}
    fp8 = collect_fp8_state(job.model)
    rng = capture_rng()
    if job.offload is not None:
        job.offload.begin_step()
    try:
        record(batch.microbatches, batch.global_loss_tokens)
    finally:
        if job.offload is not None:
            job.offload.end_step()
    with torch.no_grad():
        for name, b in job.model.named_buffers():
            b.copy_(buffers[name])
    if fp8:
        restore_fp8_state(job.model, fp8, get_fp8_recipe(job.tcfg))
    restore_rng(rng)
    return True
