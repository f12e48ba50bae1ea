"""Packed-sequence metadata: our cache vs rebuilding it per layer vs Megatron's THD RoPE path.

One process, one Llama-style ``GPTModel`` shape (hidden 256, GQA 4 heads / 2 groups, RMSNorm,
SwiGLU, no biases, fp32), one packed batch of ``--tokens`` tokens (default 2048) made of
``--num-seqs`` deterministic variable-length sequences (default 40, lengths from random cut
points, seed 0, filling the batch exactly), L in ``--layers`` (default 4, 16, 28). For each L the
three variants are built with the SAME weights (state dict copied) and run on the SAME batch
through the SAME driver (embedding -> ``model.decoder`` -> output layer -> Megatron's
cross-entropy -> mean), so only the attention-side metadata handling differs:

``cache`` (ours)
    ``get_fastpath_layer_spec(cache, backend="sdpa")``. Per step ``cache.set_batch(lengths)``
    builds B on the host, copies it once into static buffers and builds the block-causal SDPA
    mask (one additive [T, T] mask in the compute dtype) and per-token RoPE cos/sin once;
    every layer reads them from the ``packed_seq_params`` (no aten ops, one mask saved for
    backward per step).

``rebuild_per_layer`` (baseline a)
    :class:`RebuildPerLayerCoreAttention`: every layer's core attention rebuilds B from the
    batch's device lengths tensor (Unsloth's ``packed_seq_lengths``), the way Unsloth's packed
    SDPA path did before its cache (``get_packed_info_from_kwargs`` +
    ``build_sdpa_packed_attention_mask`` called from every attention layer) and the way
    Megatron rebuilds RoPE factors per layer. Exactly what it rebuilds, per layer, is listed in
    the class docstring (3 host reads per layer: ``max().item()``, ``sum().item()``,
    ``tolist()``). The RoPE application and the SDPA call are the same code as ours, so the
    only difference from ``cache`` is the per-layer rebuild.

``megatron_thd_rope`` (baseline b)
    Megatron-Core 0.16.1's own UNFUSED THD RoPE path (``apply_rope_fusion=False``). Megatron-LM's
    default is fused RoPE (``apply_rope_fusion=True``: Transformer Engine's fused kernel over
    device ``cu_seqlens``, no host sync); its "4 host syncs per layer" below are those of the
    unfused path only, the one a CPU run or a setup without TE takes. The unfused path: the stock ``SelfAttention`` gets
    ``rotary_pos_emb`` and a standard ``PackedSeqParams`` (``qkv_format="thd"``, device
    ``cu_seqlens`` and the batch's true ``max_seqlen``, as a Megatron data pipeline builds
    them), so ``apply_rotary_pos_emb(..., cu_seqlens=...)`` -> ``_apply_rotary_pos_emb_thd``
    runs for q and for k in every layer (``.tolist()`` of the sequence lengths, a tensor
    ``__bool__``, one freqs slice per sequence, a ``cat``, then ``cos``/``sin`` of the packed
    freqs). Core attention is :class:`CacheMaskCoreAttention`: our SDPA backend with RoPE off,
    reading the block-causal mask from a ``PackedSeqCache`` (so only the RoPE path differs from
    ``cache``). ``GPTModel(position_embedding_type="rope")`` cannot run on CPU in 0.16.1
    (``RotaryEmbedding.get_emb`` moves ``inv_freq`` to CUDA), so the driver computes
    ``rotary_pos_emb`` per step with Megatron's own ``RotaryEmbedding.get_freqs_non_repeated``
    (built with ``use_cpu_initialization=True``) and ``get_emb``'s layout
    (``cat((f, f), -1)[:, None, None, :]``) for the batch's true ``max_seqlen`` -- what
    ``GPTModel._preprocess`` computes from ``PackedSeqParams.max_seqlen_q``. (The true max
    matters: handed our cache's static params, whose ``max_seqlen_q`` is the constant bound
    T and whose ``cu_seqlens_q`` close the tail at T, GPTModel would build T rows of freqs,
    ``freqs.size(0) == cu_seqlens[-1]`` would hold and ``_apply_rotary_pos_emb_thd`` would take
    its offset branch: one more ``.item()`` per sequence slot, S+2 host syncs per call.)

What is measured, per variant and L
    host_syncs_per_step
        ``SyncSentinel`` (non-strict) around one whole step: per-step preparation (set_batch /
        building the lengths tensor, ``PackedSeqParams`` and ``rotary_pos_emb``), forward,
        backward and slot release. Counts Python reads of tensor values and data-dependent-shape
        ops; their locations are printed.
    metadata_ops_per_step / metadata_ops_per_layer
        aten ops spent on metadata, by difference against an oracle forward in which B is
        already built: ``ops(prep) + ops(forward)`` of the variant minus ``ops(forward)`` of
        ``cache`` (whose layers only look B up in the cache). Both sides run the identical
        driver, embedding, norms, linears, MLP, loss and SDPA call, so the difference is the
        metadata work: for ``cache`` exactly the ops of ``set_batch`` (the static buffers,
        mask, cos/sin; constant in L); for ``rebuild_per_layer`` its per-layer rebuild (plus
        3 per-step ops building its lengths and cu_seqlens tensors); for ``megatron_thd_rope``
        the per-step ``set_batch`` (mask only), ``cu_seqlens`` and ``rotary_pos_emb`` plus, per
        layer, what Megatron's RoPE does beyond ours' elementwise application (the cu_seqlens walk,
        per-sequence freqs slices, ``cat``, ``cos``/``sin`` and the ``mscale`` multiplies of the
        packed freqs, and the rot-dim split / re-``cat`` of ``_apply_rotary_pos_emb_bshd``).
        Forward only: metadata carries no gradient, so backward adds none. ``per_layer`` is
        ``per_step / L``. ``--breakdown`` prints the op-name histogram of each difference.
    fwd_ms / fwd_bwd_ms (and fwd_cpu_ms / fwd_bwd_cpu_ms)
        wall time of a training step's forward (per-step preparation + forward to the scalar
        loss, autograd on) and of the whole step (+ backward + release), minimum over
        ``--repeats`` steps after ``--warmup`` steps (all samples kept in ``*_all``); the ``_cpu_`` twins are the process CPU
        time (all threads) of the same steps, which other processes competing for the cores
        inflate far less than wall time (on a shared machine, compare those; with
        ``--threads 1`` they are the single thread's compute time). Variants run round-robin
        within each repeat (rotating the order) so drift hits all of them alike; Python's GC
        is paused during a timed step; gradients are dropped (``p.grad = None``) between
        steps, untimed. On CPU nothing waits for a device, so a host sync costs only its
        Python/aten overhead here; on a GPU each one stalls the launch queue as well.
    mask_tensors_saved_per_step
        distinct [T, T] storages autograd saves for backward in one step (saved-tensor hooks):
        ours 1 (the batch's additive mask, shared by all layers); a per-layer build saves L.
    cache_bytes
        device bytes the variant's packed cache holds between steps (records, mask, RoPE).
    ratios
        baseline / ours = t(baseline) / t(cache): > 1 means ours is faster; forward and
        forward+backward (wall and CPU),
        printed beside Unsloth's anchor (Qwen3-14B QLoRA SFT on Blackwell GPUs: forward +43.3%
        from caching).
    numerics
        the first warmup step's loss of every variant and the max relative gradient difference
        against ``cache`` (fp32 tolerance), plus ``cache``'s driver loss against
        ``GPTModel.forward`` on the same batch.

Usage::

    python benchmarks/packed_seq.py                       # default: L in 4,16,28, 2048 tokens
    python benchmarks/packed_seq.py --quick --json /tmp/packed_seq.json
    python benchmarks/packed_seq.py --layers 4 16 --tokens 1024 --repeats 3 --threads 2
    python benchmarks/packed_seq.py --threads 1   # machine shared with other jobs: read the cpu columns

On a machine whose cores other processes also use, wall times (and, with 2+ threads, CPU
times inflated by OpenMP spin-waits) swing by several x between repeats; the load average is
recorded at the start and the end, and a run above 0.5 per core is marked ``"noisy": true`` in
its JSON (and NOISY in the table). ``--threads 1`` and the ``cpu`` columns
then still give comparable numbers. Host syncs, op counts and numerics are exact either way.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script from a checkout: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # load_meter, beside this file

from load_meter import NOISY_PER_CORE, LoadMeter  # noqa: E402
from megatron_fastpath.attention.core_attention import PackedCoreAttention
from megatron_fastpath.attention.rope import apply_rope_cached
from megatron_fastpath.model import (
    ModelConfig,
    build_gpt_model,
    build_transformer_config,
    rope_config_for,
)
from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig, RopeConfig
from megatron_fastpath.sync import SyncSentinel

VARIANTS = ("cache", "rebuild_per_layer", "megatron_thd_rope")
RATIO_DIRECTION = "baseline / ours: > 1 means ours is faster"
UNSLOTH_FWD_ANCHOR = 0.433  # Qwen3-14B QLoRA SFT, forward +43.3% from caching packed metadata


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmark run.

    layers: the L values; tokens: T, packed tokens per batch (the batch fills it exactly);
    num_seqs: sequences in the batch; max_seqs: the cache's static sequence capacity;
    repeats / warmup: timed / untimed steps per variant and L; threads: torch intra-op threads
    (None: torch's default).
    """

    layers: tuple = (4, 16, 28)
    tokens: int = 2048
    num_seqs: int = 40
    max_seqs: int = 64
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 704
    vocab_size: int = 1024
    repeats: int = 5
    warmup: int = 1
    threads: Optional[int] = None
    seed: int = 0

    def __post_init__(self):
        if not self.layers or any(int(n) <= 0 for n in self.layers):
            raise ValueError(f"--layers must be positive ints; got {self.layers}")
        if not (1 <= self.num_seqs <= self.tokens):
            raise ValueError(f"--num-seqs must be in [1, tokens={self.tokens}]; got {self.num_seqs}")
        if self.num_seqs > self.max_seqs:
            raise ValueError(f"--num-seqs={self.num_seqs} exceeds --max-seqs={self.max_seqs}")
        if self.repeats < 1 or self.warmup < 1:
            raise ValueError(
                "--repeats and --warmup must be >= 1 (warmup step 1 is the numerics check)"
            )

    def model(self, num_layers: int) -> ModelConfig:
        return ModelConfig(
            num_layers=num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            vocab_size=self.vocab_size,
        )


QUICK = dict(layers=(1, 3), tokens=64, num_seqs=5, max_seqs=8, hidden_size=64, num_attention_heads=4,
             num_query_groups=2, ffn_hidden_size=128, vocab_size=128, repeats=2, warmup=1)


def packed_lengths(tokens: int, num_seqs: int, seed: int) -> list[int]:
    """Deterministic lengths of ``num_seqs`` sequences summing to exactly ``tokens``
    (cut points drawn without replacement from 1..tokens-1)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, tokens), size=num_seqs - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [tokens]])).astype(int).tolist()


# ---------------------------------------------------------------------------------------------
# Baseline (a): rebuild B in every layer
# ---------------------------------------------------------------------------------------------
class PackedLengths:
    """Holder of the current batch's device lengths tensor ``lengths_N`` [N] int32.

    This is Unsloth's ``packed_seq_lengths`` (the collator's per-sample lengths, handed to every
    attention layer through the model's ``**kwargs``). Megatron's layer call has no such kwarg,
    so the layer spec binds the holder, as ours binds the cache."""

    def __init__(self):
        self.lengths_N: Optional[torch.Tensor] = None


def _megatron_module_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class RebuildPerLayerCoreAttention(_megatron_module_base()):
    """Core attention that rebuilds the packed batch's metadata in every call (baseline a).

    Modelled on Unsloth's packed SDPA path before its per-batch cache, where every attention
    layer called ``get_packed_info_from_kwargs`` and ``build_sdpa_packed_attention_mask``, and on
    Megatron's per-layer RoPE-factor construction. Per call (= per layer, forward) it rebuilds,
    from ``lengths.lengths_N`` (device, [N] int32):

    1. ``lengths_N`` moved to the activations' device (``.to(..., non_blocking=True)``, a no-op
       on CPU), ``cu_seqlens`` [N+1] int32 (zeros + ``cumsum`` into ``[1:]``), and
       ``max_seqlen = int(lengths_N.max().item())``                       -- host read 1;
    2. ``total = int(lengths_N.sum().item())`` to size the mask, checked against T
                                                                        -- host read 2;
    3. per-token positions [T] (reset per sequence): ``arange(T) - repeat_interleave(
       cu_seqlens[:-1], lengths_N, output_size=total)`` (given ``output_size``, so not a
       data-dependent-shape op);
    4. RoPE factors the unpacked way: a [max_seqlen, D] table (``outer(arange(max_seqlen),
       inv_freq)``, ``cat``, ``cos``, ``sin``) gathered per token by the positions,
       -> cos/sin [T, 1, D];
    5. the [T, T] additive block-diagonal causal mask (0 / -inf in the compute dtype, as ours
       and as Unsloth's), one block per sequence as Unsloth builds it: ``full(T, T, -inf)``,
       then for each length in ``lengths_N.tolist()`` (host read 3) a causal block
       (``zeros(n, n)`` with ``-inf`` above the diagonal) written at its offset.
       (``mask_style="vectorized"`` builds it instead from per-token sequence ids, ``eq``, a
       ``tril`` and a ``where``: no ``tolist``, O(1) ops in N, but more [T, T] passes.)

    The mask has ours' dtype and layout, so SDPA runs the same kernel; but every layer builds
    its own, so autograd saves L masks per step where ours saves one. RoPE is then applied with :func:`apply_rope_cached` and attention is the same
    ``scaled_dot_product_attention`` call as :class:`PackedCoreAttention`'s SDPA backend: the
    only difference from ours is the rebuild. Nothing here has a gradient, so backward is
    unchanged. Batches must fill T exactly (as a packing collator without padding produces).

    forward(query, key, value, attention_mask=None, ..., packed_seq_params=None)
        query [T, np, hn], key/value [T, ng, hn] (THD; Megatron's SelfAttention squeezes them
        because it is given ``qkv_format="thd"`` params, whose fields this module ignores)
        -> [T, np*hn].
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        *,
        lengths: PackedLengths,
        rope: RopeConfig,
        mask_style: str = "loop",
    ):
        super().__init__(config=config)
        if mask_style not in ("loop", "vectorized"):
            raise ValueError(f"mask_style must be 'loop' or 'vectorized'; got {mask_style!r}")
        self.lengths = lengths
        self.rope = rope
        self.mask_style = mask_style
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        self.register_buffer("inv_freq", rope.inv_freq(), persistent=False)

    def rebuild(self, t: int, device: torch.device, dtype: torch.dtype):
        """(cos_T1D, sin_T1D, mask_TT) of the current batch, from its device lengths."""
        lengths_N = self.lengths.lengths_N.to(device=device, dtype=torch.int32, non_blocking=True)
        n = lengths_N.shape[0]
        cu_seqlens_N1 = torch.zeros(n + 1, dtype=torch.int32, device=device)
        torch.cumsum(lengths_N, dim=0, dtype=torch.int32, out=cu_seqlens_N1[1:])
        max_seqlen = int(lengths_N.max().item())
        total = int(lengths_N.sum().item())
        if total != t:
            raise ValueError(f"packed lengths sum to {total} but the layer got {t} tokens")

        starts_T = torch.repeat_interleave(cu_seqlens_N1[:-1], lengths_N, output_size=total)
        positions_T = torch.arange(total, dtype=torch.int32, device=device) - starts_T

        table_pos_S = torch.arange(max_seqlen, dtype=torch.float32, device=device)
        freqs_SH = torch.outer(table_pos_S, self.inv_freq)
        emb_SD = torch.cat((freqs_SH, freqs_SH), dim=-1)
        idx_T = positions_T.long()
        cos_T1D = emb_SD.cos()[idx_T].unsqueeze(1).to(dtype)
        sin_T1D = emb_SD.sin()[idx_T].unsqueeze(1).to(dtype)

        if self.mask_style == "loop":
            mask_TT = torch.full((t, t), float("-inf"), dtype=dtype, device=device)
            start = 0
            for length in lengths_N.tolist():
                above = torch.ones((length, length), dtype=torch.bool, device=device).triu_(1)
                mask_TT[start : start + length, start : start + length] = torch.zeros(
                    (length, length), dtype=dtype, device=device
                ).masked_fill_(above, float("-inf"))
                start += length
        else:
            seq_ids_T = torch.repeat_interleave(
                torch.arange(n, device=device), lengths_N, output_size=total
            )
            causal_TT = torch.ones((t, t), dtype=torch.bool, device=device).tril_()
            allowed_TT = (seq_ids_T.unsqueeze(1) == seq_ids_T.unsqueeze(0)) & causal_TT
            mask_TT = torch.zeros((t, t), dtype=dtype, device=device).masked_fill_(
                ~allowed_TT, float("-inf"))
        return cos_T1D, sin_T1D, mask_TT

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("RebuildPerLayerCoreAttention builds its own mask; pass None")
        if query.dim() != 3:
            raise ValueError("pass qkv_format='thd' PackedSeqParams so q/k/v arrive as [T, heads, d]")
        t = query.shape[0]
        cos_T1D, sin_T1D, mask_TT = self.rebuild(t, query.device, query.dtype)
        query = apply_rope_cached(query, cos_T1D, sin_T1D)
        key = apply_rope_cached(key, cos_T1D, sin_T1D)
        out_1HTd = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),
            attn_mask=mask_TT,
            dropout_p=0.0,
            scale=self.softmax_scale,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out_1HTd.squeeze(0).transpose(0, 1).reshape(t, -1)


# ---------------------------------------------------------------------------------------------
# Baseline (b): Megatron's unfused THD RoPE, mask from our cache
# ---------------------------------------------------------------------------------------------
class CacheMaskCoreAttention(PackedCoreAttention):
    """Our SDPA core attention with RoPE off (Megatron's SelfAttention applies it), reading the
    mask from the cache's batch: it is handed Megatron-built ``PackedSeqParams`` (no mask in
    them), so this benchmark-only baseline swaps in the params of the one batch in flight."""

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                               packed_seq_params=self.cache.current.packed_seq_params)


def megatron_packed_seq_params(lengths: Sequence[int], device: torch.device):
    """``PackedSeqParams`` as a Megatron data pipeline builds them: device int32 cu_seqlens and
    the batch's true ``max_seqlen``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens_N1 = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                                 device=device)
    max_seqlen = int(max(lengths))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens_N1, cu_seqlens_kv=cu_seqlens_N1,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def megatron_rotary_pos_emb(rotary, max_seqlen: int) -> torch.Tensor:
    """[max_seqlen, 1, 1, D] angles: ``RotaryEmbedding.get_emb`` without its move to CUDA."""
    freqs_SH = rotary.get_freqs_non_repeated(max_seqlen)
    return torch.cat((freqs_SH, freqs_SH), dim=-1)[:, None, None, :]


# ---------------------------------------------------------------------------------------------
# Model construction and the shared driver
# ---------------------------------------------------------------------------------------------
def _local_spec_with(core_attention, self_attention_module=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    base = get_gpt_layer_local_spec(normalization="RMSNorm")
    attn = base.submodules.self_attention
    attn = dataclasses.replace(
        attn,
        module=self_attention_module or attn.module,
        submodules=dataclasses.replace(attn.submodules, core_attention=core_attention),
    )
    submodules = dataclasses.replace(base.submodules, self_attention=attn)
    return dataclasses.replace(base, submodules=submodules)


@dataclasses.dataclass
class Variant:
    """One variant's model and per-step hooks (prepare -> forward -> backward -> finish)."""

    name: str
    model: torch.nn.Module
    cache: Optional[PackedSeqCache] = None
    lengths_holder: Optional[PackedLengths] = None
    rotary: object = None
    _pb: object = None

    def prepare(self, lengths: Sequence[int], device: torch.device) -> dict:
        """Per-step metadata work; returns the decoder kwargs."""
        if self.name == "cache":
            self._pb = self.cache.set_batch(lengths)
            return dict(packed_seq_params=self._pb.packed_seq_params, rotary_pos_emb=None)
        if self.name == "rebuild_per_layer":
            self.lengths_holder.lengths_N = torch.tensor(lengths, dtype=torch.int32, device=device)
            params = megatron_packed_seq_params(lengths, device)
            return dict(packed_seq_params=params, rotary_pos_emb=None)
        self._pb = self.cache.set_batch(lengths)  # the mask only
        params = megatron_packed_seq_params(lengths, device)
        return dict(packed_seq_params=params,
                    rotary_pos_emb=megatron_rotary_pos_emb(self.rotary, params.max_seqlen_q))

    def finish(self) -> None:
        if self._pb is not None:
            self.cache.release(self._pb)
            self._pb = None


def build_variants(cfg: BenchConfig, num_layers: int, device: torch.device,
                   mask_style: str = "loop") -> dict[str, Variant]:
    """The three variants at L = ``num_layers``, with identical weights."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_fastpath.layer_spec import get_fastpath_layer_spec

    model_cfg = cfg.model(num_layers)
    tcfg = build_transformer_config(model_cfg)
    rope = rope_config_for(model_cfg)
    t = cfg.tokens

    def make(spec):
        return build_gpt_model(tcfg, spec, model_cfg.vocab_size, t).to(device)

    cache = PackedSeqCache(PackedSeqConfig(max_tokens=t, max_seqs=cfg.max_seqs, rope=rope), device)
    torch.manual_seed(cfg.seed)
    ours = make(get_fastpath_layer_spec(cache, backend="sdpa"))
    state = ours.state_dict()

    holder = PackedLengths()
    rebuild = make(_local_spec_with(
        ModuleSpec(module=RebuildPerLayerCoreAttention,
                   params={"lengths": holder, "rope": rope, "mask_style": mask_style}),
        SelfAttention))

    mask_cache = PackedSeqCache(
        PackedSeqConfig(max_tokens=t, max_seqs=cfg.max_seqs, rope=None), device
    )
    megatron = make(_local_spec_with(
        ModuleSpec(module=CacheMaskCoreAttention,
                   params={"cache": mask_cache, "backend": "sdpa", "apply_rope": False}),
        SelfAttention))
    rotary = RotaryEmbedding(kv_channels=tcfg.kv_channels, rotary_percent=model_cfg.rotary_percent,
                             rotary_base=model_cfg.rotary_base, use_cpu_initialization=True)

    for m in (rebuild, megatron):
        res = m.load_state_dict(state, strict=False)
        if res.unexpected_keys or any("_extra_state" not in k for k in res.missing_keys):
            raise RuntimeError(f"weights do not transfer between variants: {res}")
    return {
        "cache": Variant("cache", ours, cache=cache),
        "rebuild_per_layer": Variant("rebuild_per_layer", rebuild, lengths_holder=holder),
        "megatron_thd_rope": Variant("megatron_thd_rope", megatron, cache=mask_cache, rotary=rotary),
    }


def forward_loss(model, tokens_1T, labels_1T, packed_seq_params, rotary_pos_emb=None) -> torch.Tensor:
    """Mean next-token loss: embedding -> decoder -> output layer -> Megatron cross-entropy.
    The same code path as ``GPTModel.forward`` minus its RoPE preprocessing (checked in the
    numerics section), so the caller can hand ``rotary_pos_emb`` to the decoder."""
    hidden_T1H = model.embedding(input_ids=tokens_1T, position_ids=None)
    hidden_T1H = model.decoder(hidden_states=hidden_T1H, attention_mask=None,
                               rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params)
    logits_T1V, _ = model.output_layer(hidden_T1H)
    return model.compute_language_model_loss(labels_1T, logits_T1V).mean()


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------
def _drop_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """One timed step: wall and process-CPU milliseconds of the forward and the whole step."""

    fwd_ms: float
    fwd_bwd_ms: float
    fwd_cpu_ms: float
    fwd_bwd_cpu_ms: float


def timed_step(v: Variant, lengths, tokens_1T, labels_1T, device) -> StepTimes:
    """Time one training step (GC paused): wall clock and process CPU time (all threads)."""
    _drop_grads(v.model)
    gc.collect()
    gc.disable()
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        kwargs = v.prepare(lengths, device)
        loss = forward_loss(v.model, tokens_1T, labels_1T, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1, c1 = time.perf_counter(), time.process_time()
        loss.backward()
        v.finish()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t2, c2 = time.perf_counter(), time.process_time()
    finally:
        gc.enable()
    return StepTimes(1e3 * (t1 - t0), 1e3 * (t2 - t0), 1e3 * (c1 - c0), 1e3 * (c2 - c0))


@dataclasses.dataclass
class Counted:
    """One step observed by SyncSentinel, per phase; ``masks_saved``: distinct [T, T]
    storages autograd saved for backward in the forward (model parameters excluded)."""

    prep: SyncSentinel
    fwd: SyncSentinel
    bwd: SyncSentinel
    masks_saved: int = 0

    @property
    def syncs(self) -> int:
        return self.prep.num_syncs + self.fwd.num_syncs + self.bwd.num_syncs

    def locations(self) -> collections.Counter:
        out = collections.Counter()
        for s in (self.prep, self.fwd, self.bwd):
            out.update(s.by_location())
        return out


def counted_step(v: Variant, lengths, tokens_1T, labels_1T, device) -> Counted:
    _drop_grads(v.model)
    t = tokens_1T.shape[1]
    weights = {p.untyped_storage().data_ptr() for p in v.model.parameters()}
    masks: dict = {}  # storage -> tensor (held, so a storage address is not reused)

    def pack(x):
        ptr = x.untyped_storage().data_ptr()
        if x.dim() >= 2 and tuple(x.shape[-2:]) == (t, t) and ptr not in weights:
            masks.setdefault(ptr, x)
        return x

    with SyncSentinel(name=f"{v.name}:prep") as prep:
        kwargs = v.prepare(lengths, device)
    with SyncSentinel(name=f"{v.name}:fwd") as fwd, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = forward_loss(v.model, tokens_1T, labels_1T, **kwargs)
    with SyncSentinel(name=f"{v.name}:bwd") as bwd:
        loss.backward()
        v.finish()
    _drop_grads(v.model)
    return Counted(prep, fwd, bwd, masks_saved=len(masks))


def numerics(variants: dict[str, Variant], lengths, tokens_1T, labels_1T, device) -> dict:
    """First (warmup) step of every variant: losses and gradients against ``cache``; and the
    driver against GPTModel.forward for ``cache``."""
    losses, grads = {}, {}
    for name, v in variants.items():
        _drop_grads(v.model)
        kwargs = v.prepare(lengths, device)
        loss = forward_loss(v.model, tokens_1T, labels_1T, **kwargs)
        loss.backward()
        v.finish()
        losses[name] = loss.item()
        grads[name] = {n: p.grad.detach().clone() for n, p in v.model.named_parameters()}
    ref = grads["cache"]
    grad_rel = {}
    for name, g in grads.items():
        if g.keys() != ref.keys():
            raise RuntimeError(f"{name}: parameter names differ from cache's")
        grad_rel[name] = max(
            ((g[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30)).item() for k in ref
        )
    ours = variants["cache"]
    with torch.no_grad(), ours.cache.batch(lengths) as pb:
        full = ours.model(tokens_1T, pb.position_ids_1T, None, labels=labels_1T,
                          packed_seq_params=pb.packed_seq_params).mean().item()
    _drop_grads(ours.model)
    loss_tol = 1e-5 * max(1.0, abs(losses["cache"]))
    ok = (all(abs(l - losses["cache"]) <= loss_tol for l in losses.values())
          and all(r <= 1e-4 for r in grad_rel.values()) and abs(full - losses["cache"]) <= loss_tol)
    return {"losses": losses, "max_grad_rel_diff": grad_rel, "gptmodel_forward_loss": full, "ok": ok}


def run(cfg: BenchConfig, mask_style: str = "loop", breakdown: bool = False,
        log=print) -> dict:
    from megatron_fastpath.distributed import init_distributed

    t_start = time.perf_counter()
    meter = LoadMeter().__enter__()
    init_distributed(backend="gloo")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = torch.device("cpu")
    lengths = packed_lengths(cfg.tokens, cfg.num_seqs, cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    tokens_1T = torch.randint(0, cfg.vocab_size, (1, cfg.tokens), generator=gen).to(device)
    labels_1T = torch.randint(0, cfg.vocab_size, (1, cfg.tokens), generator=gen).to(device)
    log(f"packed batch: {cfg.tokens} tokens, {len(lengths)} sequences (min {min(lengths)}, "
        f"median {int(np.median(lengths))}, max {max(lengths)}); model hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads / {cfg.num_query_groups} query groups, ffn "
        f"{cfg.ffn_hidden_size}, vocab {cfg.vocab_size}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; rebuild mask style: {mask_style}; load average "
        f"{meter.load_start:.2f} on {meter.cores} cores")
    if meter.load_start / meter.cores > NOISY_PER_CORE:
        log(f"WARNING: other processes are using the cores (load average above {NOISY_PER_CORE}"
            " per core): times are marked noisy; prefer --threads 1 and compare the cpu columns")

    results, ratios, checks, locations = [], [], [], {}
    for num_layers in cfg.layers:
        t_layer = time.perf_counter()
        variants = build_variants(cfg, num_layers, device, mask_style)
        check = numerics(variants, lengths, tokens_1T, labels_1T, device)
        check["layers"] = num_layers
        checks.append(check)
        for _ in range(cfg.warmup - 1):
            for v in variants.values():
                timed_step(v, lengths, tokens_1T, labels_1T, device)

        counted = {name: counted_step(v, lengths, tokens_1T, labels_1T, device)
                   for name, v in variants.items()}
        oracle_fwd_ops = counted["cache"].fwd.aten_ops

        times = {name: [] for name in variants}
        names = list(variants)
        for r in range(cfg.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                times[name].append(timed_step(variants[name], lengths, tokens_1T, labels_1T, device))

        for name in names:
            c = counted[name]
            meta_step = c.prep.aten_ops + c.fwd.aten_ops - oracle_fwd_ops
            row = {
                "variant": name,
                "layers": num_layers,
                "host_syncs_per_step": c.syncs,
                "mask_tensors_saved_per_step": c.masks_saved,
                "cache_bytes": variants[name].cache.cache_bytes() if variants[name].cache else 0,
                "metadata_ops_per_layer": meta_step / num_layers,
                "metadata_ops_per_step": meta_step,
                "aten_ops_per_step": c.prep.aten_ops + c.fwd.aten_ops + c.bwd.aten_ops,
            }
            for key in ("fwd_ms", "fwd_bwd_ms", "fwd_cpu_ms", "fwd_bwd_cpu_ms"):
                samples = [getattr(st, key) for st in times[name]]
                row[key] = min(samples)
                row[key.replace("_ms", "_ms_all")] = [round(x, 2) for x in samples]
            results.append(row)
            locations[(name, num_layers)] = c.locations()
            if breakdown and name != "cache":
                diff = c.prep.op_counts + c.fwd.op_counts
                diff.subtract(counted["cache"].fwd.op_counts)
                ranked = sorted(diff.items(), key=lambda kv: -abs(kv[1]))
                log(f"  [L={num_layers}] {name} metadata op histogram (vs cache forward): "
                    + ", ".join(f"{k}:{n:+d}" for k, n in ranked if n))
            elif breakdown:
                log(f"  [L={num_layers}] cache set_batch ops: "
                    + ", ".join(f"{k}:{n}" for k, n in c.prep.op_counts.most_common()))
        ours = results[-len(names)]
        for row in results[-len(names) + 1:]:
            ratios.append({
                "layers": num_layers,
                "baseline": row["variant"],
                "fwd_speedup": row["fwd_ms"] / ours["fwd_ms"],
                "fwd_bwd_speedup": row["fwd_bwd_ms"] / ours["fwd_bwd_ms"],
                "fwd_cpu_speedup": row["fwd_cpu_ms"] / ours["fwd_cpu_ms"],
                "fwd_bwd_cpu_speedup": row["fwd_bwd_cpu_ms"] / ours["fwd_bwd_cpu_ms"],
            })
        log(f"L={num_layers:3d} done in {time.perf_counter() - t_layer:6.1f} s "
            f"(numerics {'ok' if check['ok'] else 'MISMATCH'})")
        del variants, counted
        gc.collect()

    meter.__exit__(None, None, None)
    log(meter.line())
    return {
        "config": dataclasses.asdict(cfg) | {"lengths": lengths, "rebuild_mask_style": mask_style,
                                               "torch_threads": torch.get_num_threads(),
                                               "device": str(device)},
        "results": results,
        "ratios": ratios,
        "numerics": checks,
        "anchor": {"source": "Unsloth x NVIDIA blog, Qwen3-14B QLoRA SFT (GPU)",
                   "fwd_gain_from_caching": UNSLOTH_FWD_ANCHOR},
        "sync_locations": {f"{n}@L={l}": dict(c) for (n, l), c in locations.items()},
        "wall_time_s": time.perf_counter() - t_start,
        **meter.report(),
        "ratio_direction": RATIO_DIRECTION,
    }


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def format_report(report: dict) -> str:
    lines = [f"ratios: {RATIO_DIRECTION}; times: min over {report['config']['repeats']} repeats"
             + ("; NOISY run (load above 0.5 per core)" if report["noisy"] else "")]
    hdr = (f"{'variant':<18} {'L':>3} {'host syncs':>10} {'masks':>6} {'cache':>9} {'meta ops':>9} "
           f"{'meta ops':>9} {'fwd ms':>9} {'fwd+bwd ms':>11} {'fwd cpu':>9} {'fwd+bwd cpu':>12}")
    sub = (f"{'':<18} {'':>3} {'/step':>10} {'saved':>6} {'KiB':>9} {'/step':>9} {'/layer':>9} "
           f"{'(min)':>9} {'(min)':>11} {'ms (min)':>9} {'ms (min)':>12}")
    lines += [hdr, sub, "-" * len(hdr)]
    last_l = None
    for r in report["results"]:
        if last_l is not None and r["layers"] != last_l:
            lines.append("")
        last_l = r["layers"]
        lines.append(f"{r['variant']:<18} {r['layers']:>3} {r['host_syncs_per_step']:>10d} "
                     f"{r['mask_tensors_saved_per_step']:>6d} {r['cache_bytes'] / 1024:>9.1f} "
                     f"{r['metadata_ops_per_step']:>9d} {r['metadata_ops_per_layer']:>9.1f} "
                     f"{r['fwd_ms']:>9.1f} {r['fwd_bwd_ms']:>11.1f} {r['fwd_cpu_ms']:>9.1f} "
                     f"{r['fwd_bwd_cpu_ms']:>12.1f}")
    lines.append("")
    lines.append(f"{RATIO_DIRECTION}          [wall]            [process CPU]")
    for q in report["ratios"]:
        lines.append(f"  L={q['layers']:<3d} vs {q['baseline']:<18} fwd x{q['fwd_speedup']:.3f} "
                     f"fwd+bwd x{q['fwd_bwd_speedup']:.3f}   fwd x{q['fwd_cpu_speedup']:.3f} "
                     f"fwd+bwd x{q['fwd_bwd_cpu_speedup']:.3f}")
    ours_vs_a = ", ".join(f"L={q['layers']}: {100 * (q['fwd_speedup'] - 1):+.1f}% wall / "
                          f"{100 * (q['fwd_cpu_speedup'] - 1):+.1f}% cpu"
                          for q in report["ratios"] if q["baseline"] == "rebuild_per_layer")
    lines.append(f"forward gain from caching -- Unsloth anchor (Qwen3-14B QLoRA SFT, GPU): "
                 f"{100 * report['anchor']['fwd_gain_from_caching']:+.1f}%; ours vs "
                 f"rebuild_per_layer here ({report['config']['device']}): {ours_vs_a}")
    lines.append("")
    lines.append("numerics (first step, same weights and batch; fp32):")
    for c in report["numerics"]:
        ls = c["losses"]
        lines.append(
            f"  L={c['layers']:<3d} loss " + "  ".join(f"{k}={v:.7f}" for k, v in ls.items())
            + f"  | GPTModel.forward={c['gptmodel_forward_loss']:.7f}"
            + f"  | max |dloss|={max(abs(v - ls['cache']) for v in ls.values()):.2e}"
            + "  max grad rel diff vs cache: "
            + ", ".join(f"{k}={v:.1e}" for k, v in c["max_grad_rel_diff"].items() if k != "cache")
            + f"  -> {'OK' if c['ok'] else 'MISMATCH'}")
    lines.append("")
    big = max(report["config"]["layers"])
    lines.append(f"host-sync locations per step at L={big}:")
    for key, locs in report["sync_locations"].items():
        if not key.endswith(f"@L={big}"):
            continue
        if not locs:
            lines.append(f"  {key.split('@')[0]}: none")
            continue
        lines.append(f"  {key.split('@')[0]}:")
        for where, n in sorted(locs.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {n:5d} x {_short_path(where)}")
    lines.append(f"wall time {report['wall_time_s']:.1f} s (1-min load average "
                 f"{report['load_average_1min_at_start']:.2f} at the start, "
                 f"{report['load_average_1min_at_end']:.2f} at the end, on {report['cores']} cores"
                 f"{'; NOISY' if report['noisy'] else ''})")
    return "\n".join(lines)


def _short_path(where: str) -> str:
    for marker in ("site-packages/", "/work/main/"):
        if marker in where:
            head, _, tail = where.partition(" at ")
            return f"{head} at {tail.split(marker, 1)[-1]}"
    return where


def parse_args(argv=None) -> tuple[BenchConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", help="L values (default 4 16 28)")
    p.add_argument("--tokens", type=int, help="packed tokens per batch (default 2048)")
    p.add_argument("--num-seqs", type=int, help="sequences in the batch (default 40)")
    p.add_argument("--max-seqs", type=int, help="the cache's sequence capacity (default 64)")
    p.add_argument("--repeats", type=int, help="timed steps per variant and L (default 5)")
    p.add_argument("--warmup", type=int, help="untimed steps per variant and L (default 1)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--seed", type=int)
    p.add_argument("--quick", action="store_true",
                   help="tiny model and batch (CI smoke run, a few seconds)")
    p.add_argument("--rebuild-mask", choices=("loop", "vectorized"), default="loop",
                   help="how baseline (a) builds its per-layer mask (default: Unsloth's loop)")
    p.add_argument("--breakdown", action="store_true", help="print the metadata op histograms")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    fields = dict(QUICK) if args.quick else {}
    for name in ("tokens", "num_seqs", "max_seqs", "repeats", "warmup", "threads", "seed"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.layers:
        fields["layers"] = tuple(args.layers)
    return BenchConfig(**fields), args


def main(argv=None) -> dict:
    cfg, args = parse_args(argv)
    report = run(cfg, mask_style=args.rebuild_mask, breakdown=args.breakdown)
    print(format_report(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    if not all(c["ok"] for c in report["numerics"]):
        print("NUMERICS MISMATCH between variants", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
