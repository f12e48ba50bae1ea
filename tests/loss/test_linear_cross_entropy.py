"""``linear_cross_entropy`` equals Megatron's output layer + ``vocab_parallel_cross_entropy`` (the
loss GPTModel returns, tests/loss/megatron_reference.py) at TP 1: the per-token loss, the hidden
states' gradient and the output weight's gradient, under a loss-mask gradient, for tied and
untied weights, a frozen weight (LoRA), label smoothing 0 and 0.1, one chunk and several with T
not a multiple of the chunk, float32 and bfloat16; with no host sync and no ``[T, V]`` tensor
kept for backward, where Megatron's path keeps one."""

import pytest
import torch

from megatron_fastpath.loss import DEFAULT_CHUNK_BYTES, chunk_rows, linear_cross_entropy
from megatron_fastpath.model import ModelConfig, build_transformer_config
from megatron_fastpath.sync import SyncSentinel
from tests.loss.megatron_reference import megatron_loss, output_layer

S, B, H, V = 13, 2, 16, 50  # T = 26 tokens
SHAPE = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_query_groups=2,
                    ffn_hidden_size=32, vocab_size=V)


def inputs(dtype, tied, frozen, seed=0, vocab=V):
    """(layer, weight passed at call time or None, the weight, hidden, labels, grad_output, tokens):
    labels with an id outside the vocabulary (-100) among them; grad_output a loss mask (a third
    of the tokens off) times 1 / its sum, as the train step scales the loss."""
    torch.manual_seed(seed)
    layer = output_layer(build_transformer_config(SHAPE, params_dtype=dtype), H, vocab, tied)
    weight = torch.nn.Parameter((torch.randn(vocab, H) * 0.5).to(dtype)) if tied else layer.weight
    if frozen:
        weight.requires_grad_(False)
    hidden = torch.randn(S, B, H).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (B, S))
    labels[0, 3] = -100
    mask = (torch.rand(B, S) > 0.33).float()
    tokens = torch.randint(0, vocab, (B, S))
    return layer, (weight if tied else None), weight, hidden, labels, mask / mask.sum(), tokens


def loss_and_grads(fn, weight, hidden, tokens, tied, grad_output):
    """The loss, then the gradients of ``(loss * grad_output).sum()`` for the hidden and the weight;
    tied: the hidden is ``hidden + embedding(tokens)`` with the same weight, so the weight's
    gradient sums both uses."""
    h = hidden + torch.nn.functional.embedding(tokens, weight).transpose(0, 1) if tied else hidden
    loss = fn(h)
    wanted = [hidden] + ([weight] if weight.requires_grad else [])
    grads = torch.autograd.grad((loss * grad_output).sum(), wanted)
    return loss.detach(), grads[0], (grads[1] if weight.requires_grad else None)


CASES = [(tied, frozen, smoothing, chunk)
         for tied, frozen in ((False, False), (True, False), (False, True))
         for smoothing in (0.0, 0.1) for chunk in (None, 7, 1)]


@pytest.mark.parametrize("tied, frozen, smoothing, chunk", CASES)
def test_equals_megatron_in_float32(mcore_parallel, tied, frozen, smoothing, chunk):
    layer, call_w, weight, hidden, labels, g, tokens = inputs(torch.float32, tied, frozen)
    ref = loss_and_grads(lambda h: megatron_loss(layer, h, labels, call_w, smoothing), weight, hidden,
                         tokens, tied, g)
    ours = loss_and_grads(lambda h: linear_cross_entropy(h, weight, labels, label_smoothing=smoothing,
                                                         chunk_tokens=chunk), weight, hidden, tokens, tied, g)
    assert ours[0].dtype == torch.float32 and ours[0].shape == (B, S)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-7)
    if frozen:
        assert ours[2] is None and ref[2] is None and weight.grad is None
    else:
        assert ref[2].abs().sum() > 0
        torch.testing.assert_close(ours[2], ref[2], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tied, frozen", [(False, False), (True, False), (False, True)])
def test_equals_megatron_in_bfloat16(mcore_parallel, tied, frozen):
    """bf16 hidden and weight: the logits are the bf16 GEMM's, upcast as Megatron upcasts them, so
    the losses agree to float32 rounding; the gradients to bf16 rounding (ours sums the chunks'
    weight gradients in float32, Megatron's one GEMM rounds once)."""
    layer, call_w, weight, hidden, labels, g, tokens = inputs(torch.bfloat16, tied, frozen)
    ref = loss_and_grads(lambda h: megatron_loss(layer, h, labels, call_w), weight, hidden, tokens, tied, g)
    ours = loss_and_grads(lambda h: linear_cross_entropy(h, weight, labels, chunk_tokens=5), weight, hidden,
                          tokens, tied, g)
    assert ours[1].dtype == torch.bfloat16
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[1], ref[1], rtol=2e-2, atol=1e-4)
    if not frozen:
        assert ours[2].dtype == torch.bfloat16
        torch.testing.assert_close(ours[2], ref[2], rtol=2e-2, atol=1e-3)


def test_any_grad_output_not_only_a_scalar_mean(mcore_parallel):
    """A per-token gradient of any sign and size gives Megatron's gradients (the backward scales
    each token's softmax row by its own grad_output)."""
    layer, _, weight, hidden, labels, _, tokens = inputs(torch.float32, False, False)
    g = torch.randn(B, S) * 3
    ref = loss_and_grads(lambda h: megatron_loss(layer, h, labels), weight, hidden, tokens, False, g)
    ours = loss_and_grads(lambda h: linear_cross_entropy(h, weight, labels, chunk_tokens=4), weight, hidden,
                          tokens, False, g)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-5, atol=1e-6)


def test_no_grad_returns_the_loss_and_keeps_nothing(mcore_parallel):
    layer, _, weight, hidden, labels, _, _ = inputs(torch.float32, False, False)
    with torch.no_grad():
        ref = megatron_loss(layer, hidden, labels)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            ours = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    assert saved == [] and not ours.requires_grad
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_forward_and_backward_read_nothing_on_the_host(mcore_parallel):
    _, _, weight, hidden, labels, g, _ = inputs(torch.float32, False, False)
    for smoothing in (0.0, 0.1):
        with SyncSentinel() as s:
            loss = linear_cross_entropy(hidden, weight, labels, label_smoothing=smoothing, chunk_tokens=7)
            (loss * g).sum().backward()
        assert s.num_syncs == 0, s.summary()
        assert s.aten_ops > 0  # the sentinel saw the work


def saved_numels(fn) -> list[int]:
    """numel of every tensor the autograd graph saves for backward while ``fn`` runs."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


@pytest.mark.parametrize("frozen", [False, True])
def test_no_T_by_V_tensor_is_kept_for_backward(mcore_parallel, frozen):
    """Megatron's path saves its [T, V] softmax; ours at most O(T * H) (the hidden, or with a
    frozen weight the [T, H] hidden gradient formed in forward) and O(T) tensors, the weight
    itself being the parameter (V = 256 > 4 H here)."""
    V = 256
    layer, _, weight, hidden, labels, _, _ = inputs(torch.float32, False, frozen, vocab=V)
    T = S * B
    ref = saved_numels(lambda: megatron_loss(layer, hidden, labels))
    ours = saved_numels(lambda: linear_cross_entropy(hidden, weight, labels, chunk_tokens=4))
    assert max(ref) >= T * V
    assert ours and max(n for n in ours if n != V * H) <= T * H < T * V / 4
    assert sum(n for n in ours if n != V * H) <= 2 * T * H


def test_chunk_rows_rule():
    assert chunk_rows(26, 50, 7) == 7 and chunk_rows(26, 50, 100) == 26 and chunk_rows(1, 50, 4) == 1
    assert chunk_rows(100_000, 128_256) == DEFAULT_CHUNK_BYTES // (4 * 128_256) == 523
    assert chunk_rows(16_384, 64_128) == 1046 and chunk_rows(300, 32_000) == 300
    with pytest.raises(ValueError, match="chunk_tokens=0 must be >= 1"):
        chunk_rows(26, 50, 0)


def test_bad_input_refused_with_one_line():
    h, w, labels = torch.randn(S, B, H), torch.randn(V, H), torch.randint(0, V, (B, S))
    with pytest.raises(ValueError, match=r"^error: linear_cross_entropy takes hidden \[S, B, H\]"):
        linear_cross_entropy(h[0], w, labels)
    with pytest.raises(ValueError, match=r"labels \(13, 2\) must be \[B, S\] = \(2, 13\)"):
        linear_cross_entropy(h, w, labels.t())
    with pytest.raises(ValueError, match=r"weight \(50, 8\) \[V/TP, 16\]"):
        linear_cross_entropy(h, w[:, :8], labels)
    with pytest.raises(ValueError, match=r"label_smoothing=1.0 must be in \[0, 1\)"):
        linear_cross_entropy(h, w, labels, label_smoothing=1.0)
    with pytest.raises(ValueError, match="sequence_parallel=True needs a tensor-parallel group of 2"):
        linear_cross_entropy(h, w, labels, sequence_parallel=True)
