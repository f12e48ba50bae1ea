"""Child-process worker of ``test_te_spec_parity.py``: the tiny GPT built with Megatron's
local spec (no Transformer Engine in the process) or with its TE spec on the fake TE
(``tests/support/fake_te``), one forward + backward on a packed batch in float32.

    python -m tests.workers.te_spec_worker local VARIANT OUT.pt
    python -m tests.workers.te_spec_worker te VARIANT LOCAL.pt OUT.pt   # local weights, TE layout

OUT.pt: {"state": parameters, "logits", "loss", "grads"} (names of the model that ran; the TE
run also writes "grads_local_names": its gradients under the local model's names)."""

from __future__ import annotations

import re
import sys

VARIANTS = {
    "rmsnorm": dict(),
    "layernorm_bias_qknorm": dict(model=dict(normalization="LayerNorm", qk_layernorm=True),
                                  tcfg=dict(add_bias_linear=True)),
}


def te_name(local: str) -> str:
    """A local-spec parameter name in the TE spec's layout: the input / pre-MLP norms are fused
    into linear_qkv / linear_fc1 (TE's layer_norm_weight / layer_norm_bias)."""
    local = re.sub(r"\.input_layernorm\.(weight|bias)$", r".self_attention.linear_qkv.layer_norm_\1", local)
    return re.sub(r"\.pre_mlp_layernorm\.(weight|bias)$", r".mlp.linear_fc1.layer_norm_\1", local)


def run(impl: str, variant: str, load=None) -> dict:
    import dataclasses

    import torch

    from megatron_fastpath.distributed import init_distributed
    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
    from tests.support.tiny_gpt import LENGTHS, SHAPE, T, batch

    init_distributed(backend="gloo")
    v = VARIANTS[variant]
    shape = dataclasses.replace(SHAPE, **v.get("model", {}))
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, rope=rope_config_for(shape)))
    spec = get_fastpath_layer_spec(cache, backend="sdpa", linear_impl=impl,
                                   normalization=shape.normalization, qk_layernorm=shape.qk_layernorm)
    torch.manual_seed(0)
    model = build_gpt_model(build_transformer_config(shape, **v.get("tcfg", {})), spec,
                            shape.vocab_size, T)
    if load is not None:
        src = torch.load(load)["state"]
        own = dict(model.named_parameters())
        mapped = {te_name(k): t for k, t in src.items()}
        assert mapped.keys() == own.keys(), (sorted(mapped.keys() ^ own.keys()))
        with torch.no_grad():
            for k, p in own.items():
                p.copy_(mapped[k])
    tokens, labels, mask = batch(0)
    with cache.batch(LENGTHS) as pb:
        logits = model(tokens, pb.position_ids_1T, None, packed_seq_params=pb.packed_seq_params)
    with cache.batch(LENGTHS) as pb:
        per_token = model(tokens, pb.position_ids_1T, None, labels=labels,
                          packed_seq_params=pb.packed_seq_params)
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    out = {"state": {k: p.detach().clone() for k, p in model.named_parameters()},
           "logits": logits.detach(), "loss": loss.detach(), "grads": grads,
           "types": sorted({type(m).__name__ for m in model.modules()})}
    if load is not None:
        back = {te_name(k): k for k in torch.load(load)["state"]}
        out["grads_local_names"] = {back[k]: g for k, g in grads.items()}
    return out


if __name__ == "__main__":
    impl, variant = sys.argv[1], sys.argv[2]
    if impl == "te":
        from tests.support.fake_te.activate import activate

        activate()
        load, dest = sys.argv[3], sys.argv[4]
    else:
        load, dest = None, sys.argv[3]
    import torch

    result = run(impl, variant, load)
    import megatron.core.extensions.transformer_engine as mte

    result["HAVE_TE"] = mte.HAVE_TE
    torch.save(result, dest)
