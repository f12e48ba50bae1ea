"""Test-only: run a function the way one rank of a parallel job would, as far as Megatron's RNG
goes: under the CUDA-as-CPU mode (whose "CUDA" generator is the CPU one), Megatron's tracker
seeded by ``model_parallel_cuda_manual_seed(seed, **ranks)``."""

import torch
from tests.support.cuda_as_cpu import cuda_as_cpu


def run_as_rank(fn, seed: int = 1234, **ranks):
    """``(fn(), default_stream_untouched)`` with Megatron's RNG seeded as the rank ``ranks``
    (``tp_rank=``, ``ep_rank=``, ...) would be; the flag says whether ``fn`` left the default
    ("CUDA") generator's state as it found it (work forked off Megatron's tracker does)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with cuda_as_cpu():
        model_parallel_cuda_manual_seed(seed, **ranks)
        before = torch.cuda.get_rng_state()
        out = fn()
        return out, torch.equal(before, torch.cuda.get_rng_state())
