"""Checkpoints through Megatron's distributed checkpointing (torch_dist): atomic publish, exact
resume (model, optimizer, LR scheduler, counters, data position, RNG), safe loading.

``manager.py`` (save, publish, rotate, load), ``parts.py`` (the one protocol every saved part
follows), ``training.py`` (the model / optimizer / scheduler parts), ``train_state.py``
(``train_state.json``: format, JSON checks, fingerprint), ``files.py`` (the directory's layout,
atomic writes, manifest, listing), ``safety.py`` / ``storage.py`` / ``pickle_scan.py`` (safe
loading), ``rng.py``, ``optim.py``."""

from megatron_fastpath.checkpoint.config import CheckpointConfig
from megatron_fastpath.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointDirError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
)
from megatron_fastpath.checkpoint.manager import CheckpointManager, ResumeState, SaveResult
from megatron_fastpath.checkpoint.optim import load_optimizer_state, optimizer_hyperparams, optimizer_sharded_state
from megatron_fastpath.checkpoint.safety import UnsafeCheckpointError, check_safe_to_load
from megatron_fastpath.checkpoint.parts import SHARDED, CheckpointPart
from megatron_fastpath.checkpoint.train_state import config_fingerprint
from megatron_fastpath.checkpoint.training import is_adapter_key, training_parts

__all__ = [
    "CheckpointConfig", "CheckpointManager", "CheckpointError", "CheckpointCorruptError",
    "CheckpointMismatchError", "CheckpointDirError", "CheckpointFormatError", "ResumeState", "SaveResult", "config_fingerprint",
    "optimizer_sharded_state", "load_optimizer_state", "optimizer_hyperparams",
    "UnsafeCheckpointError", "check_safe_to_load", "training_parts", "is_adapter_key", "CheckpointPart", "SHARDED",
]
