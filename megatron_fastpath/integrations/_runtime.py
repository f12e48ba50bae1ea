"""Runtime pieces shared by the NeMo 2 and Megatron-Bridge hooks (imports neither framework).

A framework recipe is a serialised tree of configs: it cannot hold a live ``PackedSeqCache``.
What it holds instead are three small, serialisable values built from one frozen
:class:`FastpathSettings`:

* :class:`FastpathLayerSpec` -- the model config's ``transformer_layer_spec`` callable. When the
  framework builds the model (``config -> ModuleSpec``) it creates this process's cache for the
  settings (RoPE read from the config) and returns :func:`get_fastpath_layer_spec` over it.
* a data step (framework specific) that looks the same cache up by the same settings and loads
  each packed microbatch with ``cache.set_batch(cu_seqlens=<host cu_seqlens>)``;
* a forward step that passes the cache's static ``PackedSeqParams`` to the model.

:class:`~megatron_fastpath.packed_seq.inflight.InFlightBatches` (the main job's slot class)
releases the hooks' cache slots in call order (the newest ``num_slots`` batches stay reserved),
which is exactly right for Megatron's non-interleaved schedules: with pipeline size P,
microbatch m's forward starts after microbatch m-P's backward finished.
"""

# No `from __future__ import annotations`: NeMo-Run's YAML loader parses FastpathSettings
# values by their field types, which must be real types, not strings.
import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Optional

import numpy as np
import torch

from megatron_fastpath.moe.config import EXPERT_BACKENDS
from megatron_fastpath.packed_seq.inflight import InFlightBatches
from megatron_fastpath.packed_seq.rope import Llama3RopeScaling

if TYPE_CHECKING:
    from megatron_fastpath.packed_seq import PackedBatch

__all__ = [
    "FastpathSettings",
    "FastpathLayerSpec",
    "InFlightBatches",
    "cache_for",
    "clear_caches",
    "host_cu_seqlens",
]

_LINEAR_IMPLS = (None, "local", "te")
_ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "flash", "te")


class NotSupportedError(ValueError):
    """A framework config needs something megatron_fastpath does not provide; ``reasons``
    lists every reason (the config is left unchanged)."""

    what = "this config"

    def __init__(self, reasons):
        self.reasons = tuple(reasons)
        super().__init__(
            f"megatron_fastpath cannot serve {self.what}:\n"
            + "\n".join(f"  - {r}" for r in self.reasons)
        )


@dataclasses.dataclass(frozen=True)
class FastpathSettings:
    """Everything a process needs to rebuild the fastpath pieces of one model (serialisable).

    max_tokens: T, tokens per packed microbatch (the framework's packed sequence size).
    max_seqs: S, sequences per packed microbatch (the static ``cu_seqlens`` capacity is S + 1).
    max_seqlen: the longest sequence bound M (None: T): the ``max_seqlen`` flash / TE get and
        the rows of the sdpa backend's padded view (``PackedSeqConfig.max_seqlen``).
    num_slots: microbatches in flight at once (the pipeline size for 1F1B, 1 without PP).
    attention_backend: "auto" | "sdpa" | "flex" | "flash" | "te" (see ``PackedCoreAttention``).
    linear_impl: None (per backend), "local" or "te" (Transformer Engine linears; FP8 needs it).
    moe_expert_backend: "grouped_mm" or "te_grouped_linear" (FP8 experts); MoE models only.
    rope: apply RoPE from the cache (RoPE read from the model config when it is built).
    packed_cache: False = keep Megatron's attention, only swap the MoE layer.
    linear_cross_entropy: the forward step's loss: "chunked" (the chunked linear cross-entropy,
        no [T, V] logits), "off" (Megatron's), None (``rules.default_linear_cross_entropy`` on
        the first batch's tokens and the output weight's rows).
    llama3_*: Llama 3.1 frequency scaling the framework applies outside the config's Megatron
        fields (NeMo ``Llama31Config``, Bridge ``Llama31ModelProvider``: ``scale_factor``,
        ``low_freq_factor``, ``high_freq_factor``, ``old_context_len``), carried into the
        cache's ``RopeConfig``; ``llama3_scaling_factor`` None when the config has none. Flat
        fields because NeMo-Run serialises them to YAML; read them as one
        :class:`~megatron_fastpath.packed_seq.Llama3RopeScaling` through :attr:`llama3_rope`.
    """

    max_tokens: int
    max_seqs: int
    max_seqlen: Optional[int] = None
    num_slots: int = 1
    attention_backend: str = "auto"
    linear_impl: Optional[str] = None
    moe_expert_backend: str = "grouped_mm"
    rope: bool = True
    packed_cache: bool = True
    linear_cross_entropy: Optional[str] = None
    llama3_scaling_factor: Optional[float] = None
    llama3_low_freq_factor: float = 1.0
    llama3_high_freq_factor: float = 4.0
    llama3_original_max_position: int = 8192

    def __post_init__(self):
        from megatron_fastpath.settings import check_positive_ints

        check_positive_ints("FastpathSettings", self, ("max_tokens", "max_seqs", "num_slots"))
        if self.max_seqs > self.max_tokens:
            raise ValueError(
                f"FastpathSettings.max_seqs={self.max_seqs} > max_tokens={self.max_tokens}: "
                "every sequence has at least one token"
            )
        if self.max_seqlen is not None and not (
                isinstance(self.max_seqlen, int) and 0 < self.max_seqlen <= self.max_tokens):
            raise ValueError(f"FastpathSettings.max_seqlen must be an int in [1, max_tokens="
                             f"{self.max_tokens}] or None; got {self.max_seqlen!r}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {_ATTENTION_BACKENDS}; got {self.attention_backend!r}"
            )
        if self.linear_impl not in _LINEAR_IMPLS:
            raise ValueError(f"linear_impl must be one of {_LINEAR_IMPLS}; got {self.linear_impl!r}")
        if self.moe_expert_backend not in EXPERT_BACKENDS:
            raise ValueError(
                f"moe_expert_backend must be one of {EXPERT_BACKENDS}; got {self.moe_expert_backend!r}"
            )
        if self.linear_cross_entropy not in (None, "chunked", "off"):
            raise ValueError("linear_cross_entropy must be 'chunked', 'off' or None; got "
                             f"{self.linear_cross_entropy!r}")
        try:
            self.llama3_rope  # the llama3_* fields make a valid Llama3RopeScaling
        except ValueError as exc:
            raise ValueError(f"FastpathSettings.llama3_* (Llama 3.1 RoPE scaling): {exc}") from None

    @property
    def chunked_loss(self) -> Optional[bool]:
        """``linear_cross_entropy`` as the packed runtime's ``forward`` takes it."""
        return None if self.linear_cross_entropy is None else self.linear_cross_entropy == "chunked"

    @property
    def llama3_rope(self) -> Optional[Llama3RopeScaling]:
        """The ``llama3_*`` fields as one value (None without scaling): the one place they are
        read."""
        if self.llama3_scaling_factor is None:
            return None
        return Llama3RopeScaling(**{k: getattr(self, f) for k, f in _LLAMA3_FIELDS.items()})

    @staticmethod
    def llama3_fields(scaling: Optional[Llama3RopeScaling]) -> dict:
        """The ``llama3_*`` field values that carry ``scaling`` (the inverse of
        :attr:`llama3_rope`; empty for None, which the field defaults mean)."""
        if scaling is None:
            return {}
        return {f: getattr(scaling, k) for k, f in _LLAMA3_FIELDS.items()}


# Llama3RopeScaling field -> the flat FastpathSettings field carrying it.
_LLAMA3_FIELDS = {
    "factor": "llama3_scaling_factor",
    "low_freq_factor": "llama3_low_freq_factor",
    "high_freq_factor": "llama3_high_freq_factor",
    "original_max_position": "llama3_original_max_position",
}


@dataclasses.dataclass
class _Entry:
    cache: Any
    in_flight: InFlightBatches


# One cache per FastpathSettings per process: the layer spec creates it while the framework
# builds the model, the data step finds it by the same (equal, hashable) settings.
_CACHES: dict[FastpathSettings, _Entry] = {}


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cache_for(settings: FastpathSettings, config=None, device: Optional[torch.device] = None):
    """This process's ``(PackedSeqCache, InFlightBatches)`` for ``settings``.

    With ``config`` (a Megatron TransformerConfig) the cache is created on first use (RoPE from
    the config when ``settings.rope``); without it the cache must already exist (the data step
    runs after the model was built)."""
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    entry = _CACHES.get(settings)
    if config is None:
        if entry is None:
            raise RuntimeError(
                "no PackedSeqCache exists for these FastpathSettings in this process: the model "
                "must be built from the hooked config (its transformer_layer_spec is a "
                f"FastpathLayerSpec with the same settings) before the data step runs; {settings}"
            )
        return entry.cache, entry.in_flight
    rope = _rope_of(settings, config)
    device = torch.device(device) if device is not None else _default_device()
    if entry is not None:
        if entry.cache.config.rope != rope or entry.cache.device != device:
            raise ValueError(
                "a model with the same FastpathSettings but different RoPE/device was already "
                f"built in this process (cache rope={entry.cache.config.rope}, device="
                f"{entry.cache.device}; now rope={rope}, device={device}); call "
                "megatron_fastpath.integrations.clear_caches() between unrelated models"
            )
        return entry.cache, entry.in_flight
    cache = PackedSeqCache(
        PackedSeqConfig(
            max_tokens=settings.max_tokens,
            max_seqs=settings.max_seqs,
            max_seqlen=settings.max_seqlen,
            num_slots=settings.num_slots,
            rope=rope,
        ),
        device=device,
    )
    _CACHES[settings] = _Entry(cache, InFlightBatches(cache, release="call_order"))
    return cache, _CACHES[settings].in_flight


def _rope_of(settings: FastpathSettings, config):
    """The cache's RoPE: the model config's (``rope_config_of``) plus the settings' Llama 3.1
    scaling when the framework applies it outside the config's Megatron fields."""
    from megatron_fastpath.model import rope_config_of

    if not settings.rope:
        return None
    rope = rope_config_of(config)
    scaling = settings.llama3_rope
    return rope if scaling is None else dataclasses.replace(rope, llama3=scaling)


def clear_caches() -> None:
    """Forget every cache of this process (tests; rebuilding a different model)."""
    _CACHES.clear()


@dataclasses.dataclass(frozen=True)
class FastpathLayerSpec:
    """``transformer_layer_spec`` callable for NeMo ``GPTConfig`` / Bridge ``GPTModelProvider``.

    ``FastpathLayerSpec(settings)(config) -> ModuleSpec``: creates (or reuses) this process's
    cache and returns :func:`megatron_fastpath.get_fastpath_layer_spec` over it, with the
    config's normalisation, qk-layernorm and expert count. With ``settings.packed_cache=False``
    it returns Megatron's own GPT layer spec with only the MLP swapped for the fastpath MoE
    layer. A frozen dataclass, so frameworks serialise it as a config of this class."""

    settings: FastpathSettings

    def __call__(self, config):
        from megatron_fastpath.graphs.setup import install_for_config

        install_for_config(config)  # the 0.16.x graph input-buffer shim, as the main job installs it
        s = self.settings
        num_experts = getattr(config, "num_moe_experts", None)
        moe_kwargs = {"expert_backend": s.moe_expert_backend} if num_experts else None
        if s.packed_cache:
            from megatron_fastpath.layer_spec import get_fastpath_layer_spec

            cache, _ = cache_for(s, config)
            return get_fastpath_layer_spec(
                cache,
                backend=s.attention_backend,
                normalization=config.normalization,
                qk_layernorm=bool(config.qk_layernorm),
                num_experts=num_experts,
                linear_impl=s.linear_impl,
                moe_spec_kwargs=moe_kwargs,
                # "auto" picks by the model dtype (fp32 -> sdpa), as the main job resolves it
                params_dtype=config.params_dtype,
            )
        if not num_experts:
            raise ValueError(
                "FastpathLayerSpec(packed_cache=False) only swaps the MoE layer; this config has "
                "no experts (num_moe_experts is unset)"
            )
        return _megatron_spec_with_fastpath_moe(config, s, moe_kwargs)


def _megatron_spec_with_fastpath_moe(config, settings: FastpathSettings, moe_kwargs: dict):
    """Megatron's GPT layer spec (built for MoE: pre-MLP norm included) with the MLP slot
    replaced by :func:`megatron_fastpath.moe.get_moe_mlp_spec`."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_fastpath.layer_spec import megatron_base_spec
    from megatron_fastpath.moe.spec import get_moe_mlp_spec

    base = megatron_base_spec(
        settings.linear_impl or "local",
        num_experts=config.num_moe_experts,
        qk_layernorm=bool(config.qk_layernorm),
        normalization=config.normalization,
    )
    mlp = get_moe_mlp_spec(num_experts=config.num_moe_experts, **moe_kwargs)
    submodules = dataclasses.replace(base.submodules, mlp=mlp)
    return ModuleSpec(module=base.module, params=dict(base.params), submodules=submodules)


def host_cu_seqlens(batch: Mapping[str, Any]) -> np.ndarray:
    """The packed microbatch's boundaries as a host int array, from a framework batch dict.

    Accepts NeMo 2 / Megatron-Bridge <= 0.5 collate output (``cu_seqlens`` [1, K] int32 padded
    with -1, ``cu_seqlens_argmin`` [1, 1] = index of the first -1, both on the host; trailing
    repeats of the total from ``pad_cu_seqlens`` are dropped later by
    ``lengths_from_cu_seqlens``) and Bridge >= 0.6 keys (``cu_seqlens_q_padded`` or
    ``cu_seqlens_q``: exact boundaries, physical offsets preferred). Reads host values only;
    a device tensor is refused (reading it would be a device-to-host sync)."""
    if batch.get("cu_seqlens_q") is not None:
        cu = batch.get("cu_seqlens_q_padded")
        cu = cu if cu is not None else batch["cu_seqlens_q"]
        return _host_row(cu, "cu_seqlens_q")
    if batch.get("cu_seqlens") is None:
        raise ValueError(
            "the batch has no cu_seqlens: megatron_fastpath's packed cache needs packed-sequence "
            "batches (NeMo: data.packed_sequence_specs.packed_sequence_size > 0)"
        )
    cu = _host_row(batch["cu_seqlens"], "cu_seqlens")
    argmin = batch.get("cu_seqlens_argmin")
    if argmin is not None:
        end = int(_host_row(argmin, "cu_seqlens_argmin")[0])
    else:  # no precomputed argmin: the first -1 sentinel, found on the host
        neg = np.flatnonzero(cu < 0)
        end = int(neg[0]) if neg.size else cu.size
    return _padding_tail_open(cu[:end], batch)


def _padding_tail_open(cu: np.ndarray, batch: Mapping[str, Any]) -> np.ndarray:
    """Boundaries whose padding tail is padding again, not a sequence.

    The packed collate of NeMo 2 and Megatron-Bridge (``GPTSFTPackedDataset.collate_fn``) pads a
    pack to ``max_length`` and closes the pad with one more boundary at ``max_length`` ("rope and
    attn kernels expect no padding"); ``token_count`` (a host list) holds the tokens before the
    pad. Read as given, the pad would be one more sequence to the cache: real to attention,
    which is harmless, and real to MoE routing, which is not (padding tokens would take expert
    capacity and enter the aux loss). So a last boundary that only closes the pad is dropped:
    the cache then marks those tokens as padding (``padding_mask``) and closes the tail itself."""
    count = batch.get("token_count")
    if count is None or cu.size < 3:
        return cu
    count = _host_row(count, "token_count") if not isinstance(count, int) else np.asarray([count])
    if count.size != 1:
        raise ValueError(f"batch['token_count'] must hold one count (one row); got {count.tolist()}")
    n, total = int(count[0]), int(cu[-1])
    body = cu[: int(np.searchsorted(cu, total))]  # drop pad_cu_seqlens' repeats of the total
    if 0 < n < total and body.size >= 2 and int(body[-1]) == n:
        return body
    return cu


def _host_row(t, what: str) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            raise TypeError(
                f"batch[{what!r}] is on {t.device}; the packed cache reads boundaries on the host "
                "(reading a device tensor is a device-to-host sync): keep the collate's "
                f"{what} on the CPU"
            )
        t = t.numpy()
    arr = np.asarray(t)
    if arr.ndim == 2:
        if arr.shape[0] != 1:
            raise ValueError(
                f"batch[{what!r}] has shape {arr.shape}: packed microbatches hold one row "
                "(micro_batch_size must be 1)"
            )
        arr = arr[0]
    if arr.ndim != 1:
        raise ValueError(f"batch[{what!r}] must be 1-D or [1, K]; got shape {arr.shape}")
    return arr
