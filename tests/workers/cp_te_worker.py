"""Test-only torchrun worker (2 processes): the main job's GPU step inside the GPU stand-ins at
context parallelism 2, trained twice in one process on the same data and seed -- with the
``te`` attention backend (Transformer Engine's THD + CP call, answered by
``tests/support/gpu_standins.TEDotProductAttentionStandIn``) and with ``sdpa`` (K/V
all-gathered by the package) -- then TE's contract checked on broken calls. Each rank writes
``<out>.rank<r>.json``: both runs' per-step (loss, grad norm, tokens) and host-sync sites, the
stand-in's recorded calls and CP arguments, and the message each broken call raised::

    torchrun --nproc_per_node=2 -m tests.workers.cp_te_worker <out> <overrides...>
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch


def _train(overrides):
    from tests.support.gpu_standins import TEDotProductAttentionStandIn
    from tests.support.hydra_compose import compose_job
    from tests.support.main_job import train_in_standins

    summary, job = train_in_standins(compose_job(overrides))
    calls = list(TEDotProductAttentionStandIn.calls)  # recorded since the stand-ins were entered
    layers = [m for m in job.model.modules() if isinstance(m, TEDotProductAttentionStandIn)]
    records = [[r.step, r.loss, r.grad_norm, r.tokens] for r in summary.records]
    sites = sorted({str(site) for r in summary.records for site in r.sync_sites})
    return records, calls, layers, sites


def _reference(q, k, v, cu, scale):
    """Causal attention per sequence over the GLOBAL tokens (no CP): [T, h, d]."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            xs = [x[a:b].transpose(0, 1) for x in (q, k, v)]
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                *xs, is_causal=True, scale=scale).transpose(0, 1)
    return out


def _contract(layer) -> dict:
    """The stand-in on a hand-built THD + CP call: the good call against global attention, then
    one broken call per TE assertion (the message each raised)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_fastpath.packed_seq.context_parallel import partition_indices

    cp = torch.distributed.get_world_size(layer.cp_group)
    rank = torch.distributed.get_rank(layer.cp_group)
    cu = torch.tensor([0, 8, 12, 24, 32], dtype=torch.int32)  # pieces divisible by 2 x CP = 4
    T, h, d = 32, 2, 8
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(T, h, d, generator=g) for _ in range(3))
    mine = torch.from_numpy(partition_indices(cu.numpy(), cp, rank))
    ref = _reference(q, k, v, cu, 0.25)[mine]
    qs, ks, vs = (x[mine].clone().requires_grad_(True) for x in (q, k, v))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=24, max_seqlen_kv=24)
    layer.softmax_scale = 0.25
    out = layer(qs, ks, vs, None, AttnMaskType.padding_causal, packed_seq_params=params)
    out.sum().backward()  # the all-gather's backward runs on every rank
    result = {"max_abs_diff": (out.detach().view_as(ref) - ref).abs().max().item(),
              "grads_finite": all(bool(torch.isfinite(x.grad).all()) for x in (qs, ks, vs))}

    def call(params=params, mask=AttnMaskType.padding_causal, **attrs):
        saved = {a: getattr(layer, a) for a in attrs}
        try:
            for a, val in attrs.items():
                setattr(layer, a, val)
            layer(qs, ks, vs, None, mask, packed_seq_params=params)
            return None
        except (AssertionError, ValueError) as e:
            return str(e)
        finally:
            for a, val in saved.items():
                setattr(layer, a, val)

    replace = dataclasses.replace
    result["broken"] = {
        "mask_bottom_right": call(mask=AttnMaskType.causal_bottom_right),
        "cu_seqlens_int64": call(replace(params, cu_seqlens_q=cu.long(), cu_seqlens_kv=cu.long())),
        "cu_seqlens_none": call(replace(params, cu_seqlens_q=None)),
        "max_seqlen_differs": call(replace(params, max_seqlen_kv=32)),
        "not_divisible": call(replace(params, cu_seqlens_q=torch.tensor([0, 6, 12, 24, 32], dtype=torch.int32),
                                      cu_seqlens_kv=torch.tensor([0, 6, 12, 24, 32], dtype=torch.int32))),
        "local_tokens": call(replace(params, cu_seqlens_q=cu * 2, cu_seqlens_kv=cu * 2, max_seqlen_q=48,
                                     max_seqlen_kv=48)),
        "comm_all_gather": call(cp_comm_type="all_gather"),
        "comm_a2a": call(cp_comm_type="a2a"),
        "comm_unknown": call(cp_comm_type="ring"),
        "global_ranks_none": call(cp_global_ranks=None),
        "cp_stream_none": call(cp_stream=None),
    }
    return result


def main(out: str, overrides: list) -> None:
    te, te_calls, te_layers, te_sites = _train(overrides + ["fastpath.attention_backend=te"])
    sdpa, _, _, sdpa_sites = _train(overrides + ["fastpath.attention_backend=sdpa"])
    layer = te_layers[0]
    cp_args = {"cp_global_ranks": layer.cp_global_ranks, "cp_comm_type": layer.cp_comm_type,
               "cp_group_size": torch.distributed.get_world_size(layer.cp_group),
               "cp_stream_shared": all(m.cp_stream is layer.cp_stream is not None for m in te_layers)}
    rank = torch.distributed.get_rank()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"te": te, "sdpa": sdpa, "te_calls": te_calls, "te_layers": len(te_layers),
                   "cp_args": cp_args, "sync_sites": {"te": te_sites, "sdpa": sdpa_sites},
                   "contract": _contract(layer)}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
