"""Activation offload shims (offload/layer.py): RNG states and TransformerLayer.forward's parameters."""

from __future__ import annotations


from megatron_fastpath.compat import MCORE_VERSION, _require_checked_mcore


# =============================================================================================
# Activation offload shims (megatron_fastpath/offload/layer.py).
# =============================================================================================


def all_rng_state_tools():
    """(get_all(), set_all(*states)) over every RNG a recomputed layer must replay on CUDA: the
    CPU and CUDA default generators and Megatron's CUDA RNG tracker states.

    0.16.x and 0.19.x keep them private (``megatron.core.tensor_parallel.random._get_all_rng_states`` /
    ``_set_all_rng_states``, what Megatron's own ``CheckpointFunction`` uses; unchanged in
    0.19.2 tensor_parallel/random.py:525 / :535); set_all takes the tuple get_all returned,
    unpacked."""
    _require_checked_mcore(
        "all_rng_state_tools",
        "tensor_parallel.random._get_all_rng_states / _set_all_rng_states are private and their "
        "return tuple is unpacked into _set_all_rng_states",
    )
    from megatron.core.tensor_parallel import random as mcore_random

    get_all = getattr(mcore_random, "_get_all_rng_states", None)
    set_all = getattr(mcore_random, "_set_all_rng_states", None)
    if get_all is None or set_all is None:  # pragma: no cover - other versions
        raise ImportError(f"megatron-core {MCORE_VERSION} has no _get_all_rng_states / "
                          "_set_all_rng_states in tensor_parallel.random")
    return get_all, set_all


def transformer_layer_forward_params() -> tuple:
    """``inspect.Parameter`` s of ``TransformerLayer.forward``'s arguments (without ``self``).

    0.16.x declares ``forward(self, *args, **kwargs)`` and forwards everything to the private
    ``_forward_attention``, whose signature is the real one (hidden_states, attention_mask,
    context, ..., packed_seq_params, sequence_len_offset, ...). The offload layer binds
    positional arguments by these names. Unchanged in 0.19.x (0.19.2
    transformer/transformer_layer.py:747 ``forward(self, *args, **kwargs)``, :583
    ``_forward_attention(self, hidden_states, attention_mask, ...)``)."""
    _require_checked_mcore(
        "transformer_layer_forward_params",
        "TransformerLayer.forward(*args, **kwargs) forwards to the private _forward_attention, "
        "whose signature is read as the layer's",
    )
    import inspect

    from megatron.core.transformer.transformer_layer import TransformerLayer

    params = [p for p in inspect.signature(TransformerLayer._forward_attention).parameters.values()
              if p.name != "self"]
    if not params or params[0].name != "hidden_states":  # pragma: no cover - other versions
        raise ImportError(f"megatron-core {MCORE_VERSION}: TransformerLayer._forward_attention "
                          "does not start with hidden_states")
    return tuple(params)
