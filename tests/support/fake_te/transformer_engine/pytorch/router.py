"""Fake ``transformer_engine.pytorch.router``: Megatron-Core 0.16.1 imports these three names
unconditionally for TE >= 2.7 (``extensions/transformer_engine.py``); the fake has no fused
router kernels (``moe_router_fusion`` must stay off)."""


def _absent(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"fake transformer_engine: {name} (fused MoE router) is not stood in")

    fn.__name__ = name
    return fn


fused_topk_with_score_function = _absent("fused_topk_with_score_function")
fused_compute_score_for_moe_aux_loss = _absent("fused_compute_score_for_moe_aux_loss")
fused_moe_aux_loss = _absent("fused_moe_aux_loss")
