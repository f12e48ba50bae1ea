"""Framework hooks: put megatron_fastpath into NeMo 2 recipes and Megatron-Bridge configs.

* :mod:`megatron_fastpath.integrations.nemo` -- ``apply_fastpath(recipe, ...)`` for NeMo-Run
  recipes of ``nemo-toolkit[llm]`` 2.7 (``pip install 'megatron_fastpath[nemo]'``).
* :mod:`megatron_fastpath.integrations.bridge` -- ``apply_fastpath_to_config(cfg, ...)`` for a
  Megatron-Bridge ``ConfigContainer`` (Python >= 3.12 + Transformer Engine: GPU containers).

Importing this package imports neither framework. The shared runtime pieces (serialisable
settings, the layer-spec callable, the per-process cache registry) live in ``_runtime``.
"""

from megatron_fastpath.integrations._runtime import (
    FastpathLayerSpec,
    FastpathSettings,
    InFlightBatches,
    cache_for,
    clear_caches,
    host_cu_seqlens,
)

__all__ = [
    "FastpathLayerSpec",
    "FastpathSettings",
    "InFlightBatches",
    "cache_for",
    "clear_caches",
    "host_cu_seqlens",
]
