"""FP8 settings and plan: the ``fp8`` group as :class:`FP8Config`, turned into the TransformerConfig
``fp8*`` fields by :func:`plan_fp8`, which refuses what cannot work (no Transformer Engine, linears
that are not TE's) before any model is built. :func:`megatron_fastpath.graphs.config.plan_graphs_and_fp8`
calls it with the CUDA-graph plan; the rules a run shares with the framework hooks (FP8 attention
on packed sequences, ...) are :mod:`megatron_fastpath.rules`'.
"""

from __future__ import annotations

import dataclasses

__all__ = ["FP8Config", "plan_fp8"]


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """Transformer Engine FP8 settings (TransformerConfig fp8* fields); on when passed to
    ``plan_graphs_and_fp8`` (the main job's switch is ``fastpath.fp8``).

    format: "hybrid" (E4M3 forward, E5M2 backward) or "e4m3".
    recipe: "delayed" (amax history), "tensorwise", "mxfp8" or "blockwise".
    amax_history_len / amax_compute_algo: delayed scaling's history ("max" or "most_recent").
    dot_product_attention: FP8 attention (TE fused attention).
    """

    format: str = "hybrid"
    recipe: str = "delayed"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    dot_product_attention: bool = False

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
