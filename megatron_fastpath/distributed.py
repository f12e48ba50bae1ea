"""torch.distributed + Megatron parallel-state setup that works on CPU (gloo) and GPU (NCCL)."""

from __future__ import annotations

import os
import socket
from typing import Optional

import torch

__all__ = ["init_distributed", "default_device", "destroy_distributed"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device() -> torch.device:
    """cuda:<local rank> when a GPU is present, else cpu. The local rank comes from torchrun
    (LOCAL_RANK) or Slurm (SLURM_LOCALID) -- known before the process group exists -- modulo
    the visible devices (Slurm may give each task a single GPU)."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(
    backend: Optional[str] = None,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    timeout_s: Optional[float] = None,
) -> None:
    """Initialise the default process group from torchrun/Slurm env (or a 1-process group) and
    Megatron's parallel state. Idempotent for the same sizes. ``timeout_s``: collective and
    rendezvous timeout (torch's default when None)."""
    from megatron.core import parallel_state

    device = default_device() if backend != "gloo" else torch.device("cpu")
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
            # srun without torchrun: map Slurm's variables onto torch.distributed's.
            os.environ["RANK"] = os.environ["SLURM_PROCID"]
            os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
            os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        multi = os.environ["WORLD_SIZE"] != "1"
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if multi and var not in os.environ:
                raise RuntimeError(
                    f"{var} must be set for a multi-process run (torchrun sets it; under srun use "
                    "slurm/train.sbatch, which derives it from the allocation)"
                )
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kwargs = {}
        if timeout_s is not None:
            import datetime

            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        torch.distributed.init_process_group(backend=backend, **kwargs)
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() == tensor_model_parallel_size
            and parallel_state.get_pipeline_model_parallel_world_size()
            == pipeline_model_parallel_size
            and parallel_state.get_expert_model_parallel_world_size()
            == expert_model_parallel_size
            and parallel_state.get_context_parallel_world_size() == context_parallel_size
        ):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        context_parallel_size=context_parallel_size,
    )


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
