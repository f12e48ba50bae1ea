"""Checkpoint settings (the ``checkpoint`` config group)."""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["CheckpointConfig"]


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """dir: checkpoint directory (None: checkpointing off). A run whose ``dir`` already holds a
        complete checkpoint resumes from it.
    interval: save every ``interval`` steps (0: only at the end / on stop or preemption).
    keep: how many complete checkpoints to keep (oldest removed after a new one is published).
    adapters_only: LoRA runs save the adapters and their optimizer state only; the base comes
        from its source (``base_dir``, or the seeded initialisation when None).
    base_dir: a Megatron distributed checkpoint whose base weights (every non-adapter tensor)
        are loaded before training.
    fallback_to_previous: when the latest checkpoint is unreadable, load the previous one.
    async_save: write tensors in a background process (Megatron's async save); the step is
        blocked only while tensors are staged.
    verify: record each file's size and CRC32 at save and check them before loading.
    keep_best: also keep the checkpoint with the lowest held-out loss among those saved right
        after an evaluation (the step's ``evals`` entry in its run history); ``dir/best`` names
        it. Needs held-out evaluation (refused at parse without it).
    """

    dir: Optional[str] = None
    interval: int = 0
    keep: int = 2
    adapters_only: bool = False
    base_dir: Optional[str] = None
    fallback_to_previous: bool = False
    async_save: bool = True
    verify: bool = True
    keep_best: bool = False

    def __post_init__(self):
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval must be >= 0 (0: save at the end only); got {self.interval}")
        if self.keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1; got {self.keep}")

    @property
    def enabled(self) -> bool:
        return self.dir is not None
