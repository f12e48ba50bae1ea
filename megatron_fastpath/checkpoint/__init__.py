"""Checkpoints through Megatron's distributed checkpointing (torch_dist): atomic publish, exact
resume (model, optimizer, LR scheduler, counters, data position, RNG), safe loading."""

from megatron_fastpath.checkpoint.config import CheckpointConfig
from megatron_fastpath.checkpoint.manager import (
    CheckpointCorruptError,
    CheckpointDirError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointManager,
    CheckpointMismatchError,
    ResumeState,
    SaveResult,
    config_fingerprint,
)
from megatron_fastpath.checkpoint.optim import load_optimizer_state, optimizer_hyperparams, optimizer_sharded_state
from megatron_fastpath.checkpoint.safety import UnsafeCheckpointError, check_safe_to_load
from megatron_fastpath.checkpoint.training import is_adapter_key, training_state

__all__ = [
    "CheckpointConfig", "CheckpointManager", "CheckpointError", "CheckpointCorruptError",
    "CheckpointMismatchError", "CheckpointDirError", "CheckpointFormatError", "ResumeState", "SaveResult", "config_fingerprint",
    "optimizer_sharded_state", "load_optimizer_state", "optimizer_hyperparams",
    "UnsafeCheckpointError", "check_safe_to_load", "training_state", "is_adapter_key",
]
