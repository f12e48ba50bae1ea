"""Fake ``DotProductAttention`` (TE v2.10 ``pytorch/attention/dot_product_attention/
dot_product_attention.py``; "dpa.py:N" below, "utils.py:N" its ``utils.py``, "backends.py:N"
its ``backends.py``, all at tag v2.10), for the calls Megatron-Core 0.16.1's
``TEDotProductAttention`` makes (megatron/core/extensions/transformer_engine.py:1140-1434).

What it is: a ``TransformerEngineBaseModule`` (dpa.py:154), so ``prepare_forward`` (num_gemms=3,
dpa.py:1003-1008), the FP8 metadata and the pickled ``_extra_state`` are the fake base's, with
TE's overrides of ``init_fp8_metadata`` / ``set_meta_tensor`` (dpa.py:570-796: 3 "GEMMs", i.e.
9 forward and 6 backward per-tensor scaling slots). Constructor: TE 2.10's keywords (any other:
``TypeError``) and its checks. Forward: TE's checks in TE's order, TE's backend selection
reduced to this fake's world (``utils.get_attention_backend``: sm90, cuDNN 9.15, no flash-attn),
then one computation for every backend -- scores and softmax in float32 (as FusedAttention's
kernels and Unfused's fp32 softmax do), TE's masks (causal top-left or bottom-right, sliding
window, padding from ``attention_mask`` with padded query rows zeroed as backends.py:502-503,
arbitrary), GQA by ``repeat_interleave`` (backends.py:363-372), post / pre-scale bias, dropout
inside the RNG tracker's ``fork`` (dpa.py:382-388, backends.py:511-512), the output cast to the
inputs' dtype as [s, b, h*d] (sbhd) or [b, s, h*d] (bshd) (backends.py:541-553). Device-only:
no ``.item()`` / ``.tolist()`` / host read, so the fake CUDA graph captures it.

FP8 attention (the recipe's ``fp8_dpa``, Megatron's ``fp8_dot_product_attention``): TE runs it
only on FusedAttention's FP8 sub-backend (utils.py:468-480 turn off FlashAttention 2 and
Unfused -- unless ``NVTE_UnfusedDPA_Emulate_FP8=1`` -- and FA3 for training; utils.py:484-487:
current scaling only on sm100+), whose cuDNN rule on the fake's sm90 (fused_attn.cpp:230-265)
takes bf16 / fp16 q/k/v in sbhd / bshd, no bias, no_mask / causal / padding / padding_causal,
head dims % 16 and, for training, d_qk = d_v = 128. Where TE has it, the fake emulates it as TE's
own FP8 emulation does (backends.py:157-204 ``FP8EmulationFunc`` and its uses at
backends.py:412-419, 465-469, 529-533, 568-576): forward q/k/v quantised together with the
QKV slot (META_QKV = forward slot 2), the softmax output with the S slot (8), the output with
the O slot (3); backward dO (backward slot 3), dP (5) and dq/dk/dv together (0)
(cpp_extensions/fused_attn.py:106-111), each quantise-dequantise being the fake Linear's
(``quantization.quantize``: delayed scaling records the amax and uses the slot's scale). Where
TE has no backend it raises TE's ``ValueError`` ("No dot product attention backend is
available ..."). Float8CurrentScaling with fp8_dpa on sm90: no backend (the error);
MXFP8 / block scaling with fp8_dpa: TE's assertion (dpa.py:670-673).

Context parallelism (a CP group of more than one rank; ``cp_comm_type`` "p2p", "all_gather",
"a2a" or "a2a+p2p" -- context_parallel.py:4074-4108, "cp.py:N" below): TE's backend rule
(utils.py:762-831: FusedAttention alone), its asserts (backends.py:1796-1799, 1855-1858 and
attn_forward_func_with_cp's, cp.py:3986-4050, with each comm type's own), then one
computation for every comm type: each rank holds the load-balanced chunks r and 2*cp-1-r of
the sequence (TE's DualChunkSwap, cp.py:3926-3951, Megatron's ``get_batch_on_this_cp_rank``);
K and V are all-gathered (backward: the owner's gradient summed over the group), put in
sequence order, and the local queries attend at their global positions -- the attention a
CP-1 run gives those queries. FP8 attention as at CP 1, except "all_gather", which TE runs in
high precision (fp8 is not passed to it, cp.py:4088-4092); the max logit is all-reduced
(MAX, cp.py:1801-1804, 2997-3000). An attention bias at "p2p" is not stood in.

Not stood in (``NotImplementedError`` naming the fake): qkv_format "thd" (with or without CP),
KV caching (``inference_params``), ALiBi, softmax types
other than "vanilla", ``fp8_output`` (FP8 MHA), ``NVTE_DPA_FP8_RECIPE`` recipe switching,
Unfused FP8 emulation (``NVTE_UnfusedDPA_Emulate_FP8=1``). Not modelled: ``assert q.is_cuda``
(dpa.py:1041-1043; the fake runs on a CPU by design), ``get_qkv_layout``'s memory-layout
analysis (dpa.py:1175-1205), ``checkpoint_core_attention``'s recompute (computed once:
the same values), the apply_qk_layer_scaling of fp16 Unfused.
"""

from __future__ import annotations

import math
import os
import warnings
from contextlib import nullcontext
from typing import Callable, List, Optional, Tuple, Union

import torch

from ....common.recipe import DelayedScaling, Recipe
from ... import graph as te_graph
from ...constants import AttnBiasTypes, AttnMaskTypes, AttnTypes
from ...distributed import (
    CudaRNGStatesTracker,
    get_distributed_world_size,
    graph_safe_rng_available,
    set_all_rng_states,
)
from ...module.base import TransformerEngineBaseModule
from ...quantization import FP8GlobalStateManager, make_recipe_state, quantize
from . import utils as dpa_utils

# dpa.py:143-148, read at import as TE reads them
_dpa_fp8_recipe = os.getenv("NVTE_DPA_FP8_RECIPE", "")
_dpa_fp8ds_amax_algo = os.getenv("NVTE_DPA_FP8DS_AMAX_ALGO", "most_recent")
_dpa_fp8ds_amax_histlen = int(os.getenv("NVTE_DPA_FP8DS_AMAX_HISTLEN", "1"))
_dpa_fp8ds_reduce_amax = os.getenv("NVTE_DPA_FP8DS_REDUCE_AMAX", "1") == "1"

# cpp_extensions/fused_attn.py:106-111: tex.FP8FwdTensors / FP8BwdTensors slots
META_QKV, META_O, META_S = 2, 3, 8  # GEMM1_OUTPUT, GEMM2_INPUT, GEMM3_OUTPUT
META_DQKV, META_DO, META_DP = 0, 3, 5  # GRAD_OUTPUT1, GRAD_INPUT2, GRAD_INPUT3


def _not_stood_in(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"fake transformer_engine: DotProductAttention with {what} is not stood in (the fake "
        "serves sbhd / bshd; the package's packed 'te' backend uses "
        "tests.support.gpu_standins.TEDotProductAttentionStandIn)")


class _QDQ(torch.autograd.Function):
    """One FP8 emulation point (backends.py:157-204): forward quantise-dequantise with forward
    slot ``fwd`` (None: pass through), backward with backward slot ``bwd`` (None: pass)."""

    @staticmethod
    def forward(ctx, x, meta, fwd, bwd):
        ctx.meta, ctx.bwd = meta, bwd
        if fwd is None:
            return x.view_as(x)
        return quantize(x, meta, True, fwd, "input").to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        if ctx.bwd is None:
            return g, None, None, None
        return quantize(g, ctx.meta, False, ctx.bwd, "grad").to(g.dtype), None, None, None


def _qdq_together(tensors, meta, fwd, bwd):
    """q, k, v (or their gradients) quantised as one tensor with one slot, as
    ``combine_and_quantize`` does for separate q / k / v (utils.py:2163-2200, case 3)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat = _QDQ.apply(flat, meta, fwd, bwd)
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return out


class DotProductAttention(TransformerEngineBaseModule):
    """TE 2.10's ``DotProductAttention`` (see the module docstring)."""

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: Union[int, Tuple[int, int]],
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_group=None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
        cp_group=None,
        cp_global_ranks: List[int] = None,
        cp_stream=None,
        cp_comm_type: str = "p2p",
        softmax_scale: Optional[float] = None,
        softmax_type: str = "vanilla",
        return_max_logit: Optional[bool] = False,
    ) -> None:
        super().__init__()
        self.qkv_format = qkv_format
        # dpa.py:348-352: "a,b" spellings, causal_padding -> padding_causal; the window checked
        # against the mask type (an unknown mask type asserts there: utils.py:2077-2078)
        attn_mask_type = attn_mask_type.replace(",", "_")
        if attn_mask_type == "causal_padding":
            attn_mask_type = "padding_causal"
        self.attn_mask_type = attn_mask_type
        self.window_size = dpa_utils.check_set_window_size(attn_mask_type, window_size)
        self.init_tp_size(tp_group, tp_size)  # dpa.py:353-359
        self.get_rng_state_tracker = get_rng_state_tracker
        self.num_attention_heads = num_attention_heads
        self.layer_number = 1 if layer_number is None else layer_number  # dpa.py:362
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks  # dpa.py:363-366
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type
        # dpa.py:368-373
        self.hidden_size_per_attention_head_k = (
            kv_channels if isinstance(kv_channels, int) else kv_channels[0])
        self.hidden_size_per_attention_head_v = (
            kv_channels if isinstance(kv_channels, int) else kv_channels[1])
        # dpa.py:375-380
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.num_gqa_groups_per_partition = int(self.num_gqa_groups // self.tp_size)
        assert num_attention_heads % self.num_gqa_groups == 0, (
            "The number of attention heads must be divisible by the number of GQA groups!")
        # dpa.py:382-388: no tracker with sequence parallelism or without a getter; else the
        # getter is called once, its states published, dropout runs inside its fork()
        self.rng_states_tracker = None
        if sequence_parallel or get_rng_state_tracker is None:
            self.attention_dropout_ctx = nullcontext
        else:
            self.rng_states_tracker = get_rng_state_tracker()
            set_all_rng_states(self.rng_states_tracker.get_states())
            self.attention_dropout_ctx = self.rng_states_tracker.fork
        if softmax_scale is None:  # dpa.py:390-393
            softmax_scale = 1.0 / math.sqrt(
                kv_channels if isinstance(kv_channels, int) else kv_channels[0])
        self.softmax_scale = softmax_scale
        self.deterministic = (  # dpa.py:395-398
            not bool(int(os.getenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")))
            or torch.are_deterministic_algorithms_enabled())
        # dpa.py:419
        assert attention_type in AttnTypes, f"attention_type {attention_type} not supported"
        self.attention_type = attention_type
        self.attention_dropout = attention_dropout
        self.return_max_logit = return_max_logit
        self.softmax_type = softmax_type
        self.softmax_offset = None  # dpa.py:426-437 (vanilla)
        if softmax_type != "vanilla":
            raise _not_stood_in(f"softmax_type={softmax_type!r}")

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type: str = "p2p") -> None:
        # dpa.py:529-568
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    # ------------------------------------------------------------------------------------ FP8
    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """dpa.py:570-748 with ``NVTE_DPA_FP8_RECIPE`` unset: the autocast's recipe, except
        Float8CurrentScaling with fp8_dpa / fp8_mha, which gets [CS, a DelayedScaling built from
        it] (dpa.py:632-648); a recipe other than per-tensor scaling with fp8_dpa / fp8_mha
        asserts (dpa.py:670-673)."""
        original = self.fp8_meta.get("recipe", None)
        fp8_recipe = FP8GlobalStateManager.get_fp8_recipe()
        if fp8_recipe.custom():  # dpa.py:579-580
            return
        if _dpa_fp8_recipe != "":
            raise _not_stood_in(f"NVTE_DPA_FP8_RECIPE={_dpa_fp8_recipe!r}")
        fp8_recipe_dpa, fp8_recipes = fp8_recipe, fp8_recipe
        if fp8_recipe.float8_current_scaling() and (fp8_recipe.fp8_dpa or fp8_recipe.fp8_mha):
            fake_recipe = DelayedScaling(
                fp8_format=fp8_recipe.fp8_format, amax_history_len=_dpa_fp8ds_amax_histlen,
                amax_compute_algo=_dpa_fp8ds_amax_algo, fp8_dpa=fp8_recipe.fp8_dpa,
                fp8_mha=fp8_recipe.fp8_mha, reduce_amax=_dpa_fp8ds_reduce_amax)
            fp8_recipe_dpa, fp8_recipes = fake_recipe, [fp8_recipe, fake_recipe]
        if not fp8_recipe_dpa.float8_per_tensor_scaling():
            assert not (fp8_recipe_dpa.fp8_dpa or fp8_recipe_dpa.fp8_mha), (
                f"DotProductAttention does not support {fp8_recipe_dpa.__class__.__name__} recipe")
        fp8_group = FP8GlobalStateManager.get_fp8_group()  # dpa.py:677
        self.fp8_parameters = FP8GlobalStateManager.with_fp8_parameters()
        self.fp8 = FP8GlobalStateManager.is_fp8_enabled()
        self.fp8_calibration = FP8GlobalStateManager.is_fp8_calibration()
        enabled = self.fp8 or self.fp8_calibration
        self.fp8_meta["fp8_checkpoint"] = enabled
        if not (self.fp8_parameters or enabled):  # dpa.py:704-707
            self.fp8_initialized = False
            return
        self.fp8_meta["global_recipe"] = fp8_recipe  # dpa.py:684-688
        self.fp8_meta["local_recipes"] = fp8_recipes if isinstance(fp8_recipes, list) else [fp8_recipes]
        if self.fp8_initialized and fp8_recipe_dpa == self.fp8_meta["recipe"]:  # dpa.py:691-693
            return
        self.fp8_meta["recipe"] = fp8_recipe_dpa
        if fp8_recipe != fp8_recipe_dpa:  # dpa.py:695-703: the new recipe's autocast key
            key = FP8GlobalStateManager.get_unique_autocast_key(fp8_recipe_dpa, fp8_group)
            FP8GlobalStateManager.autocast_arguments[key] = (fp8_recipe_dpa, fp8_group)
        if enabled:  # dpa.py:713-724
            self.fp8_meta["num_gemms"] = num_gemms
            self.fp8_meta["fp8_group"] = fp8_group
            self.fp8_meta["fp8_max_fwd"] = self.fp8_meta["recipe"].fp8_format.value.max_fwd
            self.fp8_meta["fp8_max_bwd"] = self.fp8_meta["recipe"].fp8_format.value.max_bwd
            self.init_fp8_meta_tensors(fp8_recipes)
            self.fp8_initialized = True
        if original is not None and not (  # dpa.py:737-746
                issubclass(type(self.fp8_meta["recipe"]), type(original))
                or issubclass(type(original), type(self.fp8_meta["recipe"]))):
            warnings.warn(f"Recipe type changed from {type(original).__name__} to "
                          f"{type(self.fp8_meta['recipe']).__name__}. This may affect model behavior.")

    def set_meta_tensor(self, fwd: bool, recipe: Union[Recipe, List[Recipe]]) -> None:
        """dpa.py:750-796: one recipe -> 3 GEMMs' slots (9 forward, 6 backward); [CS, DS] -> CS
        for 2 GEMMs and DS for 1, ``fp8_meta`` keeping the DS state. An initialised state of the
        same kind is kept (delayed: its history length adjusted)."""
        recipes = [recipe] if isinstance(recipe, Recipe) else list(recipe)
        last = recipes[-1]
        key = "scaling_fwd" if fwd else "scaling_bwd"
        if self.fp8_meta_tensors_initialized:
            state = self.fp8_meta[key]
            if last.delayed() and state.recipe.delayed():
                self.adjust_amax_history_length(last.amax_history_len, fwd=fwd)
                return
            if not last.delayed() and type(state.recipe) is type(last):
                return
        num_gemms = [2, 1] if len(recipes) == 2 else [3]
        sizes = [n * 3 if fwd else n * 2 for n in num_gemms]
        states = [make_recipe_state(r, mode="forward" if fwd else "backward", num_quantizers=n)
                  for r, n in zip(recipes, sizes)]
        self.fp8_meta[key] = states[-1] if len(recipes) == 2 else states[0]
        self.quantizers[key] = states

    # -------------------------------------------------------------------------------- forward
    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask=None,
        qkv_format: str = None,
        cu_seqlens_q: torch.Tensor = None,
        cu_seqlens_kv: torch.Tensor = None,
        cu_seqlens_q_padded: torch.Tensor = None,
        cu_seqlens_kv_padded: torch.Tensor = None,
        max_seqlen_q: int = None,
        max_seqlen_kv: int = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        fast_zero_fill: bool = True,
        inference_params=None,
        pad_between_seqs: Optional[bool] = None,
        fp8_output: Optional[bool] = False,
        num_splits: Optional[int] = 1,
    ) -> torch.Tensor:
        with self.prepare_forward(query_layer, num_gemms=3, allow_non_contiguous=True) as query_layer:
            # dpa.py:1009-1016: while TE's capture flag is set, a tracker must be TE's
            # CudaRNGStatesTracker and torch must have graph-safe RNG
            if self.rng_states_tracker is not None and te_graph.is_graph_capturing():
                assert isinstance(self.rng_states_tracker, CudaRNGStatesTracker), (
                    "Unsupported RNG states tracker.")
                assert graph_safe_rng_available(), (
                    "Upgrade PyTorch version to get RNG manipulation support for cuda graph capture.")
            # dpa.py:1019-1038: fp8_mha forces fp8_dpa; outside FP8 attention no FP8 output
            if self.fp8 and self.fp8_meta["recipe"].fp8_mha and not self.fp8_meta["recipe"].fp8_dpa:
                self.fp8_meta["recipe"].fp8_dpa = True
            fp8_dpa = bool(self.fp8 and self.fp8_meta["recipe"].fp8_dpa)
            if not fp8_dpa:
                fp8_output = False
            # (dpa.py:1030-1036: FP8 formats are E4M3 / E5M2 -- always so for the fake's recipes)
            # dpa.py:1044-1067: q/k/v dtypes, shapes, head dims, GQA groups
            assert query_layer.dtype == key_layer.dtype and query_layer.dtype == value_layer.dtype, (
                "Queries, keys and values must have the same data type!")
            assert key_layer.shape[:-1] == value_layer.shape[:-1], (
                "Keys and values must have the same batch size, sequence length and number of heads!")
            num_gqa_groups = key_layer.shape[-2]
            assert query_layer.shape[-1] == key_layer.shape[-1], (
                "Queries and keys must have the same head dimension!")
            head_dim_qk, head_dim_v = query_layer.shape[-1], value_layer.shape[-1]
            assert head_dim_qk == self.hidden_size_per_attention_head_k, (
                f"Keys have head_dim = {head_dim_qk}, ")
            assert head_dim_v == self.hidden_size_per_attention_head_v, (
                f"Values have head_dim = {head_dim_v}, ")
            assert num_gqa_groups == self.num_gqa_groups_per_partition, (
                "Keys and values must have num_gqa_group ="
                f" {self.num_gqa_groups_per_partition} heads! Found {num_gqa_groups}.")
            # dpa.py:1070-1078: the mask type
            if attn_mask_type is None:
                attn_mask_type = self.attn_mask_type
            else:
                attn_mask_type = attn_mask_type.replace(",", "_")
                if attn_mask_type == "causal_padding":
                    attn_mask_type = "padding_causal"
            assert attn_mask_type in AttnMaskTypes, (
                f"Attention mask type {attn_mask_type} is not supported!")
            # dpa.py:1081-1083: the sliding window
            if window_size is None:
                window_size = self.window_size
            window_size = dpa_utils.check_set_window_size(attn_mask_type, window_size)
            # dpa.py:1086-1105: qkv_format
            if qkv_format is None:
                qkv_format = self.qkv_format
            assert qkv_format in ["sbhd", "bshd", "thd"], (
                "DotProductAttention only supports qkv_format = {'sbhd', 'bshd', 'thd'}!")
            if qkv_format == "thd":
                raise _not_stood_in("qkv_format='thd'")
            assert all(len(x.shape) == 4 for x in (query_layer, key_layer, value_layer)), (
                f"Queries, keys and values must be 4D tensors when {qkv_format=}!")
            s_dim, b_dim = (0, 1) if qkv_format == "sbhd" else (1, 0)
            batch_size = query_layer.shape[b_dim]
            max_seqlen_q = query_layer.shape[s_dim] if max_seqlen_q is None else max_seqlen_q
            max_seqlen_kv = key_layer.shape[s_dim] if max_seqlen_kv is None else max_seqlen_kv
            if inference_params is not None:  # dpa.py:1139-1173
                raise _not_stood_in("inference_params (KV caching)")
            # dpa.py:1208-1214: the CP size; dpa.py:1215-1233: sbhd / bshd max_seqlen are global
            cp_size = 1
            if isinstance(self.cp_group, torch.distributed.ProcessGroup):
                cp_size = get_distributed_world_size(self.cp_group)
            elif isinstance(self.cp_group, list):
                for group in self.cp_group:
                    cp_size *= get_distributed_world_size(group)
            context_parallel = cp_size > 1
            max_seqlen_q *= cp_size
            max_seqlen_kv *= cp_size
            # dpa.py:1215-1248: a padding mask needs attention_mask (or cu_seqlens)
            if "padding" in attn_mask_type and (cu_seqlens_q is None or cu_seqlens_kv is None):
                assert attention_mask is not None, "Please provide attention_mask for padding!"
            if "padding" in attn_mask_type and attention_mask is None:
                raise _not_stood_in("a padding mask given by cu_seqlens (no attention_mask)")
            # dpa.py:1250-1272: ALiBi
            if alibi_slopes is not None:
                assert core_attention_bias_type == "alibi", (
                    "core_attention_bias_type must be alibi in order to use alibi_slopes!")
            assert core_attention_bias_type in AttnBiasTypes
            if core_attention_bias_type == "alibi":
                raise _not_stood_in("ALiBi")
            # dpa.py:1274-1296: the bias shape
            bias_shape = None
            if core_attention_bias is not None:
                heads = query_layer.shape[-2]
                b0, b1 = core_attention_bias.shape[0], core_attention_bias.shape[1]
                if b0 == batch_size and b1 == heads:
                    bias_shape = "bhss"
                elif b0 == 1 and b1 == heads:
                    bias_shape = "1hss"
                elif b0 == batch_size and b1 == 1:
                    bias_shape = "b1ss"
                elif b0 == 1 and b1 == 1:
                    bias_shape = "11ss"
                else:
                    assert False, "core_attention_bias must be in one of {bhss, 1hss, b1ss, 11ss} shapes"
            # dpa.py:1311-1401: the backend, or TE's ValueError when none is left
            use_fused, backend, use_unfused = dpa_utils.get_attention_backend(
                qkv_dtype=query_layer.dtype, qkv_format=qkv_format, attn_mask_type=attn_mask_type,
                window_size=window_size, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v,
                max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                bias_type=core_attention_bias_type, bias_shape=bias_shape,
                bias_requires_grad=(core_attention_bias.requires_grad
                                    if core_attention_bias is not None else False),
                attention_dropout=self.attention_dropout, deterministic=self.deterministic,
                is_training=self.training, fp8=self.fp8, fp8_meta=self.fp8_meta,
                softmax_type=self.softmax_type, return_max_logit=self.return_max_logit,
                num_splits=num_splits, context_parallel=context_parallel)
            if not (use_fused or use_unfused):
                raise ValueError(dpa_utils.NO_BACKEND_MESSAGE)
            cp_groups = None
            if context_parallel:  # FusedAttention's CP path (backends.py:1796-1880)
                cp_groups = _cp_checks(
                    self, query_layer, key_layer, value_layer, qkv_format=qkv_format,
                    mask_type=attn_mask_type, window=window_size,
                    bias_type=core_attention_bias_type, fp8_dpa=fp8_dpa)
            # FP8 computation: FusedAttention's FP8 sub-backend (backends.py:1163-1250), or
            # Unfused's emulation (backends.py:392-419, only with NVTE_UnfusedDPA_Emulate_FP8=1)
            fp8_compute = fp8_dpa and (use_fused or os.getenv("NVTE_UnfusedDPA_Emulate_FP8", "0") == "1")
            if fp8_compute and not use_fused:
                raise _not_stood_in("NVTE_UnfusedDPA_Emulate_FP8=1")
            if fp8_compute and len(self.fp8_meta["local_recipes"]) != 1:
                raise _not_stood_in("a [current scaling, delayed scaling] recipe pair")
            if fp8_output:
                raise _not_stood_in("fp8_output (FP8 multi-head attention)")
            if cp_groups is not None and self.cp_comm_type == "all_gather":
                fp8_compute = False  # cp.py:4088-4092: fp8 is not passed to KV all-gather CP
            return _attention(
                self, query_layer, key_layer, value_layer, qkv_format=qkv_format,
                mask_type=attn_mask_type, attention_mask=attention_mask, window=window_size,
                bias_type=core_attention_bias_type, bias=core_attention_bias,
                fp8_meta=self.fp8_meta if fp8_compute else None, cp_groups=cp_groups)


def _cp_checks(dpa, q, k, v, *, qkv_format, mask_type, window, bias_type, fp8_dpa):
    """TE's asserts on FusedAttention's CP path, in TE's order; returns the groups to gather K/V
    over (a2a+p2p: [a2a group, p2p group], the p2p rank outermost as cp.py:1294)."""
    group, comm = dpa.cp_group, dpa.cp_comm_type
    # backends.py:1796-1799 (a padding mask reaches it: utils.py:800-831 let it through)
    if "padding" in mask_type:
        assert False, "Padding mask not supported with context parallelism!"
    if fp8_dpa:  # backends.py:1849-1858
        recipe = dpa.fp8_meta["local_recipes"][0]
        if recipe.delayed():
            assert recipe.reduce_amax, (
                "Amax reduction across TP+CP group is necessary when using context parallelism"
                " with FP8!")
    # (backends.py:1868-1871: an F16 sub-backend other than arbitrary_seqlen -- the fake does not
    # tell them apart; backends.py:1872-1874: ALiBi, refused before)
    # cp.py:3986-4005: the group(s) for the comm type; a2a+p2p with one level of size 1 is the
    # other level's comm type
    if comm == "a2a+p2p":
        assert isinstance(group, list) and len(group) == 2, (
            "CP implementation a2a+p2p requires cp_group = [a2a_cp_group, p2p_cp_group]!")
        assert bias_type == "no_bias", (  # cp.py:3993-3995
            f"{bias_type} bias type is not supported with hierarchical CP implementation yet!")
        if get_distributed_world_size(group[0]) == 1:
            group, comm = group[1], "p2p"
        elif get_distributed_world_size(group[1]) == 1:
            group, comm = group[0], "a2a"
    else:
        assert isinstance(group, torch.distributed.ProcessGroup), (
            f"cp_group must be {torch.distributed.ProcessGroup} type for cp_comm_type={comm!r}!")
    # cp.py:4007-4018: sbhd / bshd with FusedAttention; a bias with a non-padding mask passes
    # cp.py:4023-4035 (their messages lack the f-prefix in TE: kept literally)
    if window is not None and window not in ((-1, 0), (-1, -1)):
        assert comm in ("a2a", "all_gather"), (
            "Context parallelism does not support sliding window attention with {cp_comm_type=}!")
    if k.shape[-1] != v.shape[-1]:
        assert comm in ("p2p", "a2a+p2p"), (
            "Context parallelism does not support MLA with {cp_comm_type=}!")
    seq_dim = qkv_format.index("s")
    halves = q.shape[seq_dim] % 2 == 0 and k.shape[seq_dim] % 2 == 0
    if comm == "all_gather":  # cp.py:2800-2848, 4088
        assert bias_type == "no_bias", f"{bias_type} bias type is not supported!"
        assert q.shape[-1] % 8 == 0, "Hidden size per attention head should be multiple of 8!"
        assert halves, "Sequence length per GPU needs to be divisible by 2!"
    elif comm == "a2a":  # cp.py:3314-3379, 4093
        assert bias_type == "no_bias", f"{bias_type} bias type is not supported!"
        assert q.shape[-1] % 8 == 0, "Hidden size per attention head should be multiple of 8!"
        cp = get_distributed_world_size(group)
        assert q.shape[-2] % cp == 0 and k.shape[-2] % cp == 0, (
            "The number of attention heads needs to be divisible by CP size!")
        assert halves, "Sequence length per GPU needs to be divisible by 2!"
    elif comm in ("p2p", "a2a+p2p"):  # cp.py:4074, 1432-1434
        assert halves, "Sequence length per GPU needs to be divisible by 2!"
        if bias_type != "no_bias":
            raise _not_stood_in("an attention bias with context parallelism (cp_comm_type 'p2p')")
    else:
        raise ValueError(f"Unsupported communication type: {comm}!")  # cp.py:4107-4108
    if isinstance(group, list):
        return list(group)
    return [group]


class _GatherCP(torch.autograd.Function):
    """All-gather over each group in turn (the last outermost): [n_last, ..., n_first, *x];
    backward: this rank's slice of the gradient summed over the groups (reduce-scatter by
    all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        for g in groups:
            parts = [torch.empty_like(x) for _ in range(get_distributed_world_size(g))]
            torch.distributed.all_gather(parts, x.contiguous(), group=g)
            x = torch.stack(parts)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        for g in reversed(ctx.groups):
            torch.distributed.all_reduce(grad, group=g)
            grad = grad[torch.distributed.get_rank(group=g)]
        return grad, None


def _cp_chunks(cp: int) -> List[Tuple[int, int]]:
    """(rank, half) holding each of the 2*cp sequence chunks in order: rank r holds chunks r and
    2*cp-1-r (cp.py:3926-3951)."""
    return [(r, 0) for r in range(cp)] + [(r, 1) for r in reversed(range(cp))]


def _gather_kv(x, groups, seq_dim):
    """The CP ranks' [.., s/cp, ..] pieces of K or V as the whole sequence, in order."""
    full = _GatherCP.apply(x, groups)
    full = full.reshape(-1, *x.shape)  # [cp, *x], group rank order (cp.py:1294)
    cp = full.shape[0]
    shape = list(x.shape)
    shape[seq_dim:seq_dim + 1] = [2, x.shape[seq_dim] // 2]
    full = full.reshape(cp, *shape)
    pieces = [full[r].select(seq_dim, h) for r, h in _cp_chunks(cp)]
    return torch.cat(pieces, dim=seq_dim)


def _cp_positions(groups, s_local, device):
    """Global sequence positions of this rank's s_local tokens."""
    cp, rank = 1, 0
    for g in groups:  # the rank in the flattened [last, ..., first] order
        rank = rank + torch.distributed.get_rank(group=g) * cp
        cp *= get_distributed_world_size(g)
    c = s_local // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


def _mask(mask_type, window, attention_mask, attention_type, b, sq, skv, device, q_pos=None):
    """The boolean mask (True: masked) over [b or 1, h or 1, sq, skv]: causal top-left
    ("causal", "padding_causal") or bottom-right (every other type, as TE's window docstring,
    dpa.py:223-230) with the sliding window (left, right; -1 unbounded); padding from
    ``attention_mask`` ([b, 1, 1, s] per side, True padded; a tuple of two for cross attention,
    dpa.py:1222-1242) as queries OR keys padded (utils.py get_full_mask); arbitrary: the mask
    itself, broadcast (dpa.py:920-928). ``q_pos``: the queries' global positions under CP
    (where K/V are the whole sequence and s_q = s_kv, so both alignments agree)."""
    mask = None
    left, right = window
    if left >= 0 or right >= 0:
        j = torch.arange(skv, device=device).view(1, skv)
        if q_pos is not None:
            diag = q_pos.view(sq, 1)
        else:
            i = torch.arange(sq, device=device).view(sq, 1)
            diag = i if mask_type in ("causal", "padding_causal") else i + (skv - sq)
        mask = torch.zeros(sq, skv, dtype=torch.bool, device=device)
        if right >= 0:
            mask = mask | (j > diag + right)
        if left >= 0:
            mask = mask | (j < diag - left)
        mask = mask.view(1, 1, sq, skv)
    if "padding" in mask_type:
        if attention_type == "self":
            mq = mkv = attention_mask
        else:
            mq, mkv = attention_mask
        pad = mq.reshape(b, 1, sq, 1).bool() | mkv.reshape(b, 1, 1, skv).bool()
        mask = pad if mask is None else mask | pad
    if mask_type == "arbitrary":
        arb = attention_mask.bool()
        mask = arb if mask is None else mask | arb
    return mask


def _attention(dpa, q, k, v, *, qkv_format, mask_type, attention_mask, window, bias_type, bias,
               fp8_meta, cp_groups=None):
    """The attention every backend computes (see the module docstring), device-only; under CP
    (``cp_groups``) over the all-gathered K/V at the local queries' global positions."""
    nominal = q.dtype
    if fp8_meta is not None:  # forward QKV slot, backward dQKV slot (local: elementwise)
        q, k, v = _qdq_together([q, k, v], fp8_meta, META_QKV, META_DQKV)
    q_pos = None
    if cp_groups is not None:
        seq_dim = qkv_format.index("s")
        q_pos = _cp_positions(cp_groups, q.shape[seq_dim], q.device)
        # gathered in float32, as the scores are computed: the owner's K/V gradient is the
        # float32 sum of every rank's part, rounded once
        k, v = (_gather_kv(x.float(), cp_groups, seq_dim) for x in (k, v))
    # to [b, h, s, d]
    perm = (1, 2, 0, 3) if qkv_format == "sbhd" else (0, 2, 1, 3)
    q, k, v = (x.permute(*perm) for x in (q, k, v))
    b, h, sq, _ = q.shape
    skv = k.shape[2]
    if k.shape[1] != h:  # backends.py:363-372: GQA by repeating the K/V heads
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
    scale = dpa.softmax_scale
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1))
    if bias_type == "pre_scale_bias":  # backends.py:431-438
        assert bias is not None, "core_attention_bias should not be None!"
        scores = (scores + bias.float()) * scale
    else:
        scores = scores * scale
        if bias_type == "post_scale_bias":  # backends.py:440-463
            assert bias is not None, "core_attention_bias should not be None!"
            scores = scores + bias.float()
    if fp8_meta is not None:  # backward: dP slot (backends.py:465-469)
        scores = _QDQ.apply(scores, fp8_meta, None, META_DP)
    mask = _mask(mask_type, window, attention_mask, dpa.attention_type, b, sq, skv, q.device,
                 q_pos=q_pos)
    empty = None
    if mask is not None:
        # a fully masked row (a padded query) keeps its scores (no -inf row: its softmax and
        # gradient stay finite) and its probabilities are zeroed below, backends.py:502-503
        empty = mask.all(dim=-1, keepdim=True)
        scores = scores.masked_fill(mask & ~empty, float("-inf"))
    max_logit = None
    if dpa.return_max_logit:  # backends.py:471-478: max over batch, queries, keys per head
        max_logit = (scores if empty is None else scores.masked_fill(empty, float("-inf"))
                     ).amax(dim=(0, 2, 3))
        for g in cp_groups or ():  # cp.py:1801-1804, 2997-3000: MAX over the CP group
            max_logit = max_logit.detach().clone()
            torch.distributed.all_reduce(max_logit, op=torch.distributed.ReduceOp.MAX, group=g)
    probs = torch.softmax(scores, dim=-1)
    if empty is not None:
        probs = probs.masked_fill(empty, 0.0)
    with dpa.attention_dropout_ctx():  # backends.py:511-512
        probs = torch.nn.functional.dropout(probs, p=dpa.attention_dropout, training=dpa.training)
    if fp8_meta is not None:  # forward: S slot (backends.py:529-533)
        probs = _QDQ.apply(probs, fp8_meta, META_S, None)
    out = torch.matmul(probs, v.float())
    if fp8_meta is not None:  # forward O slot, backward dO slot (backends.py:568-576)
        out = _QDQ.apply(out, fp8_meta, META_O, META_DO)
    out = out.to(nominal)
    if qkv_format == "sbhd":  # backends.py:541-553
        out = out.permute(2, 0, 1, 3).reshape(sq, b, -1)
    else:
        out = out.permute(0, 2, 1, 3).reshape(b, sq, -1)
    if dpa.return_max_logit:
        return out, max_logit
    return out
