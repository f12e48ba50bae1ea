"""Experts that consume device group sizes: one grouped GEMM per projection, no host sync.

:class:`GroupedSwiGLUExperts` runs all local experts with ``torch._grouped_mm(x, w, offs=)``
(offsets stay on the device; CPU fp32/bf16 and Hopper bf16 are supported by torch >= 2.8).
:class:`TEGroupedSwiGLUExperts` uses Transformer Engine's ``GroupedLinear`` (needed for FP8
recipes); TE takes host ``m_splits``, so it costs exactly ONE counted host sync per forward
(``HOST_SYNCS_PER_FORWARD``), reused by its backward.

Both follow Megatron's expert interface: ``forward(permuted_x [R, H], tokens_per_expert [E_l],
permuted_probs [R] or None) -> (y [R, H], None)``. When ``permuted_probs`` is given (Megatron's
convention, ``MoEDispatchConfig.probs_in_combine=False``) it scales the activation before the
second projection like Megatron's ``GroupedMLP``; with our dispatcher's default the probs are
applied in the combine instead and ``None`` is passed.

Shape letters: R rows of the expert buffer (grouped by expert), H hidden size, F expert FFN
size (F1 = 2F for SwiGLU's gate | up), E (E_l) local experts.
"""

from __future__ import annotations

import contextlib
import functools

from typing import Optional

import torch

from megatron.core.transformer.module import MegatronModule

from megatron_fastpath._optional import require
from megatron_fastpath.moe.config import EXPERT_BACKENDS

__all__ = [
    "GroupedSwiGLUExperts",
    "TEGroupedSwiGLUExperts",
    "expert_class",
    "grouped_mlp_reference",
]


def _ep_rank(pg_collection) -> int:
    group = getattr(pg_collection, "ep", None) if pg_collection is not None else None
    if group is not None:
        return torch.distributed.get_rank(group)
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()


def _check_expert_config(config, num_local_experts: int) -> None:
    if num_local_experts < 1:
        raise ValueError(f"num_local_experts must be >= 1, got {num_local_experts}")
    if config.add_bias_linear:
        raise ValueError("fastpath grouped experts have no bias: set add_bias_linear=False")
    if getattr(config, "expert_tensor_parallel_size", 1) not in (None, 1):
        raise ValueError("fastpath grouped experts do not support expert_tensor_parallel_size > 1")


def _mark_expert_params(module, config) -> None:
    """Mark expert parameters the way Megatron's ``GroupedMLP`` / ``TEGroupedLinear`` do
    (``allreduce = not expert_parallel``): Megatron's DDP reads the flag
    (distributed_data_parallel.py, ``getattr(param, 'allreduce', True)``) and reduces the
    ``False`` ones over the expert-data-parallel group instead of the dense one. Unmarked
    expert weights at EP > 1 would be summed with other ranks' *different* experts."""
    expert_parallel = config.expert_model_parallel_size > 1
    for p in module.parameters():
        setattr(p, "allreduce", not expert_parallel)


def _expert_rng():
    """Megatron's expert-parallel RNG stream (``get_cuda_rng_tracker().fork(
    get_expert_parallel_rng_tracker_name())``)."""
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_expert_parallel_rng_tracker_name,
    )

    return get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())


def _te_expert_rng_kwargs() -> dict:
    """What Megatron's TEGroupedLinear hands TE's GroupedLinear for expert weights: the
    tracker and the expert-parallel stream's name (extensions/transformer_engine.py)."""
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_expert_parallel_rng_tracker_name,
    )

    initialized = get_cuda_rng_tracker().is_initialized()
    return dict(get_rng_state_tracker=get_cuda_rng_tracker if initialized else None,
                rng_tracker_name=get_expert_parallel_rng_tracker_name())


def grouped_mm_sync_free_refusal(dtype: torch.dtype, capability: tuple) -> Optional[str]:
    """Why ``torch._grouped_mm`` would read the host inside a captured MoE layer, or None.

    It is sync-free only for bf16 on sm90 / sm100; other dtypes and architectures take its
    fallback, which loops over the groups reading ``offs`` to the host (torch 2.13
    aten/src/ATen/native/cuda/GroupedBlas.cpp, ``_grouped_mm_fallback``)."""
    major, minor = capability
    if dtype == torch.bfloat16 and major in (9, 10):
        return None
    name = str(dtype).replace("torch.", "")
    return (f"CUDA graphs with the grouped_mm MoE experts need torch._grouped_mm's sync-free "
            f"path, which is bf16 on sm90 / sm100 only; this run is {name} on sm{major}{minor}, "
            "where it reads the expert offsets to the host inside the captured layer. Use bf16 "
            "on an H100 / B200-class GPU, or turn CUDA graphs off")


def grouped_mm_leaks_empty_group_grads(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` on ``device`` needs empty groups' weight gradients masked
    (compute capability 10.x)."""
    return device.type == "cuda" and _capability_major(device.index) == 10


def mask_empty_group_grads(weights: tuple, group_sizes_E: torch.Tensor) -> tuple:
    """``weights`` ([E, ...] each, one group per leading index) as this forward's own views
    whose gradients are zeroed, on the device, for the groups of ``group_sizes_E`` that got no
    row (torch._grouped_mm on sm100 writes non-zero gradients there). The caller decides when
    (:func:`grouped_mm_leaks_empty_group_grads`, grad enabled)."""
    used = (group_sizes_E > 0).to(weights[0].dtype)
    out = []
    for w in weights:
        used_w = used.view(-1, *([1] * (w.dim() - 1)))
        w = w.view_as(w)  # this forward's own node to hook
        w.register_hook(lambda g, u=used_w: g * u)
        out.append(w)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _capability_major(index: Optional[int]) -> int:
    """A GPU's compute capability major (asked once per device: read in every forward)."""
    return torch.cuda.get_device_capability(index)[0]


def _activation(config, h_RF: torch.Tensor) -> torch.Tensor:
    if config.gated_linear_unit:
        gate, up = torch.chunk(h_RF, 2, dim=-1)
        return config.activation_func(gate) * up
    return config.activation_func(h_RF)


class GroupedSwiGLUExperts(MegatronModule):
    """All local experts as two grouped GEMMs on device offsets.

    Weights (torchtitan layout, one tensor per projection):
        weight1: [E_l, H, F * (2 if gated_linear_unit else 1)] (gate | up halves for SwiGLU)
        weight2: [E_l, F, H]
    with H = hidden_size, F = moe_ffn_hidden_size. ``torch._grouped_mm`` needs 16-byte aligned
    row strides: H and F must be multiples of 8 (bf16) / 4 (fp32); checked at construction.
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None):
        super().__init__(config=config)
        _check_expert_config(config, num_local_experts)
        self.num_local_experts = num_local_experts
        self.ep_rank = _ep_rank(pg_collection)
        H, F = config.hidden_size, config.moe_ffn_hidden_size
        F1 = 2 * F if config.gated_linear_unit else F
        dtype = config.params_dtype
        align = 16 // torch.empty((), dtype=dtype).element_size()
        for name, v in (("hidden_size", H), ("moe_ffn_hidden_size", F)):
            if v % align:
                raise ValueError(
                    f"torch._grouped_mm needs 16-byte aligned rows: {name}={v} must be a multiple "
                    f"of {align} for {dtype}"
                )
        device = None if config.use_cpu_initialization or not torch.cuda.is_available() else (
            torch.cuda.current_device()
        )
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, H, F1, dtype=dtype, device=device))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, F, H, dtype=dtype, device=device))
        _mark_expert_params(self, config)
        # torch._grouped_mm on sm100 (B200 / GB200) writes non-zero weight gradients for groups
        # that received no token (an open torch bug the GPU review found): those are masked to
        # zero on the device. Elsewhere the gradients are already zero and nothing is added.
        # None: decided in forward from the device the weights are on then (a model built
        # with use_cpu_initialization is moved to the GPU after construction).
        self.mask_empty_group_grads: Optional[bool] = None
        if config.perform_initialization:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        # Megatron's init functions act on a [out, in] matrix: initialise each expert's
        # transposed slice so the std matches Megatron's GroupedMLP.
        # With use_cpu_initialization (like Megatron's CPU init of sharded weights) every rank
        # draws the weights of ALL experts in global order and keeps its own: the model is the
        # same for every expert-parallel size, and RNG consumption does not depend on EP.
        first = self.ep_rank * self.num_local_experts
        experts = (
            range(self.config.num_moe_experts)
            if self.config.use_cpu_initialization
            else range(first, first + self.num_local_experts)
        )
        # On the device each rank draws only its own experts: from Megatron's expert-parallel
        # RNG stream (seeded per EP rank by model_parallel_cuda_manual_seed), as its
        # GroupedMLP / TEGroupedLinear do; from the default generator every EP rank would draw
        # the same numbers, i.e. the same experts.
        rng = contextlib.nullcontext() if self.config.use_cpu_initialization else _expert_rng()
        with torch.no_grad(), rng:
            for e in experts:
                w1 = torch.empty_like(self.weight1[0].t())
                self.config.init_method(w1)
                w2 = torch.empty_like(self.weight2[0].t())
                self.config.output_layer_init_method(w2)
                local = e - first
                if 0 <= local < self.num_local_experts:
                    self.weight1[local].copy_(w1.t())
                    self.weight2[local].copy_(w2.t())

    def forward(
        self,
        permuted_x_RH: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        permuted_probs_R: Optional[torch.Tensor] = None,
    ):
        """[R, H] grouped by expert (group sizes on device, summing to R) -> ([R, H], None)."""
        if permuted_x_RH.dtype != self.weight1.dtype:
            raise TypeError(
                f"expert input dtype {permuted_x_RH.dtype} != expert weight dtype "
                f"{self.weight1.dtype}; cast the hidden states or set params_dtype"
            )
        if tokens_per_expert_E.shape != (self.num_local_experts,):
            raise ValueError(
                f"tokens_per_expert has shape {tuple(tokens_per_expert_E.shape)}, expected "
                f"[{self.num_local_experts}] (one entry per local expert)"
            )
        offs_E = torch.cumsum(tokens_per_expert_E, 0, dtype=torch.int32)
        w1, w2 = self.weight1, self.weight2
        mask = self.mask_empty_group_grads
        if mask is None:
            mask = grouped_mm_leaks_empty_group_grads(w1.device)
        if mask and torch.is_grad_enabled():
            w1, w2 = mask_empty_group_grads((w1, w2), tokens_per_expert_E)
        h_RF = torch._grouped_mm(permuted_x_RH, w1, offs=offs_E)
        a_RF = _activation(self.config, h_RF)
        if permuted_probs_R is not None:
            a_RF = (a_RF * permuted_probs_R.unsqueeze(-1)).to(a_RF.dtype)
        y_RH = torch._grouped_mm(a_RF, w2, offs=offs_E)
        return y_RH, None

    def backward_dw(self):  # Megatron's delayed-wgrad hook: nothing is deferred here
        pass

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Distributed-checkpoint view: ``weight1`` / ``weight2`` are [E, ...] tensors whose
        expert axis is split over expert-parallel ranks (this rank holds experts
        ``ep_rank * E_l ..``), replicated over the expert-data-parallel group. Megatron's
        default would key each rank's local [E_l, ...] slice the same and keep only one rank's
        experts at EP > 1; with the expert axis global, a checkpoint loads at any EP size."""
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        ep_size = self.config.num_moe_experts // self.num_local_experts
        replica_id = (0, 0, parallel_state.get_expert_data_parallel_rank())
        axis = len(sharded_offsets)
        return {
            f"{prefix}{name}": ShardedTensor.from_rank_offsets(
                f"{prefix}{name}", getattr(self, name), *sharded_offsets,
                (axis, self.ep_rank, ep_size), replica_id=replica_id, prepend_axis_num=axis,
            )
            for name in ("weight1", "weight2")
        }


def grouped_mlp_reference(
    x_RH: torch.Tensor,
    group_sizes: list[int],
    weight1: torch.Tensor,
    weight2: torch.Tensor,
    config,
    probs_R: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-group Python loop with host group sizes: the plain reference used in tests."""
    outs, start = [], 0
    for e, n in enumerate(group_sizes):
        a = _activation(config, x_RH[start : start + n] @ weight1[e])
        if probs_R is not None:
            a = a * probs_R[start : start + n].unsqueeze(-1)
        outs.append(a @ weight2[e])
        start += n
    return torch.cat(outs, 0)


class TEGroupedSwiGLUExperts(MegatronModule):
    """Transformer Engine ``GroupedLinear`` experts (GPU only, FP8-capable).

    TE's ``GroupedLinear.forward(x, m_splits)`` takes a Python list of group sizes, so this
    backend reads ``tokens_per_expert`` to the host once per forward: exactly
    ``HOST_SYNCS_PER_FORWARD = 1`` counted sync per layer (the backward reuses the list). With
    FP8 every split must be aligned: the dispatcher pads the groups to Megatron's
    ``get_fp8_align_size`` (16 rows; 32 for mxfp8: ``moe.config``), and the rules refuse expert
    widths TE's FP8 GEMMs cannot take (``rules._fp8_gemm_shapes``). Weights are TE's per-expert
    ``weight{i}`` of shape [out, in].
    """

    HOST_SYNCS_PER_FORWARD = 1

    def __init__(self, num_local_experts: int, config, pg_collection=None):
        super().__init__(config=config)
        _check_expert_config(config, num_local_experts)
        te = require(
            "transformer_engine.pytorch",
            "the te_grouped_linear MoE expert backend",
            alternatives="expert_backend='grouped_mm' (torch._grouped_mm)",
        )
        self.num_local_experts = num_local_experts
        H, F = config.hidden_size, config.moe_ffn_hidden_size
        F1 = 2 * F if config.gated_linear_unit else F
        self.linear_fc1 = te.GroupedLinear(
            num_local_experts, H, F1, bias=False, params_dtype=config.params_dtype,
            device="cuda", init_method=config.init_method, **_te_expert_rng_kwargs(),
        )
        self.linear_fc2 = te.GroupedLinear(
            num_local_experts, F, H, bias=False, params_dtype=config.params_dtype,
            device="cuda", init_method=config.output_layer_init_method, **_te_expert_rng_kwargs(),
        )
        _mark_expert_params(self, config)
        self.host_syncs = 0  # running count of the m_splits reads, for reporting

    def forward(self, permuted_x_RH, tokens_per_expert_E, permuted_probs_R=None):
        # THE one host sync of this backend: TE needs host m_splits.
        m_splits = tokens_per_expert_E.tolist()
        self.host_syncs += 1
        h_RF = self.linear_fc1(permuted_x_RH, m_splits)
        a_RF = _activation(self.config, h_RF)
        if permuted_probs_R is not None:
            a_RF = (a_RF * permuted_probs_R.unsqueeze(-1)).to(a_RF.dtype)
        return self.linear_fc2(a_RF, m_splits), None

    def backward_dw(self):
        pass

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's default view (weights of each local expert) at EP = 1; refused at EP > 1,
        where it would key every EP rank's local experts alike and keep only one rank's."""
        ep_size = self.config.num_moe_experts // self.num_local_experts
        if ep_size > 1:
            raise NotImplementedError(
                f"distributed checkpoints of the Transformer Engine grouped experts at expert-"
                f"parallel size {ep_size} are not supported (each rank's local experts would be "
                "saved under the same keys): use the grouped_mm expert backend, whose weights "
                "shard over EP, or EP=1"
            )
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)


def expert_class(backend: str):
    """The experts module of ``backend``, a name in ``config.EXPERT_BACKENDS`` (the one list)."""
    classes = {"grouped_mm": GroupedSwiGLUExperts, "te_grouped_linear": TEGroupedSwiGLUExperts}
    assert set(classes) == set(EXPERT_BACKENDS), "moe.config.EXPERT_BACKENDS and experts differ"
    if backend not in classes:
        raise ValueError(f"expert_backend must be one of {EXPERT_BACKENDS}, got {backend!r}")
    return classes[backend]
