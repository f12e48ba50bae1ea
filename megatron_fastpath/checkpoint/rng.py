"""Every random-number generator a training step may draw from, as JSON (no pickle).

python ``random``, numpy's global generator, torch's CPU generator, every CUDA device's
generator and Megatron's CUDA RNG tracker (dropout inside tensor-parallel regions, LoRA dropout).
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def _state_tensor(state) -> torch.Tensor:
    """A tracker state as bytes: graph-safe trackers (Megatron's with use_cudagraphable_rng,
    Transformer Engine's) hold ``torch.Generator`` objects, the others byte tensors."""
    return state.get_state() if isinstance(state, torch.Generator) else state


def capture_rng() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tracker = get_cuda_rng_tracker().get_states()
    return {
        "python": [version, list(state), gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch_cpu": _b64(torch.get_rng_state()),
        "torch_cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "megatron_tracker": {name: _b64(_state_tensor(s)) for name, s in tracker.items()},
    }


def restore_rng(saved: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(saved["torch_cpu"]))
    if saved["torch_cuda"]:
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(saved["torch_cuda"]):
            raise ValueError(
                f"the checkpoint holds {len(saved['torch_cuda'])} CUDA RNG states but this process "
                f"sees {torch.cuda.device_count() if torch.cuda.is_available() else 0} devices"
            )
        torch.cuda.set_rng_state_all([_unb64(s) for s in saved["torch_cuda"]])
    if saved["megatron_tracker"]:
        tracker = get_cuda_rng_tracker()
        current = tracker.get_states()
        states = {}
        for name, value in saved["megatron_tracker"].items():
            state = _unb64(value)
            if isinstance(current.get(name), torch.Generator):
                # in place: a captured CUDA graph registered this Generator object, and the
                # tracker's fork() hands its states to graphsafe_set_state, which takes
                # Generators only (megatron/core/tensor_parallel/random.py _set_cuda_rng_state)
                current[name].set_state(state)
                state = current[name]
            states[name] = state
        tracker.set_states(states)
