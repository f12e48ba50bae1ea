"""K LoRA adapters on one frozen linear, all trained in one grouped pass over a packed batch.

:class:`MultiLoRALinear` is :class:`~megatron_fastpath.lora.adapter.LoRALinear` with a stack of
K adapters: each token of the packed batch goes through its own adapter a,
``base(x) + scale * B_a(A_a(dropout(x)))``. The batch says which adapter each token trains
(``PackedSeqConfig(num_adapters=K)``, ``cache.set_batch(lengths, adapters=[...])``): its params
carry the tokens sorted by adapter and the group ends, built on the host
(:mod:`megatron_fastpath.packed_seq.adapters`). The adapter pass is then, for every K::

    x_R = where(real, x_T, 0).index_select(0, order_T)   # tokens grouped by adapter
    h_R = torch._grouped_mm(x_R, A^T [K, in, r], offs=offsets_K)
    y_R = torch._grouped_mm(h_R, B^T [K, r, out], offs=offsets_K)
    delta_T = scale * y_R.index_select(0, inverse_T)     # back to packed order

static shapes, group sizes on the device, no host read (as the MoE experts,
:mod:`megatron_fastpath.moe.experts`; ``torch._grouped_mm`` is sync-free on CUDA for bf16 on
sm90 / sm100 only, :func:`~megatron_fastpath.moe.experts.grouped_mm_sync_free_refusal`). The
padding tail is the last group's slack with a zeroed input: its delta is exactly 0 and it adds
nothing to any gradient.

Parameters: ``lora_A`` [K, r, in_local] and ``lora_B`` [K, out_local, r], one stacked
``Parameter`` each; adapter k is the slice ``lora_A[k]`` / ``lora_B[k]``, laid out as the
single-adapter ``LoRALinear``'s ``lora_A`` / ``lora_B`` (and PEFT's ``lora_A.weight`` /
``lora_B.weight``). Stacked, because the grouped GEMM reads one [K, ...] tensor: per-adapter
parameters would be stacked by a copy every step (forward and backward). Per-adapter gradient
norms, clipping and optimizer state are the slices of the stacked tensors and of their
gradients (``grad[k]``). Every adapter has the same rank (the stack is [K, r, ...]; differing
ranks would need padding to the largest).

Tensor and sequence parallelism shard A and B as the single adapter does, on the same
dimensions behind the adapter axis. The per-token collectives act on h (rank r); under sequence
parallelism a shard's tokens are grouped by a sort of the shard's adapter ids on the device
(static shapes, no host read).

Which batch a linear serves: Megatron calls a layer's linears without the ``packed_seq_params``;
:func:`adapter_routed_layer` (installed by ``with_lora(..., adapters=...)``) makes the
``TransformerLayer`` hold the params it is given for the calls of its own forward
(:func:`adapter_routing`), so a CUDA-graph capture (Megatron calls the layer with its static
input copies) and a recompute (the layer's forward again) read the params of their own call.
A graph must cover the whole layer (the main job's ``layers`` / ``full_iteration`` scopes); graphs
of parts of a layer (Megatron's ``cuda_graph_modules`` attn / mlp / ...) are refused at
construction, and so is Megatron's selective ``mlp`` recompute on adapted MLP linears (it re-runs
the MLP in backward, outside the layer's forward).

Shape letters: T tokens (S x B of [S, B, H]), K adapters, r rank, R rows of the grouped buffer.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
from typing import Iterator, Optional

import torch

from megatron_fastpath.lora.adapter import LoRALinear, _tp_world_and_rank
from megatron_fastpath.moe.experts import grouped_mm_leaks_empty_group_grads, mask_empty_group_grads

__all__ = ["MultiLoRALinear", "adapter_names", "adapter_routed_layer", "adapter_routing"]


class _Routing(threading.local):
    def __init__(self):
        self.stack: list = []


_ROUTING = _Routing()


@contextlib.contextmanager
def adapter_routing(params) -> Iterator[None]:
    """The packed batch (``packed_seq_params``) the multi-adapter linears called inside the
    block serve. Nested blocks stack; the layer installed by :func:`adapter_routed_layer` opens
    one around its forward."""
    _ROUTING.stack.append(params)
    try:
        yield
    finally:
        _ROUTING.stack.pop()


def _refuse_missing_adapters(params) -> None:
    if params is None or getattr(params, "adapter_order_T", None) is None:
        raise ValueError(
            "a multi-adapter LoRA layer needs its batch's adapters: build the cache with "
            "PackedSeqConfig(num_adapters=K), load the batch with set_batch(lengths, "
            "adapters=[...]) and pass its packed_seq_params to the model")


@functools.lru_cache(maxsize=None)
def adapter_routed_layer(layer_cls: type) -> type:
    """``layer_cls`` (a ``TransformerLayer`` class) whose forward opens
    :func:`adapter_routing` with its ``packed_seq_params`` keyword, refusing (at the layer's
    entry, before its device work) params without adapters. One subclass per class; a routed
    class is returned as it is."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if not (isinstance(layer_cls, type) and issubclass(layer_cls, TransformerLayer)):
        raise TypeError(f"multi-adapter LoRA routes TransformerLayer subclasses, got {layer_cls!r}")
    if getattr(layer_cls, "_routes_adapters", False):
        return layer_cls

    def forward(self, *args, **kwargs):
        params = kwargs.get("packed_seq_params")
        _refuse_missing_adapters(params)
        with adapter_routing(params):
            return super(routed, self).forward(*args, **kwargs)

    routed = type(f"AdapterRouted{layer_cls.__name__}", (layer_cls,),
                  {"forward": forward, "_routes_adapters": True, "__module__": __name__,
                   "__doc__": f"{layer_cls.__name__} serving its packed batch's adapters."})
    return routed


def adapter_names(adapters) -> tuple:
    """``adapters`` (a count K >= 1 or a list of distinct names) as K names ("0", "1", ... for a
    count); refused (one line) otherwise."""
    if isinstance(adapters, bool) or adapters is None:
        raise ValueError(f"adapters must be a count K >= 1 or a list of names; got {adapters!r}")
    if isinstance(adapters, int):
        if adapters < 1:
            raise ValueError(f"adapters must be a count K >= 1 or a list of names; got {adapters}")
        return tuple(str(k) for k in range(adapters))
    if isinstance(adapters, str):
        adapters = [a.strip() for a in adapters.split(",") if a.strip()]
    names = tuple(str(a) for a in adapters)
    if not names:
        raise ValueError("adapters: an empty list; name at least one adapter (K >= 1)")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"adapters: names must be distinct; {dup} given more than once")
    return names


def _partial_graph_modules(config) -> list:
    """The parts of a layer Megatron's config captures in graphs of their own (attn, mlp, ...):
    ``cuda_graph_modules`` (0.19) / ``cuda_graph_scope`` (0.16); [] for whole layers or none."""
    if config is None or getattr(config, "cuda_graph_impl", "none") in (None, "none", "full_iteration"):
        return []
    scope = getattr(config, "cuda_graph_modules", None)
    if scope is None:
        scope = getattr(config, "cuda_graph_scope", None)
    if scope is None or isinstance(scope, (str, enum.Enum)):
        scope = [] if scope is None else [scope]
    names = [s.name if isinstance(s, enum.Enum) else str(s) for s in scope]
    return [n for n in names if n not in ("full", "full_iteration")]


class MultiLoRALinear(LoRALinear):
    """A Megatron linear plus K LoRA adapters of one rank (see the module docstring).

    Args:
        *args, **kwargs: the base linear's constructor arguments (Megatron passes them).
        base, lora, parallel: as :class:`LoRALinear`.
        target: the Megatron name of the adapted linear (``linear_fc1``, ...; from the spec).
        adapters: the adapters' names (:func:`adapter_names`); K = their number, the index of
            a name is its adapter index in the batch.
    """

    def __init__(self, *args, base: type, lora, parallel: str, adapters: tuple,
                 target: str = "", **kwargs):
        self.adapter_names = adapter_names(adapters)
        config = kwargs.get("config")
        partial = _partial_graph_modules(config)
        if partial:
            raise ValueError(
                f"multi-adapter LoRA with CUDA graphs of parts of a layer ({partial}): such a "
                "graph bakes in the batch its capture saw; capture whole layers "
                "(cuda_graph_modules / cuda_graph_scope = []) or the full iteration")
        if (target in ("linear_fc1", "linear_fc2")
                and getattr(config, "recompute_granularity", None) == "selective"
                and "mlp" in (getattr(config, "recompute_modules", None) or ())):
            raise ValueError(
                f"multi-adapter LoRA on {target} with the selective 'mlp' recompute: the MLP is "
                "recomputed in backward outside its layer's forward, where no batch routes its "
                "tokens to their adapters; drop 'mlp' from recompute_modules or recompute whole "
                "layers (recompute_granularity='full')")
        super().__init__(*args, base=base, lora=lora, parallel=parallel, **kwargs)
        itemsize = self.lora_A.element_size()
        k, r, in_local = self.lora_A.shape
        for what, v in (("rank", r), ("input width", in_local), ("output width", self.lora_B.shape[1])):
            if (v * itemsize) % 16:
                raise ValueError(
                    f"multi-adapter LoRA runs torch._grouped_mm, which needs 16-byte aligned rows:"
                    f" the {what} {v} must be a multiple of {16 // itemsize} for "
                    f"{self.lora_A.dtype}; choose such a LoRA rank")
        self.tp_rank = 0 if self.tp_size == 1 else _tp_world_and_rank(self.base)[1]

    @property
    def num_adapters(self) -> int:
        return len(self.adapter_names)

    def _adapter_parameters(self, weight, tp: int, tp_rank: int, dtype) -> tuple:
        """(A [K, r, in_local], B [K, out_local, r]): adapter k drawn as the single adapter's
        (Kaiming-uniform A over the full input, zero B), one after another."""
        pairs = [super(MultiLoRALinear, self)._adapter_parameters(weight, tp, tp_rank, dtype)
                 for _ in self.adapter_names]
        return (torch.nn.Parameter(torch.stack([a.data for a, _ in pairs])),
                torch.nn.Parameter(torch.stack([b.data for _, b in pairs])))

    # ------------------------------------------------------------------ the grouped pass
    def _batch(self):
        """The params of the batch this call serves, checked on the host."""
        if not _ROUTING.stack:
            raise ValueError(
                "a multi-adapter LoRA linear serves the batch its layer is given: build the "
                "layer with with_lora(spec, cfg, adapters=...) (or call it inside "
                "adapter_routing(packed_seq_params))")
        params = _ROUTING.stack[-1]
        _refuse_missing_adapters(params)
        if params.adapter_offsets_K.shape[0] != self.num_adapters:
            raise ValueError(
                f"the batch carries {params.adapter_offsets_K.shape[0]} adapters, this layer has "
                f"{self.num_adapters} ({', '.join(self.adapter_names)}): build the cache with "
                f"PackedSeqConfig(num_adapters={self.num_adapters})")
        return params

    def _shard_plan(self, params, tokens: int):
        """(real_T1, order_T, inverse_T, offsets_K) of this TP rank's sequence shard: its
        tokens sorted by adapter on the device (static shapes, no host read)."""
        k = self.num_adapters
        ids_T = params.adapter_ids_T.narrow(0, self.tp_rank * tokens, tokens).long()
        order_T = torch.sort(ids_T, stable=True).indices
        inverse_T = torch.empty_like(order_T).scatter_(
            0, order_T, torch.arange(tokens, device=ids_T.device))
        counts = torch.zeros(k + 1, dtype=torch.int64, device=ids_T.device)
        counts.scatter_add_(0, ids_T, torch.ones_like(ids_T))
        ends = torch.cumsum(counts[:k], 0, dtype=torch.int32)
        offsets_K = torch.cat([ends[:-1], ends.new_full((1,), tokens)])
        return (ids_T < k).unsqueeze(1), order_T, inverse_T, offsets_K

    def _full_plan(self, params, tokens: int):
        if params.adapter_order_T.shape[0] != tokens:
            raise ValueError(
                f"the adapter's input has {tokens} tokens, the batch {params.adapter_order_T.shape[0]}:"
                " a multi-adapter LoRA linear takes the packed batch's [T, 1, H] activations")
        return ((params.adapter_ids_T < self.num_adapters).unsqueeze(1), params.adapter_order_T,
                params.adapter_inverse_T, params.adapter_offsets_K)

    @staticmethod
    def _weight(param, plan) -> torch.Tensor:
        """[K, out, in] ``param`` as the grouped GEMM's [K, in, out] operand for ``plan``'s
        groups (their empty groups' gradients masked where torch._grouped_mm leaks them)."""
        w = param.transpose(1, 2)
        if torch.is_grad_enabled() and grouped_mm_leaks_empty_group_grads(w.device):
            offsets_K = plan[3]
            (w,) = mask_empty_group_grads(
                (w,), torch.diff(offsets_K, prepend=offsets_K.new_zeros(1)))
        return w

    @staticmethod
    def _grouped(x_T, w, plan) -> torch.Tensor:
        """x_T [T, in] through each token's adapter weight w [K, in, out], in packed order."""
        real_T1, order_T, inverse_T, offsets_K = plan
        x_R = torch.where(real_T1, x_T, 0).index_select(0, order_T)
        return torch._grouped_mm(x_R, w, offs=offsets_K).index_select(0, inverse_T)

    def adapter(self, x: torch.Tensor) -> torch.Tensor:
        """delta = scale * B_a(A_a(dropout(x))) per token: [S, B, in_local] -> [S, B, out_local]."""
        params = self._batch()
        lead, width = x.shape[:-1], x.shape[-1]
        x_T = x.reshape(-1, width)
        if self.dropout is not None:
            with self._dropout_rng():
                x_T = self.dropout(x_T)
        x_T = x_T.to(self.lora_A.dtype)
        if not self.sequence_parallel:  # one sort for both GEMMs; the TP collective per row
            plan = self._full_plan(params, x_T.shape[0])
            real_T1, order_T, inverse_T, offsets_K = plan
            x_R = torch.where(real_T1, x_T, 0).index_select(0, order_T)
            h_R = torch._grouped_mm(x_R, self._weight(self.lora_A, plan), offs=offsets_K)
            if self.tp_size > 1:
                h_R = self._between_a_and_b(h_R)
            y_R = torch._grouped_mm(h_R, self._weight(self.lora_B, plan), offs=offsets_K)
            y_T = y_R.index_select(0, inverse_T)
        else:  # column: A on this shard's tokens; row: B on them (see the module docstring)
            column = self.parallel == "column"
            plan_a = (self._shard_plan if column else self._full_plan)(params, x_T.shape[0])
            h_T = self._grouped(x_T, self._weight(self.lora_A, plan_a), plan_a)
            h_T = self._between_a_and_b(h_T)
            plan_b = (self._full_plan if column else self._shard_plan)(params, h_T.shape[0])
            y_T = self._grouped(h_T, self._weight(self.lora_B, plan_b), plan_b)
        out_lead = lead if not self.sequence_parallel else (y_T.shape[0] // lead[-1], lead[-1])
        return (y_T * self.scale).view(*out_lead, y_T.shape[-1])

    # ------------------------------------------------------------------ merge
    @torch.no_grad()
    def merged_weight_delta(self, adapter: Optional[int] = None) -> torch.Tensor:
        """scale * B_k @ A_k of adapter ``adapter`` (an index) in the base weight's local shape."""
        if adapter is None or not 0 <= adapter < self.num_adapters:
            raise ValueError(f"merged_weight_delta(adapter=k) needs an adapter index in "
                             f"[0, {self.num_adapters}); got {adapter!r}")
        return (self.lora_B[adapter].float() @ self.lora_A[adapter].float() * self.scale).to(
            self.base.weight.dtype)

    def merge(self) -> None:
        raise ValueError(
            f"cannot merge {self.num_adapters} adapters into one shared base weight: each "
            "adapter is its own model; take one adapter's merged_weight_delta(adapter=k) instead")
