"""FP8 settings and plan: the ``fp8`` group as :class:`FP8Config`, turned into the TransformerConfig
``fp8*`` fields by :func:`plan_fp8`, which refuses what cannot work (no Transformer Engine, linears
that are not TE's) before any model is built. :func:`megatron_fastpath.graphs.config.plan_graphs_and_fp8`
calls it with the CUDA-graph plan; the rules a run shares with the framework hooks (FP8 attention
on packed sequences, ...) are :mod:`megatron_fastpath.rules`'.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_fastpath.settings import setting

__all__ = ["FP8Config", "plan_fp8"]


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """Transformer Engine FP8 settings (TransformerConfig fp8* fields); on when passed to
    ``plan_graphs_and_fp8`` (the main job's switch is ``fastpath.fp8``)."""

    format: str = setting("hybrid", "hybrid (E4M3 forward, E5M2 backward) | e4m3")
    recipe: str = setting("delayed", "delayed (amax history) | tensorwise | mxfp8 | blockwise")
    amax_history_len: int = setting(1024, "delayed scaling: the amax history's length")
    amax_compute_algo: str = setting("max", "delayed scaling: the amax the scale uses, the history's max | most_recent")
    margin: int = setting(0, "delayed scaling: the scale's margin (scale = FP8 max / amax / 2^margin)")
    dot_product_attention: bool = setting(False, "FP8 attention (TE fused attention)")

    def __post_init__(self):
        if self.format not in ("hybrid", "e4m3"):
            raise ValueError(f"fp8.format must be 'hybrid' or 'e4m3'; got {self.format!r}")
        if self.recipe not in ("delayed", "tensorwise", "mxfp8", "blockwise"):
            raise ValueError(f"fp8.recipe must be delayed|tensorwise|mxfp8|blockwise; got {self.recipe!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError("fp8.amax_compute_algo must be 'max' or 'most_recent'")
        if self.amax_history_len < 1:
            raise ValueError("fp8.amax_history_len must be >= 1")


def plan_fp8(fp8: FP8Config, linear_impl: str) -> tuple[dict, str]:
    """The TransformerConfig fp8* fields of ``fp8`` and the human-readable note on them.

    Raises MissingDependencyError without Transformer Engine and ValueError when ``linear_impl``
    is not "te" (FP8 runs in TE's linears)."""
    from megatron_fastpath._optional import require

    # fp8.dot_product_attention on packed (THD) sequences is refused by megatron_fastpath.rules
    require("transformer_engine.pytorch", "FP8 training (fastpath.fp8=true)",
            "fastpath.fp8=false (bf16)")
    if linear_impl != "te":
        raise ValueError(
            "FP8 needs Transformer Engine linears: use the 'te' linear implementation "
            "(fastpath.linear_impl=te, or fastpath.attention_backend=te with linear_impl auto)"
        )
    fields = dict(
        fp8=fp8.format,
        fp8_recipe=fp8.recipe,
        fp8_margin=fp8.margin,
        fp8_amax_history_len=fp8.amax_history_len,
        fp8_amax_compute_algo=fp8.amax_compute_algo,
        fp8_dot_product_attention=fp8.dot_product_attention,
    )
    note = (
        f"FP8 {fp8.format}/{fp8.recipe}: amax reduced once per step (TE reduces at the end of "
        "the outermost fp8_autocast, which Megatron opens once around the layer block); MoE "
        "expert groups padded to Megatron's FP8 alignment (16 rows; 32 for mxfp8)"
    )
    return fields, note


def layer_gemms(hidden: int, heads: int, groups: int, head: int, ffn: int, gated: bool, tp: int,
                moe: bool, expert_ffn: Optional[int] = None) -> list:
    """(name, in features, out features) of each Transformer Engine GEMM of one layer on one
    tensor-parallel rank: ``linear_qkv`` and ``linear_fc1`` are column-parallel (outputs split),
    ``linear_proj`` and ``linear_fc2`` row-parallel (inputs split); a gated fc1 holds both
    halves. An MoE layer has no dense fc1 / fc2; with ``expert_ffn`` (the te_grouped_linear
    experts, TE's GroupedLinear) each expert's fc1 / fc2, named ``experts.*`` (their rows are
    the dispatcher's padded groups, aligned to the recipe)."""
    fc1 = 2 if gated else 1
    q, kv = heads * head, groups * head
    gemms = [("linear_qkv", hidden, (q + 2 * kv) // tp), ("linear_proj", q // tp, hidden)]
    if not moe:
        gemms += [("linear_fc1", hidden, fc1 * ffn // tp), ("linear_fc2", ffn // tp, hidden)]
    elif expert_ffn is not None:
        gemms += [("experts.linear_fc1", hidden, fc1 * expert_ffn), ("experts.linear_fc2", expert_ffn, hidden)]
    return gemms


def te_linear_gemms(model, tp: int) -> list:
    """:func:`layer_gemms` of the main job's Llama-style model (SwiGLU). An MoE model's experts
    are not TE linears in the main job (its grouped_mm experts): its layers have the attention
    ones only."""
    return layer_gemms(model.hidden_size, model.num_attention_heads, model.num_query_groups,
                       model.kv_channels or model.hidden_size // model.num_attention_heads,
                       model.ffn_hidden_size, True, tp, model.num_experts is not None)


def te_gemms_of_config(config, tp: int, te_experts: bool) -> list:
    """:func:`layer_gemms` of a framework's Megatron ``TransformerConfig`` (the hooks): its
    kv_channels, query groups and gated fc1; with ``te_experts`` the experts' GEMMs too
    (``moe_ffn_hidden_size``, else Megatron's default, ``ffn_hidden_size``)."""
    heads = config.num_attention_heads
    moe = bool(config.num_moe_experts)
    return layer_gemms(config.hidden_size, heads, getattr(config, "num_query_groups", None) or heads,
                       getattr(config, "kv_channels", None) or config.hidden_size // heads,
                       config.ffn_hidden_size, getattr(config, "gated_linear_unit", False), tp, moe,
                       (config.moe_ffn_hidden_size or config.ffn_hidden_size) if moe and te_experts else None)


def fp8_gemm_shape_problem(recipe: str, gemms: list, tokens: int, names) -> Optional[str]:
    """Why Transformer Engine 2.10 would refuse an FP8 GEMM of these shapes at the first
    forward (None: it would not). ``tokens``: a microbatch's tokens on one rank (the packed
    length over the context-parallel size: the leading dimension of every linear's input).
    ``names``: the entry point's spelling (a ``rules.Names``, passed in by the rule
    ``rules._fp8_gemm_shapes``: this module does not import the rules).

    * every recipe: an FP8 linear asserts that its input [tokens, in] and weight [out, in] have
      leading dims divisible by 8 and a last dim divisible by 16 (pytorch/utils.py:439-447,
      called by module/linear.py:177 and layernorm_linear.py);
    * MoE experts on TE's GroupedLinear (``experts.*``): their rows are the dispatcher's padded
      groups; cuBLASLt needs the inner dim of each FP8 GEMM divisible by 16, i.e. in features
      (forward) and out features (dgrad) (common/gemm/cublaslt_gemm.cu:155-159, 246-250);
    * mxfp8: input, weight and output gradient are quantised in blocks of 32 along both dims
      (tensor/mxfp8_tensor.py:112-118: "Tensor dims must be divisible by 32";
      csrc/quantizer.cpp:1114-1116 for GroupedLinear)."""
    fix = f"choose model sizes whose per-rank split is divisible ({names.model_sizes})"
    for name, n_in, n_out in gemms:
        experts = name.startswith("experts.")
        rows = 32 if experts else tokens  # the dispatcher pads expert groups (16, or 32 for mxfp8)
        if rows % 8 or n_in % 16 or n_out % (16 if experts else 8):
            return (f"fp8 ({names.fp8_on}): Transformer Engine's FP8 GEMMs need leading dims "
                    f"divisible by 8 and last dims by 16 (TE pytorch/utils.py:439-447"
                    f"{'; GroupedLinear: cublaslt_gemm.cu:155-159' if experts else ''}), but "
                    f"{name} on a rank is {rows} {'rows' if experts else 'tokens'} x {n_in} -> "
                    f"{n_out}: {fix}, or {names.fp8_off}")
        if recipe == "mxfp8" and (rows % 32 or n_in % 32 or n_out % 32):
            return (f"{names.fp8_recipe}=mxfp8 quantises every TE linear's input, weight and gradient in "
                    f"blocks of 32 along both dims (TE tensor/mxfp8_tensor.py:112-118), but "
                    f"{name} on a rank is {rows} {'rows' if experts else 'tokens'} x {n_in} -> "
                    f"{n_out}: {fix}, or another {names.fp8_recipe}")
    return None
