"""Fake ``transformer_engine.pytorch.attention.dot_product_attention.utils`` (TE v2.10): the
sliding-window check and the backend selection (``get_attention_backend``), reduced to what
decides, for the inputs the fake ``DotProductAttention`` serves (sbhd / bshd, vanilla softmax,
no ALiBi, no KV cache; CP 1 or more), whether SOME backend runs and whether it runs FP8
attention.

Lines cited: ``utils.py`` = this file's TE counterpart at tag v2.10,
``fused_attn.cpp`` = ``transformer_engine/common/fused_attn/fused_attn.cpp``
(``nvte_get_fused_attn_backend``) at v2.10.

The fake world has no flash-attn (neither FA2 nor FA3 installed), so FlashAttention is never
selected (utils.py:1114-1118). What remains is FusedAttention (cuDNN) and
UnfusedDotProductAttention (PyTorch): the fake computes both alike (fp32 softmax), so only the
decision "none left" (TE's ``ValueError``) and "FusedAttention's FP8 sub-backend" matter.
"""

from __future__ import annotations

import os
import warnings

import torch

from ...utils import get_cudnn_version, get_device_compute_capability

NO_BACKEND_MESSAGE = (  # dot_product_attention.py:1396-1401
    "No dot product attention backend is available for the provided inputs. Please"
    " run with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 to find out the reasons for"
    " disabling all backends.")


def check_set_window_size(attn_mask_type: str, window_size=None):
    """utils.py:2037-2079: causal masks take (-1, 0) or (>= 0, 0) (None -> (-1, 0); (-1, -1) or
    a non-zero right edge -> (left, 0) with a warning; anything else asserts); no_mask / padding /
    arbitrary take (-1, -1) or (>= 0, >= 0) (None -> (-1, -1); (-1, 0) -> (-1, -1) with a
    warning); any other mask type asserts."""
    orig = window_size
    if "causal" in attn_mask_type:
        msg = "window_size should be (-1, 0) or (>=0, 0) for attn_mask_type=" + attn_mask_type
        if orig is None:
            window_size = (-1, 0)
        elif orig == (-1, -1) or (orig[0] >= 0 and orig[1] != 0):
            window_size = (orig[0], 0)
            warnings.warn(msg)
        elif orig != (-1, 0) and (orig[0] < 0 or orig[1] != 0):
            assert False, msg
    elif attn_mask_type in ("no_mask", "padding", "arbitrary"):
        msg = "window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type=" + attn_mask_type
        if orig is None:
            window_size = (-1, -1)
        elif orig == (-1, 0):
            window_size = (-1, -1)
            warnings.warn(msg)
        elif orig != (-1, -1) and (orig[0] < 0 or orig[1] < 0):
            assert False, msg
    else:
        assert False, "Invalid attn_mask_type: " + attn_mask_type
    return window_size


def _fp8_fused_backend_supports(*, is_training, qkv_format, attn_mask_type, bias_type,
                                head_dim_qk, head_dim_v, max_seqlen_q, max_seqlen_kv,
                                softmax_type, return_max_logit, capability, cudnn) -> bool:
    """fused_attn.cpp:230-265, the FP8 sub-backend (NVTE_FP8) for FP8 q/k/v: sm90+, no bias,
    {bshd, sbhd}, vanilla softmax, no max-logit, cuDNN != 9.10.0, and one of
    * 8.9 (t3hd only: never the separate sbhd / bshd tensors Megatron hands over),
    * 9.2.1 (sm < 100): s_q, s_kv % 128 == 0, d_qk = d_v = 128, no_mask | causal,
    * 9.7: d_qk, d_v % 16 == 0 and, on sm < 100, d <= 256 for inference and d = 128 for
      training (sm100+: d <= 128); no_mask | causal | padding | padding_causal."""
    sm = 10 * capability[0] + capability[1]
    if sm < 90 or bias_type != "no_bias" or qkv_format not in ("bshd", "sbhd"):
        return False
    if softmax_type != "vanilla" or return_max_logit or cudnn == (9, 10, 0):
        return False
    cudnn_9_2_1 = (cudnn >= (9, 2, 1) and sm < 100 and max_seqlen_q % 128 == 0
                   and max_seqlen_kv % 128 == 0 and head_dim_qk == 128 and head_dim_v == 128
                   and attn_mask_type in ("causal", "no_mask"))
    if sm < 100:
        dims = ((not is_training and head_dim_qk <= 256 and head_dim_v <= 256)
                or (is_training and head_dim_qk == 128 and head_dim_v == 128))
    else:
        dims = head_dim_qk <= 128 and head_dim_v <= 128
    cudnn_9_7 = (cudnn >= (9, 7, 0) and dims and head_dim_qk % 16 == 0 and head_dim_v % 16 == 0
                 and attn_mask_type in ("no_mask", "causal", "padding", "padding_causal"))
    return cudnn_9_2_1 or cudnn_9_7


def get_attention_backend(*, qkv_dtype, qkv_format, attn_mask_type, window_size, head_dim_qk,
                          head_dim_v, max_seqlen_q, max_seqlen_kv, bias_type, bias_shape,
                          bias_requires_grad, attention_dropout, deterministic, is_training, fp8,
                          fp8_meta, softmax_type, return_max_logit, num_splits,
                          context_parallel=False):
    """utils.py:289-1169 for no KV cache, no ALiBi, sbhd / bshd (``max_seqlen_*`` global under
    context parallelism, dpa.py:1215-1233): returns
    ``(use_fused_attention, fused_attention_backend, use_unfused_attention)`` with TE's
    selection order (FusedAttention preferred over Unfused, utils.py:1147-1152);
    ``fused_attention_backend`` is "FP8" or "F16" (the F16 sub-backends are not told apart: the
    fake computes them and Unfused alike). F16 FusedAttention is taken as supporting what the
    fake serves (its cuDNN conditions, fused_attn.cpp:266-400, only move a call to Unfused,
    which computes the same)."""
    capability, cudnn = get_device_compute_capability(), get_cudnn_version()
    fp8_dpa = bool(fp8 and fp8_meta["recipe"].fp8_dpa)
    # utils.py:411-412: environment switches
    use_fused = bool(int(os.getenv("NVTE_FUSED_ATTN", "1")))
    use_unfused = bool(int(os.getenv("NVTE_UNFUSED_ATTN", "1")))
    # utils.py:423-429: compute capability
    if capability < (8, 0):
        use_fused = False
    # utils.py:444-465: FusedAttention takes bf16 / fp16 (/ fp8 e4m3) q/k/v only
    if qkv_dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        use_fused = False
    # utils.py:468-516: FP8 attention
    if fp8_dpa:
        if use_unfused and os.getenv("NVTE_UnfusedDPA_Emulate_FP8", "0") != "1":
            use_unfused = False  # utils.py:476-480
        fp8_recipe = fp8_meta["recipe"]
        if fp8_meta.get("local_recipes", None) is not None:
            fp8_recipe = fp8_meta["local_recipes"][0]  # utils.py:481-483
        if use_fused and fp8_recipe.float8_current_scaling():  # utils.py:484-502
            if capability < (10, 0):
                use_fused = False
            elif cudnn < (9, 14, 0) or (deterministic and cudnn < (9, 18, 0)):
                use_fused = False
        if capability == (12, 0):  # utils.py:504-516
            use_fused = False
    # utils.py:519-528: num_splits != 1 is FlashAttention 3's alone
    if num_splits != 1:
        use_fused = use_unfused = False
    # utils.py:531-542: max logit
    if return_max_logit and fp8_dpa:
        use_fused = use_unfused = False
    # utils.py:597-608: MLA on FusedAttention needs separate q / k / v (hd_hd_hd): the fake
    # receives separate tensors, as Megatron passes them
    # utils.py:762-766: Unfused has no context parallelism (FlashAttention, utils.py:767-799,
    # is absent), so under CP only FusedAttention is left, and only for (utils.py:800-831):
    # no bottom-right causal mask, no causal cross attention of unequal lengths, no bias other
    # than post_scale_bias, no FP8 MLA (d_qk != d_v)
    if context_parallel:
        use_unfused = False
        if "bottom_right" in attn_mask_type:
            use_fused = False
        elif "causal" in attn_mask_type and max_seqlen_q != max_seqlen_kv:
            use_fused = False
        elif bias_type not in ("no_bias", "post_scale_bias"):
            use_fused = False
        elif fp8_dpa and head_dim_qk != head_dim_v:
            use_fused = False
    # utils.py:851-859: an arbitrary mask is Unfused's alone
    if attn_mask_type == "arbitrary":
        use_fused = False
    # utils.py:879-900: sliding windows on FusedAttention
    if window_size is not None and use_fused and (window_size[0] != -1
                                                  or window_size[1] not in (-1, 0)):
        if fp8 and (fp8_meta["recipe"].fp8_dpa or fp8_meta["recipe"].fp8_mha):
            use_fused = False
        elif window_size[1] != 0 or attention_dropout != 0.0:
            use_fused = False
        elif max_seqlen_q > max_seqlen_kv:
            use_fused = False
    # utils.py:962-974: a post-scale bias not [1, h, s, s] with a gradient
    if use_fused and bias_type == "post_scale_bias" and bias_shape != "1hss" and bias_requires_grad:
        use_fused = False
    # utils.py:976-1032: cuDNN's answer (fused_attn.cpp nvte_get_fused_attn_backend)
    backend = None
    if use_fused:
        if fp8_dpa:
            ok = _fp8_fused_backend_supports(
                is_training=is_training, qkv_format=qkv_format, attn_mask_type=attn_mask_type,
                bias_type=bias_type, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v,
                max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, softmax_type=softmax_type,
                return_max_logit=return_max_logit, capability=capability, cudnn=cudnn)
            backend = "FP8" if ok else None
        else:
            backend = "F16"
        use_fused = backend is not None
    # utils.py:1056-1076: determinism
    if use_fused and deterministic and is_training:
        if backend == "FP8" or capability >= (10, 0):
            use_fused, backend = False, None
    # utils.py:1147-1152: FusedAttention over Unfused
    if use_fused:
        use_unfused = False
    return use_fused, backend, use_unfused
