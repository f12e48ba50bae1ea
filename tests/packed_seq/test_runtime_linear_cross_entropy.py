"""The packed runtime's forward with the chunked linear cross-entropy
(``forward(..., linear_cross_entropy=True)``) and the evaluator's chunked ``forward_eval``, and
the compat shim under them (``compat/gpt_output.py``: 0.19.x's ``output_processor=``; on 0.16.x
the same steps run by the shim). The suite runs on both lines, so each test checks the installed
one against Megatron's own ``model(...)``."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from megatron_fastpath.compat.gpt_output import forward_with_output_processor
from megatron_fastpath.packed_seq.runtime import forward, forward_eval, vocab_parallel_argmax
from tests.support.tiny_gpt import LENGTHS, SHAPE, T, batch


def _model(tied: bool, lora=None, seed=0):
    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.lora import with_lora
    from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, rope=rope_config_for(SHAPE)))
    spec = get_fastpath_layer_spec(cache, backend="sdpa")
    if lora is not None:
        spec = with_lora(spec, lora)
    torch.manual_seed(seed)
    model = build_gpt_model(build_transformer_config(SHAPE), spec, SHAPE.vocab_size, T,
                            share_embeddings_and_output_weights=tied)
    return model, cache


def _megatron_tail(*, hidden_states, output_layer, output_weight, labels, compute_language_model_loss, **_):
    """What GPTModel's _postprocess runs after the processor slot (no MuP, no inference)."""
    logits, _ = output_layer(hidden_states, weight=output_weight)
    out = logits.transpose(0, 1).clone()  # before the loss, which works on the logits in place
    return compute_language_model_loss(labels, logits), out


@pytest.mark.parametrize("tied", [False, True])
def test_shim_runs_what_the_model_runs(mcore_parallel, tied):
    """The processor slot of the installed line: with Megatron's own tail as the processor, the
    loss and the logits are ``model(...)``'s, bit for bit (0.16.1: the shim's _preprocess /
    decoder steps; 0.19.2: GPTModel's output_processor)."""
    model, cache = _model(tied)
    tokens, labels, _ = batch()
    with cache.batch(LENGTHS) as pb:
        kw = dict(packed_seq_params=pb.packed_seq_params, padding_mask=pb.padding_mask_1T)
        loss_1T, logits_1TV = forward_with_output_processor(
            model, _megatron_tail, tokens, pb.position_ids_1T, None, labels=labels, **kw)
        assert torch.equal(loss_1T, model(tokens, pb.position_ids_1T, None, labels=labels, **kw))
        assert torch.equal(logits_1TV, model(tokens, pb.position_ids_1T, None, **kw))


def _loss_and_grads(model, cache, chunked: bool):
    tokens, labels, mask = batch()
    model.zero_grad(set_to_none=True)
    with cache.batch(LENGTHS) as pb:
        per_token_1T = forward(model, pb, tokens, labels, linear_cross_entropy=chunked)
        (per_token_1T * mask).sum().backward()
    return per_token_1T.detach(), {k: p.grad.clone() for k, p in model.named_parameters()
                                   if p.grad is not None}


@pytest.mark.parametrize("kind", ["untied", "tied", "lora"])
def test_chunked_forward_equals_megatron_loss(mcore_parallel, kind):
    """``forward(..., linear_cross_entropy=True)`` trains what Megatron's output layer and
    ``compute_language_model_loss`` train: per-token losses and every parameter's gradient
    within float32 tolerance (tied: the embedding's gradient gathers both uses; LoRA: the
    output layer frozen)."""
    from megatron_fastpath.lora import LoRAConfig, freeze_base_parameters

    lora = LoRAConfig(rank=4, alpha=8.0, dropout=0.0) if kind == "lora" else None
    model, cache = _model(kind == "tied", lora)
    if lora is not None:
        freeze_base_parameters(model)
    with mock.patch("megatron_fastpath.loss.linear_cross_entropy.linear_cross_entropy",
                    wraps=__import__("megatron_fastpath.loss.linear_cross_entropy",
                                     fromlist=["x"]).linear_cross_entropy) as lce:
        loss_c, grads_c = _loss_and_grads(model, cache, True)
    assert lce.call_count == 1  # the chunked loss ran in place of the output layer
    loss_m, grads_m = _loss_and_grads(model, cache, False)
    torch.testing.assert_close(loss_c, loss_m, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads_m.keys() and grads_m
    for k in grads_m:
        torch.testing.assert_close(grads_c[k], grads_m[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("tied", [False, True])
def test_forward_eval_equals_the_logits_path(mcore_parallel, tied):
    """The evaluator's chunked forward: Megatron's loss and the greedy predictions of the full
    logits, a chunk of tokens at a time (chunks of 5 rows here: the last one short)."""
    model, cache = _model(tied)
    tokens, labels, _ = batch()
    model.eval()
    with torch.no_grad(), cache.batch(LENGTHS) as pb, mock.patch(
            "megatron_fastpath.loss.linear_cross_entropy.DEFAULT_CHUNK_BYTES", 5 * 4 * SHAPE.vocab_size):
        loss_1T, pred_1T = forward_eval(model, pb, tokens, labels)
        logits_1TV = forward(model, pb, tokens)
        want = model.compute_language_model_loss(labels, logits_1TV.transpose(0, 1).contiguous())
    torch.testing.assert_close(loss_1T, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(pred_1T, vocab_parallel_argmax(logits_1TV))


def test_output_layer_hooks(mcore_parallel):
    """The chunked loss stands in for the output layer's forward: its forward pre-hooks run
    (Megatron's DDP waits there for the parameter all-gather), a forward hook, which would
    change logits that are never formed (Gemma's soft-capping), is refused."""
    model, cache = _model(False)
    tokens, labels, _ = batch()
    seen = []
    handle = model.output_layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    with cache.batch(LENGTHS) as pb:
        forward(model, pb, tokens, labels, linear_cross_entropy=True)
    assert seen == [torch.Size([T, 1, SHAPE.hidden_size])]
    handle.remove()
    model.output_layer.register_forward_hook(lambda m, args, out: out)
    with cache.batch(LENGTHS) as pb, pytest.raises(ValueError, match="has forward hooks .* use "
                                                   "fastpath.linear_cross_entropy=off"):
        forward(model, pb, tokens, labels, linear_cross_entropy=True)


def test_default_rule_at_the_forward(mcore_parallel):
    """``linear_cross_entropy=None`` (the hooks' setting when the vocabulary is not known at
    plan time): ``rules.default_linear_cross_entropy`` on this rank's labels and output rows."""
    from megatron_fastpath import rules

    model, cache = _model(False)
    tokens, labels, _ = batch()
    path = "megatron_fastpath.packed_seq.runtime._linear_cross_entropy_output"
    for threshold, calls in ((T * SHAPE.vocab_size + 1, 0), (T * SHAPE.vocab_size, 1)):
        with mock.patch.object(rules, "LINEAR_CROSS_ENTROPY_MIN_LOGITS", threshold), \
                mock.patch(path, side_effect=lambda **kw: torch.zeros(1, T)) as proc, \
                cache.batch(LENGTHS) as pb:
            forward(model, pb, tokens, labels, linear_cross_entropy=None)
        assert proc.call_count == calls, threshold



def test_default_rule_on_a_stage_before_the_last(mcore_parallel):
    """A pipeline stage before the last (``post_process=False``: no output layer) returns its
    hidden states whatever ``linear_cross_entropy`` is: the default rule is not asked (it reads
    the output layer's rows), even where the labels reach every stage (the hooks' PP runs)."""
    from megatron_fastpath import rules
    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, rope=rope_config_for(SHAPE)))
    torch.manual_seed(0)
    model = build_gpt_model(build_transformer_config(SHAPE), get_fastpath_layer_spec(cache, backend="sdpa"),
                            SHAPE.vocab_size, T, post_process=False)
    assert not hasattr(model, "output_layer")
    tokens, labels, _ = batch()
    with mock.patch.object(rules, "LINEAR_CROSS_ENTROPY_MIN_LOGITS", 1), cache.batch(LENGTHS) as pb:
        hidden = forward(model, pb, tokens, labels, linear_cross_entropy=None)
    assert hidden.shape == (T, 1, SHAPE.hidden_size)
