"""The logits and loss as GPTModel computes them, for the linear cross-entropy's tests: the output
layer a real Megatron ``ColumnParallelLinear`` (``gather_output=False``, no bias; with tied
embeddings ``skip_weight_param_allocation`` and the embedding's weight passed at call time, as
gpt_model.py's ``_postprocess`` does), then ``compute_language_model_loss``'s steps
(megatron/core/models/common/language_module/language_module.py, 0.16.1 line 139 / 0.19.2
line 166: labels ``[b s] => [s b]``, ``tensor_parallel.vocab_parallel_cross_entropy``, the loss
``[s b] => [b s]``)."""

import torch


def output_layer(config, hidden: int, vocab: int, tied: bool):
    """GPTModel's output layer (gpt_model.py: ``tensor_parallel.ColumnParallelLinear(config.hidden_size,
    self.vocab_size, ..., bias=False, skip_bias_add=False, gather_output=not self.parallel_output,
    skip_weight_param_allocation=self.pre_process and self.share_embeddings_and_output_weights)``)."""
    from megatron.core import tensor_parallel

    return tensor_parallel.ColumnParallelLinear(
        hidden, vocab, config=config, init_method=config.init_method, bias=False, skip_bias_add=False,
        gather_output=False, skip_weight_param_allocation=tied)


def megatron_loss(layer, hidden_SBH, labels_BS, weight=None, label_smoothing=0.0):
    """Per-token float32 loss ``[B, S]`` through Megatron's own output layer and cross-entropy."""
    from megatron.core import tensor_parallel

    logits, _ = layer(hidden_SBH, weight=weight)
    labels = labels_BS.transpose(0, 1).contiguous()
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels, label_smoothing)
    return loss.transpose(0, 1).contiguous()
