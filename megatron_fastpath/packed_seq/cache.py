"""PackedSeqCache: a packed batch's boundary metadata, built once per batch, in static buffers.

Every transformer layer of a packed batch consumes the same B = {lengths, cu_seqlens,
max_seqlen, positions, masks}. The cache derives B on the host (``metadata.py``), moves it with
ONE non-blocking copy from a pinned staging buffer into fixed-capacity device buffers, and
hands every layer the same tensors:

* a Megatron ``PackedSeqParams`` (``qkv_format="thd"``, ``cp_group=None``) whose tensors *are*
  the static buffers -- same ``data_ptr``, shapes and ``max_seqlen_*`` ints on every step, which
  is what Megatron's ``CudaGraphManager`` requires of a kwarg it replays;
* derived structures built once per batch on the device (static-shape ops, no host reads) and
  shared by all layers, with hit/miss counters: per-token RoPE cos/sin, the SDPA block-diagonal
  causal mask, the ``flex_attention`` BlockMask.

Several microbatches can be in flight (pipeline 1F1B runs forward of m+1 before backward of m):
the cache owns ``num_slots`` independent slots; a slot stays reserved from ``set_batch`` until
``release`` (or the end of the ``batch()`` context), so a batch's buffers are never overwritten
while its backward may still read them. Staleness is impossible by construction: nothing is
keyed on object identity of the caller's data -- every ``set_batch`` re-derives B from the values
it is given and bumps a version that derived structures are stamped with.

Shapes: T = ``max_tokens``, S = ``max_seqs``, D = rotary dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from megatron_fastpath.packed_seq.metadata import (
    HostPackedMetadata,
    LengthsLike,
    build_host_metadata,
    record_size,
    resolve_lengths,
    split_record,
)

__all__ = ["RopeConfig", "PackedSeqConfig", "PackedBatch", "PackedSeqCache", "CacheStats"]

# A T x T boolean mask costs T^2 bytes; above this many tokens the SDPA backend is refused.
DEFAULT_SDPA_MASK_MAX_TOKENS = 16384


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings (Llama-style, as Megatron's ``RotaryEmbedding``).

    dim: number of rotated channels per head (``kv_channels * rotary_percent``), even.
    base: rotary base (theta).
    interleaved: rotate (even, odd) pairs instead of the two halves.
    seq_len_interpolation_factor: positions are divided by this (linear scaling), if set.
    llama3_scaling_factor: Llama 3.1 frequency scaling (Megatron's ``rope_scaling=True`` with
        ``rope_scaling_factor``; 8 for Llama 3.1/3.2/3.3), None for none. The low/high
        frequency factors and the original context (1, 4, 8192) are Llama 3.1's and Megatron's.
    """

    dim: int
    base: float = 10000.0
    interleaved: bool = False
    seq_len_interpolation_factor: Optional[float] = None
    llama3_scaling_factor: Optional[float] = None
    llama3_low_freq_factor: float = 1.0
    llama3_high_freq_factor: float = 4.0
    llama3_original_max_position: int = 8192

    def __post_init__(self):
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"RopeConfig.dim must be a positive even number; got {self.dim}")
        if self.llama3_scaling_factor is not None and self.llama3_scaling_factor <= 0:
            raise ValueError("RopeConfig.llama3_scaling_factor must be positive")
        if not self.llama3_low_freq_factor < self.llama3_high_freq_factor:
            raise ValueError("RopeConfig needs llama3_low_freq_factor < llama3_high_freq_factor")

    def inv_freq(self, device=None) -> torch.Tensor:
        """[D/2] float32, exactly as Megatron's RotaryEmbedding computes it (including its
        Llama 3.1 ``_apply_scaling`` when ``llama3_scaling_factor`` is set)."""
        inv = 1.0 / (
            self.base
            ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim)
        )
        if self.llama3_scaling_factor is None:
            return inv
        factor, low, high = (
            self.llama3_scaling_factor, self.llama3_low_freq_factor, self.llama3_high_freq_factor)
        old_len = self.llama3_original_max_position
        wavelen = 2 * math.pi / inv
        # long wavelengths (> old_len / low) are divided by factor, short ones (< old_len / high)
        # kept, and the band between interpolated smoothly.
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)


@dataclasses.dataclass(frozen=True)
class PackedSeqConfig:
    """Static capacities of the cache.

    max_tokens: T, tokens per packed microbatch (the token dimension the model sees).
    max_seqs: S, sequences per packed microbatch.
    max_seqlen: constant bound reported as ``max_seqlen_q/kv`` (default T) -- constant so
        CUDA-graph argument matching holds across batches.
    num_slots: microbatches that may be in flight at once (>= pipeline stages for 1F1B).
    rope: rotary settings; None disables the RoPE structures.
    sdpa_mask_max_tokens: refuse to build a T x T SDPA mask above this T.
    """

    max_tokens: int
    max_seqs: int
    max_seqlen: Optional[int] = None
    num_slots: int = 1
    rope: Optional[RopeConfig] = None
    sdpa_mask_max_tokens: int = DEFAULT_SDPA_MASK_MAX_TOKENS

    def __post_init__(self):
        for name in ("max_tokens", "max_seqs", "num_slots"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"PackedSeqConfig.{name} must be a positive int; got {v!r}")
        if self.max_seqs > self.max_tokens:
            raise ValueError(
                f"max_seqs={self.max_seqs} > max_tokens={self.max_tokens}: every sequence has "
                "at least one token"
            )
        if self.max_seqlen is not None and not (0 < self.max_seqlen <= self.max_tokens):
            raise ValueError(
                f"max_seqlen must be in [1, max_tokens={self.max_tokens}]; got {self.max_seqlen}"
            )

    @property
    def max_seqlen_bound(self) -> int:
        return self.max_seqlen if self.max_seqlen is not None else self.max_tokens


@dataclasses.dataclass
class CacheStats:
    """Counters since construction (or ``reset``); ``per_kind`` maps kind -> [hits, misses]."""

    batches: int = 0
    hits: int = 0
    misses: int = 0
    host_to_device_copies: int = 0
    bytes_copied: int = 0
    per_kind: dict = dataclasses.field(default_factory=dict)

    def snapshot(self) -> "CacheStats":
        return dataclasses.replace(self, per_kind={k: list(v) for k, v in self.per_kind.items()})

    def since(self, before: "CacheStats") -> "CacheStats":
        """Counters accumulated after ``before`` (a snapshot)."""
        return CacheStats(
            batches=self.batches - before.batches,
            hits=self.hits - before.hits,
            misses=self.misses - before.misses,
            host_to_device_copies=self.host_to_device_copies - before.host_to_device_copies,
            bytes_copied=self.bytes_copied - before.bytes_copied,
            per_kind={
                k: [v[0] - before.per_kind.get(k, [0, 0])[0], v[1] - before.per_kind.get(k, [0, 0])[1]]
                for k, v in self.per_kind.items()
            },
        )


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Handle of one packed microbatch held by a cache slot (valid until released).

    packed_seq_params: Megatron PackedSeqParams over the slot's static buffers.
    position_ids_1T: [1, T] per-token positions (reset per sequence) -- the model's position_ids.
    num_seqs / num_tokens / max_seqlen / lengths_N: host values of the real batch.
    """

    slot: int
    version: int
    packed_seq_params: object
    position_ids_1T: torch.Tensor
    num_seqs: int
    num_tokens: int
    max_seqlen: int
    lengths_N: np.ndarray


class _Slot:
    """Static device buffers of one in-flight microbatch."""

    def __init__(self, index: int, cfg: PackedSeqConfig, device: torch.device):
        from megatron.core.packed_seq_params import PackedSeqParams

        self.index = index
        self.busy = False
        self.version = -1
        n = record_size(cfg.max_tokens, cfg.max_seqs)
        self.record_R = torch.zeros(n, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self.staging_R = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        self.copy_done = torch.cuda.Event() if device.type == "cuda" else None
        cu, cu_padded, pos, sid = split_record(self.record_R, cfg.max_tokens, cfg.max_seqs)
        self.cu_seqlens_S1 = cu
        self.cu_seqlens_padded_S1 = cu_padded
        self.position_ids_T = pos
        self.seq_ids_T = sid
        self.position_ids_1T = pos.view(1, -1)
        bound = cfg.max_seqlen_bound
        self.params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=bound,
            max_seqlen_kv=bound,
            cp_group=None,
        )
        # Derived, per kind: the static output buffers (allocated at first build, then reused)
        # and the batch version they were last built for.
        self.derived: dict = {}
        self.derived_version: dict = {}
        self.host: Optional[HostPackedMetadata] = None


class PackedSeqCache:
    """Per-device cache of packed-batch metadata in static (CUDA-graph capturable) buffers.

    Usage::

        cache = PackedSeqCache(PackedSeqConfig(max_tokens=2048, max_seqs=64,
                                               rope=RopeConfig(dim=128)), device)
        with cache.batch(lengths) as pb:                 # one H2D copy, no D2H sync
            loss = model(tokens_1T, pb.position_ids_1T, None,
                         packed_seq_params=pb.packed_seq_params, labels=labels_1T)
            loss.backward()

    Attention modules built by :func:`megatron_fastpath.get_fastpath_layer_spec` read the slot
    behind the ``packed_seq_params`` they receive (or the current batch when they receive None).
    """

    def __init__(self, config: PackedSeqConfig, device: Optional[torch.device] = None):
        self.config = config
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.slots = [_Slot(i, config, self.device) for i in range(config.num_slots)]
        self.stats = CacheStats()
        self._next_version = 0
        self._next_slot = 0
        self._current: Optional[_Slot] = None
        self._builders: dict[str, Callable] = {
            "real_mask": self._build_real_mask,
            "rope_cos_sin": self._build_rope_cos_sin,
            "rope_freqs": self._build_rope_freqs,
            "sdpa_mask": self._build_sdpa_mask,
            "flex_block_mask": self._build_flex_block_mask,
        }
        self._eager: set[str] = set()
        self._causal_TT: Optional[torch.Tensor] = None
        self._arange_T: Optional[torch.Tensor] = None
        self._inv_freq = config.rope.inv_freq(self.device) if config.rope is not None else None

    # ------------------------------------------------------------------ batch lifecycle
    def set_batch(
        self,
        lengths: Optional[LengthsLike] = None,
        *,
        cu_seqlens: Optional[LengthsLike] = None,
    ) -> PackedBatch:
        """Load a packed microbatch given host ``lengths`` (or host ``cu_seqlens``).

        Validates on the host (errors raised before any device work), fills the slot's pinned
        staging record and issues ONE non-blocking host->device copy into its static buffers,
        then builds the derived structures registered as eager. Reserves the slot until
        :meth:`release`.
        """
        host = build_host_metadata(
            resolve_lengths(lengths, cu_seqlens),
            self.config.max_tokens,
            self.config.max_seqs,
            self.config.max_seqlen_bound,
        )
        slot = self._acquire_slot()
        if slot.copy_done is not None and not slot.copy_done.query():
            # The previous batch's copy out of this staging buffer is still queued (rare: a
            # whole forward+backward ran since). Waiting on that event is not a D2H transfer.
            slot.copy_done.synchronize()
        slot.staging_R.copy_(torch.from_numpy(host.record_R))  # host -> pinned host
        slot.record_R.copy_(slot.staging_R, non_blocking=True)
        if slot.copy_done is not None:
            slot.copy_done.record()
        self._next_version += 1
        slot.version = self._next_version
        slot.host = host
        self._current = slot
        self.stats.batches += 1
        self.stats.host_to_device_copies += 1
        self.stats.bytes_copied += slot.record_R.numel() * slot.record_R.element_size()
        for kind in sorted(self._eager):
            self.get(kind, slot=slot)
        return self._handle(slot)

    def release(self, batch: PackedBatch) -> None:
        """Mark the batch's slot reusable (call after its backward has been issued)."""
        slot = self.slots[batch.slot]
        if slot.version != batch.version or not slot.busy:
            raise RuntimeError(
                f"PackedBatch(slot={batch.slot}, version={batch.version}) was already released"
            )
        slot.busy = False

    @contextlib.contextmanager
    def batch(self, lengths: Optional[LengthsLike] = None, *, cu_seqlens=None) -> Iterator[PackedBatch]:
        """``set_batch`` + ``release`` around a block holding the microbatch's forward+backward."""
        pb = self.set_batch(lengths, cu_seqlens=cu_seqlens)
        try:
            yield pb
        finally:
            self.release(pb)

    def _acquire_slot(self) -> _Slot:
        n = len(self.slots)
        for k in range(n):
            slot = self.slots[(self._next_slot + k) % n]
            if not slot.busy:
                slot.busy = True
                self._next_slot = (slot.index + 1) % n
                return slot
        raise RuntimeError(
            f"all {n} PackedSeqCache slots hold microbatches still in flight; release finished "
            "batches (cache.release / the cache.batch() context) or raise "
            "PackedSeqConfig.num_slots to the number of microbatches in flight "
            "(the pipeline depth for 1F1B)"
        )

    # ------------------------------------------------------------------ lookup by layers
    @property
    def current(self) -> PackedBatch:
        slot = self._require_current()
        return self._handle(slot)

    @staticmethod
    def _handle(slot: _Slot) -> PackedBatch:
        h = slot.host
        return PackedBatch(
            slot=slot.index,
            version=slot.version,
            packed_seq_params=slot.params,
            position_ids_1T=slot.position_ids_1T,
            num_seqs=h.num_seqs,
            num_tokens=h.num_tokens,
            max_seqlen=h.max_seqlen,
            lengths_N=h.lengths_N,
        )

    def _require_current(self) -> _Slot:
        if self._current is None or not self._current.busy:
            raise RuntimeError(
                "no packed batch is loaded: call cache.set_batch(lengths) (or use cache.batch()) "
                "before the forward pass"
            )
        return self._current

    def slot_for(self, packed_seq_params=None) -> _Slot:
        """The slot behind ``packed_seq_params`` (the current batch when None).

        Params that are not this cache's static buffers are refused: reading boundaries from
        arbitrary device tensors would need a device-to-host sync."""
        if packed_seq_params is None:
            return self._require_current()
        for slot in self.slots:
            if packed_seq_params is slot.params or (
                packed_seq_params.cu_seqlens_q is slot.cu_seqlens_S1
            ):
                if not slot.busy:
                    raise RuntimeError(
                        f"packed_seq_params of cache slot {slot.index} were used after the batch "
                        "was released"
                    )
                return slot
        raise ValueError(
            "packed_seq_params were not produced by this PackedSeqCache; load the batch with "
            "cache.set_batch(lengths or cu_seqlens) and pass batch.packed_seq_params (or None)"
        )

    # ------------------------------------------------------------------ derived structures
    def register(self, kind: str, eager: bool = True) -> None:
        """Declare that a consumer needs ``kind``; eager kinds are built in ``set_batch``."""
        base = kind.split(":")[0]
        if base not in self._builders:
            raise ValueError(f"unknown derived kind {kind!r}; known: {sorted(self._builders)}")
        if base in ("rope_cos_sin", "rope_freqs") and self.config.rope is None:
            raise ValueError("RoPE requested but PackedSeqConfig.rope is None")
        if base == "sdpa_mask":
            self._check_sdpa_size()
        if eager:
            self._eager.add(kind)

    def get(self, kind: str, packed_seq_params=None, *, slot: Optional[_Slot] = None):
        """The derived structure ``kind`` of the batch behind ``packed_seq_params``.

        Built on the first request for a batch (a miss) into static buffers, reused by every
        later request for the same batch (a hit)."""
        slot = slot if slot is not None else self.slot_for(packed_seq_params)
        counts = self.stats.per_kind.setdefault(kind, [0, 0])
        if slot.derived_version.get(kind) == slot.version:
            self.stats.hits += 1
            counts[0] += 1
            return slot.derived[kind]
        base, _, arg = kind.partition(":")
        builder = self._builders.get(base)
        if builder is None:
            raise ValueError(f"unknown derived kind {kind!r}; known: {sorted(self._builders)}")
        slot.derived[kind] = builder(slot, slot.derived.get(kind), arg)
        slot.derived_version[kind] = slot.version
        self.stats.misses += 1
        counts[1] += 1
        return slot.derived[kind]

    # Convenience accessors used by the attention backends.
    def real_token_mask(self, packed_seq_params=None) -> torch.Tensor:
        """[T] bool: True on real tokens, False on trailing padding."""
        return self.get("real_mask", packed_seq_params)

    def rope_cos_sin(self, packed_seq_params=None, dtype=torch.float32):
        """(cos_T1D, sin_T1D) per-token RoPE factors in ``dtype``."""
        return self.get(f"rope_cos_sin:{_dtype_name(dtype)}", packed_seq_params)

    def sdpa_mask(self, packed_seq_params=None) -> torch.Tensor:
        """[T, T] bool, True = may attend: same sequence and causal (padding attends itself)."""
        return self.get("sdpa_mask", packed_seq_params)

    def flex_block_mask(self, packed_seq_params=None):
        """``torch.nn.attention.flex_attention.BlockMask`` of the block-diagonal causal mask."""
        return self.get("flex_block_mask", packed_seq_params)

    # builders: static-shape device ops writing into the slot's static buffers
    def _build_real_mask(self, slot: _Slot, out, _arg):
        out = out if out is not None else torch.empty_like(slot.seq_ids_T, dtype=torch.bool)
        return torch.ge(slot.seq_ids_T, 0, out=out)

    def _rope_emb_TD(self, slot: _Slot) -> torch.Tensor:
        """[T, D] float32 rotation angles of every token (position within its sequence)."""
        rope = self.config.rope
        if rope is None:
            raise ValueError("RoPE requested but PackedSeqConfig.rope is None")
        pos_T = slot.position_ids_T.to(torch.float32)
        if rope.seq_len_interpolation_factor is not None:
            pos_T = pos_T / rope.seq_len_interpolation_factor
        freqs_TH = torch.outer(pos_T, self._inv_freq)  # [T, D/2]
        if rope.interleaved:
            emb_TD = torch.stack((freqs_TH, freqs_TH), dim=-1).flatten(-2)
        else:
            emb_TD = torch.cat((freqs_TH, freqs_TH), dim=-1)
        return emb_TD

    def _build_rope_freqs(self, slot: _Slot, out, _arg):
        """[T, 1, 1, D] float32 angles: the ``freqs`` of TE's fused RoPE in ``sbhd`` layout
        (one "sequence position" per packed token, so no cu_seqlens are needed)."""
        emb_TD = self._rope_emb_TD(slot)
        if out is None:
            out = torch.empty((emb_TD.shape[0], 1, 1, emb_TD.shape[1]), device=self.device)
        out.copy_(emb_TD[:, None, None, :])
        return out

    def _build_rope_cos_sin(self, slot: _Slot, out, dtype_name):
        dtype = getattr(torch, dtype_name or "float32")
        emb_TD = self._rope_emb_TD(slot)
        if out is None:
            shape = (emb_TD.shape[0], 1, emb_TD.shape[1])
            out = (
                torch.empty(shape, dtype=dtype, device=self.device),
                torch.empty(shape, dtype=dtype, device=self.device),
            )
        cos_T1D, sin_T1D = out
        cos_T1D.copy_(torch.cos(emb_TD).unsqueeze(1))
        sin_T1D.copy_(torch.sin(emb_TD).unsqueeze(1))
        return out

    def _check_sdpa_size(self):
        t = self.config.max_tokens
        if t > self.config.sdpa_mask_max_tokens:
            raise ValueError(
                f"the SDPA backend needs a {t}x{t} mask ({t * t / 2**20:.0f} MiB) per batch, above "
                f"the limit sdpa_mask_max_tokens={self.config.sdpa_mask_max_tokens}; use the "
                "'flex', 'flash' or 'te' backend (no dense mask) or raise the limit"
            )

    def _build_sdpa_mask(self, slot: _Slot, out, _arg):
        """mask[i, j] = start(i) <= j <= i, with start(i) = i - position(i) the first token of
        i's sequence. Sequences are contiguous, so this is "same sequence and causal"; a padding
        token has position 0, so its row is the diagonal alone (no fully masked row). Two T x T
        ops per batch (compare against the constant causal mask)."""
        self._check_sdpa_size()
        t = slot.position_ids_T.shape[0]
        if out is None:
            out = torch.empty((t, t), dtype=torch.bool, device=self.device)
        if self._causal_TT is None:  # constants, shared by all slots
            self._causal_TT = torch.ones((t, t), dtype=torch.bool, device=self.device).tril_()
            self._arange_T = torch.arange(t, dtype=torch.int32, device=self.device)
        start_T1 = (self._arange_T - slot.position_ids_T).unsqueeze(1)
        torch.ge(self._arange_T.unsqueeze(0), start_T1, out=out)
        return out.logical_and_(self._causal_TT)

    def _build_flex_block_mask(self, slot: _Slot, out, _arg):
        from torch.nn.attention.flex_attention import create_block_mask

        sid_T = slot.seq_ids_T

        def packed_causal(b, h, q_idx, kv_idx):
            same = sid_T[q_idx] == sid_T[kv_idx]
            return (same & (q_idx >= kv_idx)) | (q_idx == kv_idx)

        t = sid_T.shape[0]
        return create_block_mask(packed_causal, None, None, t, t, device=self.device)

    # ------------------------------------------------------------------ telemetry
    def reset_stats(self) -> None:
        self.stats = CacheStats()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
