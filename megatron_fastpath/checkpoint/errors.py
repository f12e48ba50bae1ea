"""The errors a checkpoint can raise, in one place (every checkpoint module raises them; none of
them imports another to do so)."""

__all__ = ["CheckpointCorruptError", "CheckpointDirError", "CheckpointError", "CheckpointFormatError",
           "CheckpointMismatchError", "UnsafeCheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used."""


class CheckpointCorruptError(CheckpointError):
    """A file of the checkpoint is missing, truncated or corrupted (the message names it)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was written by a different model / configuration."""


class CheckpointFormatError(CheckpointError):
    """The checkpoint is in a format this version cannot read (written by a newer one, or not by
    megatron_fastpath)."""


class CheckpointDirError(CheckpointError):
    """``checkpoint.dir`` cannot take this run's checkpoints (not a writable directory, too little
    free space, or another job writes there)."""


class UnsafeCheckpointError(RuntimeError):
    """The checkpoint would need arbitrary unpickling (or an unsafe loader) to be read."""
