"""Transformer Engine FP8: its settings and plan (:mod:`.config`: ``FP8Config``, the
TransformerConfig ``fp8*`` fields and the refusals) and its checkpoint state (:mod:`.state`: the
delayed-scaling scales and amax histories, per rank, as safetensors instead of TE's pickle).
The version-sensitive Transformer Engine calls stay in :mod:`megatron_fastpath.compat`
(``compat/te.py``, ``compat/te_quantized.py``)."""

from megatron_fastpath.fp8.config import FP8Config, plan_fp8
from megatron_fastpath.fp8.state import collect_fp8_state, load_fp8_state, restore_fp8_state, save_fp8_state

__all__ = ["FP8Config", "plan_fp8", "collect_fp8_state", "restore_fp8_state", "save_fp8_state",
           "load_fp8_state"]
