"""``GPTModel.forward`` with an output processor in place of Megatron's logits and loss.

megatron-core 0.19.x's ``GPTModel.forward`` takes ``output_processor=`` (0.19.2
models/gpt/gpt_model.py:519-534; called in ``_postprocess`` at :720-737 on the last pipeline
stage, after multi-token prediction and before the output layer): the callable gets the decoder's
hidden states [S, B, H], ``output_layer``, ``output_weight`` (the shared embedding weight when
tied), ``labels`` and the rest as keywords, and its return is the model's output. The model's
wrappers pass the keyword through (``_BaseDataParallel.forward``: distributed/data_parallel_base.py:18-22;
``Float16Module.forward``: transformer/module.py:477-520 casts positional inputs only).

0.16.x has no such argument (0.16.1 models/gpt/gpt_model.py:470-557). There the shim runs the
same steps as that forward on the wrapped ``GPTModel`` -- ``preprocess_for_fine_grained_offloading``
when configured (:499-500), ``_preprocess`` (:504-522), the decoder (:525-537), then on the last
stage the processor with what 0.19.x hands it (``_postprocess``'s output weight, :589-591) -- and
returns the hidden states on the other stages (:608-609). The wrappers it steps over do nothing
for these inputs: DDP's ``forward`` calls the module (data_parallel_base.py:18-22) and
``Float16Module`` casts floating positional inputs (none here: token and position ids) and the
last stage's output to float32 (transformer/module.py:453-496; a processor returns float32).

Multi-token prediction runs in 0.16.x's ``_postprocess`` before the logits (:592-660): the shim
refuses a model with it (``rules._linear_cross_entropy`` refuses it first).
"""

from __future__ import annotations

from megatron_fastpath.compat import MCORE_0_19, _require_checked_mcore

__all__ = ["forward_with_output_processor", "output_weight_for_call", "unwrap_gpt_model"]

_REASON = ("GPTModel.forward takes output_processor= on 0.19.x (gpt_model.py:519-534, :720-737); "
           "on 0.16.x its _preprocess / decoder / _postprocess steps are run here (gpt_model.py:470-557)")


def unwrap_gpt_model(model):
    """The module under Megatron's wrappers (DDP, ``Float16Module``: each keeps it in
    ``.module``) that has the ``GPTModel`` forward's pieces."""
    inner = model
    while not hasattr(inner, "_preprocess") and hasattr(inner, "module"):
        inner = inner.module
    if not hasattr(inner, "_preprocess"):
        raise TypeError(f"{type(model).__name__} wraps no Megatron GPTModel (no _preprocess under .module)")
    return inner


def _run_pre_hooks(module, args: tuple) -> tuple:
    """What ``module(*args)`` runs before its forward: its forward pre-hooks (Megatron's DDP
    waits there for the parameter all-gather with ``overlap_param_gather``), in order; a forward
    (post) hook would change an output that is never formed: refused."""
    if module._forward_hooks or getattr(module, "_forward_pre_hooks_with_kwargs", None):
        raise ValueError(
            f"the model's {type(module).__name__} has forward hooks (e.g. Gemma's final-logit "
            "soft-capping on the output layer) that a processor in place of its forward would "
            "skip; use fastpath.linear_cross_entropy=off")
    for hook in module._forward_pre_hooks.values():
        result = hook(module, args)
        if result is not None:
            args = result if isinstance(result, tuple) else (result,)
    return args


def output_weight_for_call(output_layer, output_weight, hidden_states):
    """The [V / TP, H] weight the output layer would multiply ``hidden_states`` by (its own, or
    ``output_weight`` when tied, as ``ColumnParallelLinear.forward`` picks it), after its forward
    pre-hooks ran as they would on a call."""
    _run_pre_hooks(output_layer, (hidden_states,))
    return output_layer.weight if output_weight is None else output_weight


def forward_with_output_processor(model, processor, input_ids, position_ids, attention_mask, *,
                                  labels, packed_seq_params, padding_mask):
    """``model(input_ids, position_ids, attention_mask, labels=..., packed_seq_params=...,
    padding_mask=...)`` with ``processor`` in place of the output layer and loss on the last
    pipeline stage (the hidden states on the others)."""
    line = _require_checked_mcore("gpt_output", _REASON)
    kwargs = dict(labels=labels, packed_seq_params=packed_seq_params, padding_mask=padding_mask)
    if line == MCORE_0_19:
        return model(input_ids, position_ids, attention_mask, output_processor=processor, **kwargs)
    gpt = unwrap_gpt_model(model)
    if gpt.mtp_process or gpt.config.mtp_num_layers:
        raise ValueError("an output processor with multi-token prediction (mtp_num_layers): "
                         "megatron-core 0.16.1 computes its losses from the logits first")
    input_ids, position_ids, attention_mask = _run_pre_hooks(gpt, (input_ids, position_ids, attention_mask))
    if gpt.config.fine_grained_activation_offloading:  # 0.16.1 gpt_model.py:499-500
        gpt.preprocess_for_fine_grained_offloading()
    pre = gpt._preprocess(input_ids=input_ids, position_ids=position_ids, decoder_input=None,
                          inference_context=None, packed_seq_params=packed_seq_params,
                          padding_mask=padding_mask)
    decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask = pre[:6]
    hidden_states = gpt.decoder(
        hidden_states=decoder_input, attention_mask=attention_mask, inference_context=None,
        rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
        rotary_pos_cos_sin=pre[6] if len(pre) == 7 else None, packed_seq_params=packed_seq_params,
        sequence_len_offset=sequence_len_offset, padding_mask=padding_mask)
    if not gpt.post_process:
        return hidden_states
    output_weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    return processor(
        hidden_states=hidden_states, output_layer=gpt.output_layer, output_weight=output_weight,
        labels=labels, loss_mask=None, input_ids=input_ids, position_ids=position_ids,
        attention_mask=attention_mask, decoder_input=decoder_input, inference_context=None,
        packed_seq_params=packed_seq_params, runtime_gather_output=None, context=None,
        compute_language_model_loss=gpt.compute_language_model_loss,
        scale_logits=lambda logits: logits,  # 0.16.x has no MuP logit scaling
        config=gpt.config)
