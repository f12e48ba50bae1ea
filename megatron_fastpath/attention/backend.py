"""The attention backends by name: which exist (:data:`BACKENDS`), how ``auto`` chooses one for
a device, dtype and context-parallel size, and the checks a chosen one passes (its package
installed, a dtype its kernels take) before any device work. The result is a
:class:`ResolvedBackend`, resolved once and carried to the layer spec and every layer; the
kernels behind the names are :data:`megatron_fastpath.attention.kernels.ATTENTION_KERNELS`.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fastpath._optional import require

__all__ = [
    "ALTERNATIVES",
    "BACKENDS",
    "ResolvedBackend",
    "backend_of",
    "check_backend",
    "check_backend_dtype",
    "choose_backend",
    "resolve_backend",
]

BACKENDS = ("sdpa", "flex", "flash", "te")

# What an error about a missing backend package proposes instead.
ALTERNATIVES = {
    "flash": "backend='sdpa' (CPU and GPU) or backend='flex'",
    "te": "backend='flash', 'sdpa' or 'flex'",
}


class ResolvedBackend(str):
    """An attention backend name as :func:`resolve_backend` returns it: checked (its package,
    the dtype) and ``auto`` resolved for the device, dtype and context-parallel size it was
    given. The layer spec and :class:`PackedCoreAttention` take one as it is -- the main job
    resolves its backend once, at parse, and carries it in ``JobConfig.attention_backend`` --
    and resolve a plain name themselves (the spec once, for all its layers)."""

    __slots__ = ()


def backend_of(backend: str, device: torch.device, max_tokens: int, sdpa_limit: Optional[int],
               dtype: Optional[torch.dtype] = None, context_parallel_size: int = 1) -> str:
    """``backend`` when it is a :class:`ResolvedBackend`, else :func:`resolve_backend` of it."""
    if isinstance(backend, ResolvedBackend):
        return backend
    return resolve_backend(backend, device, max_tokens, sdpa_limit, dtype=dtype,
                           context_parallel_size=context_parallel_size)


def resolve_backend(backend: str, device: torch.device, max_tokens: int, sdpa_limit: Optional[int],
                    dtype: Optional[torch.dtype] = None, context_parallel_size: int = 1) -> str:
    """Validate ``backend`` (raising before any device work when its package is missing, or
    when ``dtype`` is one its kernels lack) and resolve ``"auto"``: te > flash on CUDA when
    installed and the dtype is one their kernels take (bf16 / fp16), else sdpa -- flex only on
    CUDA when ``max_tokens`` is above ``sdpa_limit``: ``auto`` picks something that runs (on a
    GPU machine with TE installed, fp32 resolves to sdpa).

    ``sdpa_limit``: the most tokens the sdpa backend serves in its layout,
    :func:`megatron_fastpath.packed_seq.config.sdpa_max_tokens` (the one home of that rule):
    the [T, T] mask's limit when sdpa attends through the mask, None when its layout is or can
    be the padded view, which has no mask (then the mask's limit never pushes auto off sdpa).

    With ``context_parallel_size > 1`` ``auto`` picks only among the backends that run context
    parallelism (:data:`megatron_fastpath.rules.CP_ATTENTION_BACKENDS`): te, else sdpa -- never
    flash or flex, which the rules would refuse at CP > 1."""
    resolved = choose_backend(backend, device, max_tokens, sdpa_limit, dtype=dtype,
                              context_parallel_size=context_parallel_size)
    return check_backend(resolved, device, dtype, chosen_by_auto=backend == "auto")


def choose_backend(backend: str, device: torch.device, max_tokens: int, sdpa_limit: Optional[int],
                   dtype: Optional[torch.dtype] = None, context_parallel_size: int = 1) -> str:
    """:func:`resolve_backend`'s choice alone (``backend`` itself unless ``auto``), unchecked:
    raises only for an unknown name (the main job hands it to the rules before
    :func:`check_backend` asks for its package)."""
    if backend == "auto":
        from megatron_fastpath._optional import have
        from megatron_fastpath.rules import CP_ATTENTION_BACKENDS

        half = dtype is None or dtype in (torch.bfloat16, torch.float16)
        usable = BACKENDS if context_parallel_size <= 1 else CP_ATTENTION_BACKENDS
        if device.type == "cuda" and half and "te" in usable and have("transformer_engine.pytorch"):
            resolved = "te"
        elif device.type == "cuda" and half and "flash" in usable and have("flash_attn"):
            resolved = "flash"
        elif (device.type == "cuda" and "flex" in usable and sdpa_limit is not None
              and max_tokens > sdpa_limit):
            resolved = "flex"  # sdpa's layout is the [T, T] mask, refused above its limit
        else:
            # on CPU above the mask limit (sdpa_layout=mask) the cache refuses the mask, naming
            # the alternatives (the padded view, flex / flash / te, a higher limit)
            resolved = "sdpa"
    elif backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS} or 'auto'")
    else:
        resolved = backend
    return resolved


def check_backend(backend: str, device: torch.device, dtype: Optional[torch.dtype],
                  chosen_by_auto: bool = False) -> ResolvedBackend:
    """``backend`` (a :func:`choose_backend` choice) checked -- its package installed (an
    explicit flash / te), the dtype one its kernels take -- as a :class:`ResolvedBackend`."""
    if not chosen_by_auto and backend == "flash":
        require("flash_attn", "the 'flash' attention backend", ALTERNATIVES["flash"])
    if not chosen_by_auto and backend == "te":
        require("transformer_engine.pytorch", "the 'te' attention backend", ALTERNATIVES["te"])
    check_backend_dtype(backend, device, dtype, chosen_by_auto=chosen_by_auto)
    return ResolvedBackend(backend)


def check_backend_dtype(backend: str, device: torch.device, dtype: Optional[torch.dtype],
                        chosen_by_auto: bool = False) -> None:
    """te / flash on CUDA need fp16 or bf16: TE has no fp32 THD backend and flash-attn takes
    half precision only ("No dot product attention backend" at the first forward)."""
    if dtype is None or device.type != "cuda" or backend not in ("te", "flash"):
        return
    if dtype not in (torch.bfloat16, torch.float16):
        how = " (chosen by attention_backend=auto on CUDA)" if chosen_by_auto else ""
        raise ValueError(
            f"the '{backend}' attention backend{how} runs in bf16 / fp16 only, but the model "
            f"dtype is {dtype}: set the model dtype to bfloat16 (dtype: bfloat16, i.e. "
            "TransformerConfig params_dtype=torch.bfloat16 with bf16=True), or keep float32 "
            "with attention_backend=sdpa"
        )
