"""Test-only stand-in for torch 2.13 FlexAttention with a backward on CPU (the feature matrix trains the flex backend on it).

torch 2.13's lines are cited below; torch 2.11 runs the same checks at the lines in brackets
(2.11 has no _validate_no_nested_tensors call; its _ordered_to_dense takes no column count).

``flex_attention_standin(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False)``

* forward: the REAL ``torch.nn.attention.flex_attention.flex_attention`` on detached inputs
  (CPU forward exists), so every input contract the real function checks in Python is checked
  by the real code (torch/nn/attention/flex_attention.py, torch 2.13):
    L2315 _validate_no_nested_tensors; L2316 _validate_sdpa_input (same device, >= 2-D;
    allow_lowp_kv=True: no dtype check here) [L1547]; L2317 _validate_embed_dim (q/k same E)
    [L1548]; L2320-2321 4-D q/k/v [L1551-1552]; L2322-2327 Hq == Hkv unless enable_gqa
    [L1553-1558]; L2328-2335 Hq % Hkv == 0 [L1559-1566]; L2336-2350 batch sizes [L1567-1580];
    L2364-2392 block_mask seq lengths == q/k lengths [L1593-1621]; L2396-2400 block_mask on q's
    device [L1626-1630].
  The only check skipped is L2079-2084 [L1394-1400] (_validate_device: "does not support
  backward on CPU"), the limitation this stand-in stands in for.
* plus what the CUDA path asserts that the CPU path does not
  (torch/_inductor/kernel/flex/flex_attention.py, torch 2.13):
    L156-163 [L138-145]  "NYI: embedding dimension ... must be at least 16" (forward lowering,
    CUDA); L742-748 [L692-698]  "Backward pass with mixed query, key, and value dtype is not
    supported".
* backward: dense fp32 math as the GPU kernel does it -- P = exp(score_mod(scale * q.k) - lse)
  with lse from the real forward; dQ over the blocks the kv_* fields list (partial: mask_mod,
  full: all kept), dK / dV over the blocks the TRANSPOSED q_* fields list (the backward
  kernel's iteration order), so a BlockMask whose q_* fields disagree with its kv_* fields
  gives wrong gradients here as it would on a GPU. Fully masked rows: out 0, grads 0.
  A score_mod whose captured tensors require grad is refused (not emulated).
"""

from __future__ import annotations

from unittest import mock

import torch
from torch.nn.attention import flex_attention as _fa

from megatron_fastpath.compat import TORCH_RELEASE

REAL_FLEX = _fa.flex_attention  # captured before any monkeypatch


def _check_dispatch_modes():
    """torch.compile skips every frame while a non-infra TorchDispatchMode without
    ``ignore_compile_internals()`` is active (torch/_dynamo/convert_frame.py:2545-2570; 2.11
    :2250-2280), so the real flex_attention -- compiled by the package on CUDA, and compiling its
    HOP with fullgraph=True even in eager (flex_attention.py:2497-2508; 2.11 :1720-1731) --
    raises "torch.compile with fullgraph=True found no compiled frames". Raised here too, except
    for the fake CUDA graph's recording mode (it stands in for a capture, which has no dispatch
    mode on a GPU)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if mode.is_infra_mode() or mode.ignore_compile_internals():
            continue
        if type(mode).__name__ == "_RecordOps" and type(mode).__module__.endswith("fake_cuda_graph"):
            continue
        raise RuntimeError(
            f"flex_attention under the dispatch mode {type(mode).__qualname__}: torch.compile "
            "skips frames under a non-infra TorchDispatchMode (torch/_dynamo/convert_frame.py:"
            "2545-2570 in torch 2.13, :2250-2280 in 2.11): 'torch.compile with fullgraph=True "
            "found no compiled frames'")


def _real_forward(q, k, v, **kw):
    """The real flex_attention without its internal torch.compile (the HOP's dense
    implementation called directly, every aten op visible to the harness's dispatch modes)."""
    from torch._higher_order_ops.flex_attention import sdpa_dense

    _check_dispatch_modes()
    # flex_attention.py:2497-2508 (2.11 :1720-1731): with the debug flag the top level calls the
    # HOP without torch.compile; the HOP's CompositeExplicitAutograd kernel (sdpa_dense,
    # _higher_order_ops/flex_attention.py:381-382; 2.11 :379-380) called as a function: plain
    # aten ops, which the fake CUDA graph's recording mode (no HOP support) records like any
    # other
    with mock.patch.object(_fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True), \
            mock.patch.object(_fa, "flex_attention_hop", sdpa_dense):
        return REAL_FLEX(q, k, v, **kw)


def _blocks_to_tokens(num_blocks, indices, bs_rows, bs_cols, rows, cols):
    # torch's own block-list -> dense conversion: torch 2.13 (nn/attention/flex_attention.py:392)
    # takes the column count, torch 2.11 (:372) reads it from col_indices.shape[-1]
    if TORCH_RELEASE >= (2, 13):
        dense = _fa._ordered_to_dense(num_blocks, indices, indices.shape[-1])  # [B?, H?, nr, nc]
    else:
        dense = _fa._ordered_to_dense(num_blocks, indices)
    dense = dense.repeat_interleave(bs_rows, dim=-2).repeat_interleave(bs_cols, dim=-1)
    return dense[..., :rows, :cols].bool()


def _token_masks(block_mask, B, H, L, S, device):
    """(keep used by the forward / dQ from kv_* fields, keep used by dK / dV from q_* fields)."""
    bq, bkv = block_mask.BLOCK_SIZE
    mm = _fa.create_mask(block_mask.mask_mod, B, H, L, S, device=device)  # [B, H, L, S]
    part_kv = _blocks_to_tokens(block_mask.kv_num_blocks, block_mask.kv_indices, bq, bkv, L, S)
    keep_kv = part_kv & mm
    if block_mask.full_kv_num_blocks is not None:
        keep_kv = keep_kv | _blocks_to_tokens(block_mask.full_kv_num_blocks,
                                              block_mask.full_kv_indices, bq, bkv, L, S)
    if block_mask.q_num_blocks is None:
        return keep_kv, keep_kv
    part_q = _blocks_to_tokens(block_mask.q_num_blocks, block_mask.q_indices, bkv, bq, S, L)
    keep_q = part_q.transpose(-1, -2) & mm
    if block_mask.full_q_num_blocks is not None:
        keep_q = keep_q | _blocks_to_tokens(block_mask.full_q_num_blocks, block_mask.full_q_indices,
                                            bkv, bq, S, L).transpose(-1, -2)
    return keep_kv, keep_q


def _captured_tensors(fn):
    cells = getattr(fn, "__closure__", None) or ()
    out = []
    for c in cells:
        try:
            v = c.cell_contents
        except ValueError:
            continue
        if torch.is_tensor(v):
            out.append(v)
    return out


class _FlexStandinFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, score_mod, block_mask, scale, enable_gqa):
        with torch.no_grad():
            out, aux = _real_forward(q.detach(), k.detach(), v.detach(), score_mod=score_mod,
                                 block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                                 return_aux=_fa.AuxRequest(lse=True))
        ctx.save_for_backward(q, k, v, out, aux.lse)
        ctx.score_mod, ctx.block_mask, ctx.scale = score_mod, block_mask, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        B, Hq, L, E = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        g = Hq // Hkv
        scale = ctx.scale if ctx.scale is not None else E ** -0.5
        f32 = torch.float32
        qf, kf, vf = q.to(f32), k.to(f32).repeat_interleave(g, 1), v.to(f32).repeat_interleave(g, 1)
        bm = ctx.block_mask
        if bm is None:
            bm = _fa._create_empty_block_mask(q, k)
        keep_kv, keep_q = _token_masks(bm, B, Hq, L, S, q.device)
        raw = (qf @ kf.transpose(-1, -2)) * scale  # [B, Hq, L, S]
        if ctx.score_mod is not None:
            with torch.enable_grad():
                raw_ = raw.detach().requires_grad_(True)
                s = _fa._vmap_for_bhqkv(ctx.score_mod, prefix=(0,))(
                    raw_, torch.arange(B), torch.arange(Hq), torch.arange(L), torch.arange(S))
                dmod = torch.autograd.grad(s.sum(), raw_, allow_unused=True)[0]
            s = s.detach()
            dmod = torch.ones_like(raw) if dmod is None else dmod
        else:
            s, dmod = raw, torch.ones_like(raw)
        lse_ = lse.to(f32).unsqueeze(-1)
        finite = torch.isfinite(lse_)
        p = torch.exp(s - torch.where(finite, lse_, 0.0))
        p_kv = torch.where(keep_kv & finite, p, 0.0)
        p_q = torch.where(keep_q & finite, p, 0.0)
        do = dout.to(f32)
        delta = (do * out.to(f32)).sum(-1, keepdim=True)
        dp = do @ vf.transpose(-1, -2)
        ds_kv = p_kv * (dp - delta) * dmod * scale
        ds_q = p_q * (dp - delta) * dmod * scale
        dq = ds_kv @ kf
        dk = ds_q.transpose(-1, -2) @ qf
        dv = p_q.transpose(-1, -2) @ do
        if g > 1:
            dk = dk.view(B, Hkv, g, S, E).sum(2)
            dv = dv.view(B, Hkv, g, S, -1).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def flex_attention_standin(query, key, value, score_mod=None, block_mask=None, scale=None,
                           enable_gqa=False, return_lse=False, kernel_options=None, *,
                           return_aux=None):
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                        or value.requires_grad)
    if query.dim() == 4 and value.dim() == 4 and (query.size(-1) < 16 or value.size(-1) < 16):
        # torch/_inductor/kernel/flex/flex_attention.py:156-163 (2.11 :138-145; CUDA lowering)
        raise NotImplementedError(
            f"NYI: embedding dimension of the query, key, and value must be at least 16 but got "
            f"E={query.size(-1)} and Ev={value.size(-1)}")
    if not grad or query.device.type != "cpu":
        return _real_forward(query, key, value, score_mod=score_mod, block_mask=block_mask,
                             scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                             kernel_options=kernel_options, return_aux=return_aux)
    if return_lse or return_aux is not None or kernel_options is not None:
        raise NotImplementedError("stand-in: return_lse / return_aux / kernel_options in training")
    if query.dtype != key.dtype or query.dtype != value.dtype:
        # torch/_inductor/kernel/flex/flex_attention.py:742-748 (2.11 :692-698; backward lowering)
        raise ValueError(
            f"Backward pass with mixed query, key, and value dtype is not supported, "
            f"got query.dtype={query.dtype}, key.dtype={key.dtype}, and value.dtype={value.dtype}")
    if score_mod is not None and any(t.requires_grad for t in _captured_tensors(score_mod)):
        raise NotImplementedError("stand-in: gradients to tensors a score_mod captures")
    return _FlexStandinFn.apply(query, key, value, score_mod, block_mask, scale, enable_gqa)


class CompiledFlexStandin:
    """Stand-in for ``torch.compile(flex_attention, dynamic=False)``: calls the stand-in eagerly
    and counts the distinct specialisations a dynamic=False compile would guard on (shapes,
    dtypes, score_mod / mask_mod code, scale, enable_gqa); more than dynamo's
    ``cache_size_limit`` (torch/_dynamo/config.py) raises, as a GPU run would silently fall
    back to eager (materialised scores) there. Approximate: dynamo's real guards are finer."""

    def __init__(self, fn, dynamic=False, **kw):
        assert dynamic is False, "the package compiles flex with dynamic=False"
        self.fn, self.keys = fn, set()

    def __call__(self, q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                 **kw):
        key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype,
               getattr(score_mod, "__code__", None),
               None if block_mask is None else (block_mask.shape,
                                                getattr(block_mask.mask_mod, "__code__", None)),
               scale, enable_gqa, q.requires_grad)
        self.keys.add(key)
        limit = torch._dynamo.config.recompile_limit
        if len(self.keys) > limit:
            raise AssertionError(f"{len(self.keys)} specialisations > recompile_limit {limit}")
        return self.fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                       enable_gqa=enable_gqa, **kw)


def flex_attention_fn_standin(device):
    """Stand-in for core_attention._flex_attention_fn: on the job's CUDA device the compiled
    flex (CompiledFlexStandin over the stand-in); elsewhere the real eager flex_attention."""
    if device.type == "cuda":
        return CompiledFlexStandin(flex_attention_standin, dynamic=False)
    return REAL_FLEX
