"""Configuration of the sort/count MoE token dispatcher (one frozen dataclass).

:class:`MoEDispatchConfig` holds every knob of the dispatcher, router and grouped experts that is
not already a plain Megatron ``TransformerConfig`` field, plus the Megatron fields it reads, so
the pure functions in :mod:`megatron_fastpath.moe.dispatch` need nothing but tensors and this
config. Build it from a Megatron config with :meth:`MoEDispatchConfig.from_transformer_config`.

Shape letters: T tokens, k experts per token, E experts, C capacity (rows per expert), R rows
of the expert buffer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Optional

__all__ = ["MoEDispatchConfig", "ExpertBackend", "EXPERT_BACKENDS", "FP8_ALIGN"]

# The expert backends, in one place (``moe.experts.expert_class`` maps them to modules):
# "grouped_mm": torch._grouped_mm on device offsets, 0 host syncs;
# "te_grouped_linear": Transformer Engine GroupedLinear (FP8), 1 counted host sync per layer.
ExpertBackend = Literal["grouped_mm", "te_grouped_linear"]
EXPERT_BACKENDS = ("grouped_mm", "te_grouped_linear")

# FP8 GEMMs (TE/cuBLASLt) need each group's row count to be a multiple of 16 (32 for MXFP8:
# fp8_align_size asks Megatron).
FP8_ALIGN = 16


def fp8_align_size(config: Any) -> int:
    """Rows per expert group an FP8 GEMM of ``config.fp8_recipe`` needs: Megatron's own
    ``megatron.core.fp8_utils.get_fp8_align_size`` (MXFP8 scales blocks of 32 rows)."""
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    return get_fp8_align_size(Fp8Recipe(getattr(config, "fp8_recipe", None) or Fp8Recipe.delayed))


@dataclasses.dataclass(frozen=True)
class MoEDispatchConfig:
    """Static description of one MoE layer's routing and dispatch.

    Args:
        num_experts: E, total number of routed experts (all EP ranks).
        topk: k, experts per token.
        capacity_factor: None for dropless (permuted buffer of T*k rows); a float enables the
            capacity mode: each expert keeps at most ``capacity = ceil(T*k/E * factor)`` tokens
            (Megatron's ``get_capacity``), the rest are dropped.
        pad_to_capacity: capacity mode only. True (Megatron's
            ``moe_pad_expert_input_to_capacity``): every expert gets exactly ``capacity`` rows,
            buffer ``E*capacity`` rows with fixed offsets (needed for the static EP all-to-all).
            False: kept rows are packed, buffer ``min(T*k, E*capacity)`` rows (still static).
        drop_policy: capacity mode only: "probs" keeps the highest-probability tokens of each
            expert, "position" the earliest (Megatron's ``moe_token_drop_policy``).
        pad_multiple: each expert group is padded to a multiple of this many rows inside a static
            upper bound (16 for FP8 GEMMs; 1 = no padding). Computed on device, no sync.
        strict_capacity: capacity mode: raise ValueError when an expert receives more tokens than
            its capacity instead of dropping. Costs one counted host read per layer (debug aid).
        check_expert_ids: raise ValueError when a top-k expert id is outside [0, E). Costs one
            counted host read per layer (shared with ``strict_capacity``); off by default since
            the router can only produce valid ids.
        expert_backend: "grouped_mm" (``torch._grouped_mm`` on device offsets, 0 syncs) or
            "te_grouped_linear" (Transformer Engine ``GroupedLinear``; its host ``m_splits`` cost
            exactly one counted sync per layer).
        probs_in_combine: True: routing probabilities weight the combine (``index_add_``) and the
            experts see no probs. False: Megatron's convention (experts multiply by
            ``permuted_probs``, combine is an unweighted sum); use it with Megatron's experts.
        score_function, pre_softmax, topk_scaling_factor, num_groups, group_topk,
        aux_loss_coeff, z_loss_coeff, router_dtype: router options, same meaning as Megatron's
            ``moe_router_*`` / ``moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` fields.
    """

    num_experts: int
    topk: int
    capacity_factor: Optional[float] = None
    pad_to_capacity: bool = True
    drop_policy: Literal["probs", "position"] = "probs"
    pad_multiple: int = 1
    strict_capacity: bool = False
    check_expert_ids: bool = False
    expert_backend: ExpertBackend = "grouped_mm"
    probs_in_combine: bool = False
    # router
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    pre_softmax: bool = False
    topk_scaling_factor: Optional[float] = None
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    aux_loss_coeff: float = 0.0
    z_loss_coeff: Optional[float] = None
    router_dtype: Optional[Literal["fp32", "fp64"]] = None

    def __post_init__(self):
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {self.num_experts!r}")
        if not isinstance(self.topk, int) or self.topk < 1:
            raise ValueError(f"topk must be a positive int, got {self.topk!r}")
        if self.topk > self.num_experts:
            raise ValueError(
                f"topk={self.topk} > num_experts={self.num_experts}: each token picks k distinct "
                "experts, so k must be <= E (lower moe_router_topk or add experts)."
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"capacity_factor must be > 0 or None (dropless), got {self.capacity_factor}"
            )
        if self.drop_policy not in ("probs", "position"):
            raise ValueError(f"drop_policy must be 'probs' or 'position', got {self.drop_policy!r}")
        if not isinstance(self.pad_multiple, int) or self.pad_multiple < 1:
            raise ValueError(f"pad_multiple must be an int >= 1, got {self.pad_multiple!r}")
        if self.strict_capacity and self.capacity_factor is None:
            raise ValueError("strict_capacity=True needs a capacity_factor (dropless never drops)")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ValueError(
                f"expert_backend must be one of {EXPERT_BACKENDS}, got {self.expert_backend!r}"
            )
        if self.score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"score_function must be softmax|sigmoid, got {self.score_function!r}")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError("num_groups and group_topk must be set together (group-limited top-k)")
        if self.num_groups is not None:
            if self.num_experts % self.num_groups:
                raise ValueError(
                    f"num_experts={self.num_experts} is not divisible by num_groups={self.num_groups}"
                )
            if not 1 <= self.group_topk <= self.num_groups:
                raise ValueError(f"group_topk={self.group_topk} must be in [1, num_groups]")
            if self.topk % self.group_topk:
                raise ValueError(f"topk={self.topk} must be divisible by group_topk={self.group_topk}")
            if self.topk > self.group_topk * (self.num_experts // self.num_groups):
                raise ValueError("topk exceeds the experts available in group_topk groups")

    # -- derived static sizes -----------------------------------------------------------
    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    def capacity(self, num_tokens: int) -> Optional[int]:
        """Rows per expert in capacity mode (Megatron's ``get_capacity(T*k, E, factor)``, rounded
        up to ``pad_multiple``); None when dropless."""
        if self.capacity_factor is None:
            return None
        cap = math.ceil(num_tokens * self.topk / self.num_experts * self.capacity_factor)
        return _round_up(max(cap, 1), self.pad_multiple)

    def num_rows(self, num_tokens: int) -> int:
        """Static number of rows R of the permuted buffer for T tokens (an upper bound on the
        padded group sizes; the slack is given to the last expert so offsets end at R)."""
        E = self.num_experts
        N = num_tokens * self.topk
        m = self.pad_multiple
        cap = self.capacity(num_tokens)
        if cap is not None and self.pad_to_capacity:
            return E * cap
        kept = N if cap is None else min(N, E * cap)
        if m == 1:
            return kept
        bound = kept + E * (m - 1)
        if cap is not None:
            bound = min(bound, E * cap)
        return (bound // m) * m  # padded sizes sum to a multiple of m, so this is still a bound

    # -- construction from Megatron ------------------------------------------------------
    @classmethod
    def from_transformer_config(cls, config: Any, **overrides) -> "MoEDispatchConfig":
        """Read the MoE fields of a Megatron ``TransformerConfig``.

        Mapping: ``num_moe_experts``, ``moe_router_topk``, ``moe_expert_capacity_factor``,
        ``moe_pad_expert_input_to_capacity``, ``moe_token_drop_policy``,
        ``moe_router_score_function``, ``moe_router_pre_softmax``,
        ``moe_router_topk_scaling_factor``, ``moe_router_num_groups``/``moe_router_group_topk``,
        ``moe_aux_loss_coeff`` (for ``moe_router_load_balancing_type == "aux_loss"``),
        ``moe_z_loss_coeff``, ``moe_router_dtype``; ``fp8`` (or
        ``moe_router_padding_for_quantization``) sets ``pad_multiple`` to Megatron's
        ``get_fp8_align_size`` of ``fp8_recipe`` (32 for MXFP8, 16 otherwise);
        ``moe_grouped_gemm`` with Transformer Engine is *not* implied: the expert backend stays
        "grouped_mm" unless overridden. Keyword ``overrides`` win over the derived values.
        """
        if getattr(config, "num_moe_experts", None) is None:
            raise ValueError("TransformerConfig.num_moe_experts is None: not an MoE config")
        lb_type = getattr(config, "moe_router_load_balancing_type", "aux_loss")
        aux = getattr(config, "moe_aux_loss_coeff", 0.0)
        if isinstance(lb_type, list):
            coeffs = dict(zip(lb_type, aux))
            unsupported = [t for t, c in coeffs.items() if c and t != "aux_loss"]
            aux = coeffs.get("aux_loss", 0.0)
        else:
            unsupported = [lb_type] if lb_type not in ("aux_loss", "none") and aux else []
            aux = aux if lb_type == "aux_loss" else 0.0
        if unsupported:
            raise ValueError(
                f"moe_router_load_balancing_type {unsupported} is not supported by the fastpath "
                "router (supported: 'aux_loss', 'none'); use Megatron's MoELayer for it."
            )
        pad = fp8_align_size(config) if (
            getattr(config, "fp8", None)
            or getattr(config, "moe_router_padding_for_quantization", False)
        ) else 1
        kwargs = dict(
            num_experts=config.num_moe_experts,
            topk=config.moe_router_topk,
            capacity_factor=getattr(config, "moe_expert_capacity_factor", None),
            pad_to_capacity=bool(getattr(config, "moe_pad_expert_input_to_capacity", False)),
            drop_policy=getattr(config, "moe_token_drop_policy", "probs"),
            pad_multiple=pad,
            score_function=getattr(config, "moe_router_score_function", "softmax"),
            pre_softmax=bool(getattr(config, "moe_router_pre_softmax", False)),
            topk_scaling_factor=getattr(config, "moe_router_topk_scaling_factor", None),
            num_groups=getattr(config, "moe_router_num_groups", None),
            group_topk=getattr(config, "moe_router_group_topk", None),
            aux_loss_coeff=float(aux or 0.0),
            z_loss_coeff=getattr(config, "moe_z_loss_coeff", None),
            router_dtype=getattr(config, "moe_router_dtype", None),
        )
        kwargs.update(overrides)
        return cls(**kwargs)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
