"""Checkpoint settings (the ``checkpoint`` config group)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_fastpath.compat.dist_optim_ckpt import DEFAULT_OPTIMIZER_FORMAT
from megatron_fastpath.settings import setting

__all__ = ["CheckpointConfig"]


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The ``checkpoint`` group. A run whose ``dir`` already holds a complete checkpoint resumes
    from it. ``keep_best`` keeps the checkpoint with the lowest held-out loss among those saved
    right after an evaluation (the step's ``evals`` entry in its run history); ``dir/best``
    names it."""

    dir: Optional[str] = setting(None, "checkpoint directory (null: checkpointing off); a complete "
                                 "checkpoint there is resumed from")
    interval: int = setting(0, "save every N steps (0: at the end, at stop_at_step and on SIGTERM / SIGUSR1)")
    keep: int = setting(2, "complete checkpoints kept (the oldest removed after a new one is published)")
    adapters_only: bool = setting(
        False, "LoRA: save the adapters and their optimizer state only (the base from base_dir, "
        "or the seeded initialisation)")
    base_dir: Optional[str] = setting(
        None, "a Megatron distributed checkpoint whose base (non-adapter) weights are loaded "
        "before training")
    fallback_to_previous: bool = setting(False, "when the latest checkpoint is unreadable, load the previous one")
    async_save: bool = setting(
        True, "write tensors in a background process (Megatron's async save); the step blocks "
        "only while they are staged")
    verify: bool = setting(True, "record each file's size and CRC32 at save, checked before loading")
    optimizer_format: str = setting(
        DEFAULT_OPTIMIZER_FORMAT, "Megatron's DistributedOptimizer: the format of its sharded state "
        "(dp_reshardable: each rank writes its own bucket shards, resumable at another DP size; "
        "fully_reshardable: gathered into one tensor per parameter, resumable at another DP / TP "
        "/ PP size, the whole state in host memory on every rank); a resume reads the format it "
        "was saved in")
    keep_best: bool = setting(
        False, "also keep the checkpoint with the lowest held-out loss (dir/best); needs held-out "
        "evaluation")

    def __post_init__(self):
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval must be >= 0 (0: save at the end only); got {self.interval}")
        if self.keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1; got {self.keep}")
        from megatron_fastpath.compat.dist_optim_ckpt import check_optimizer_format

        check_optimizer_format(self.optimizer_format)

    @property
    def enabled(self) -> bool:
        return self.dir is not None
