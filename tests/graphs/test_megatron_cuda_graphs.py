"""Megatron's own CudaGraphManager (megatron-core 0.16.1, ``cuda_graph_impl="local"``) captured and
replayed on CPU over the CUDA-graph stand-in, on a stock Megatron GPTModel (Megatron's local
layer spec, RoPE, causal mask): the 0.16.1 input-buffer recycling bug reproduced, the compat
shim that fixes it, and the RNG-tracker setup graphs need.

Tolerance: graphed and eager runs issue the same aten ops on the same values, so losses and
gradients agree to float32 rounding; asserted as rtol=1e-5, atol=1e-6 (observed: 0)."""

import pytest
import torch
from packaging.version import Version

from megatron_fastpath import compat
from tests.support.megatron_graphs import graph_runners, graph_session, max_rel_diff, run_steps

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

S, B, V = 16, 2, 50


def _build(graphs: bool, num_layers: int = 3, warmup: int = 1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        cuda_graph_impl="local" if graphs else "none", cuda_graph_scope=[],
        cuda_graph_warmup_steps=warmup)
    torch.manual_seed(0)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=V, max_sequence_length=S,
                    position_embedding_type="rope")


def _steps(n_steps=3, n_mb=3):
    g = torch.Generator().manual_seed(7)
    mbs = [torch.randint(0, V, (B, S), generator=g) for _ in range(n_mb)]
    # every step serves the same runners with the microbatches in a different order
    orders = [[0, 1, 2], [2, 0, 1], [1, 2, 0]][:n_steps]
    return [[mbs[i] for i in order] for order in orders]


def _forward_step(tokens, model):
    pos = torch.arange(S)[None].expand(B, S)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None].expand(B, 1, S, S).contiguous()
    out = model(tokens, pos, mask, labels=tokens)

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def _eager_and_graphed(shim: bool):
    from megatron_fastpath.graphs import prepare_cuda_graphs

    setup = prepare_cuda_graphs(1234, use_te_rng_tracker=False)
    # the shim is 0.16.x's; 0.19.x keeps forward-graph input buffers itself
    assert setup.rng_tracker == "megatron-graphable"
    assert setup.input_buffer_shim is (compat.mcore_line() == (0, 16))
    if not shim:
        from megatron_fastpath.compat.graphs import restore_cudagraph_input_recycling

        restore_cudagraph_input_recycling()
    eager, graphed = _build(False), _build(True)
    graphed.load_state_dict(eager.state_dict())
    steps = _steps()
    le, ge = run_steps(eager, steps, _forward_step, S, B)
    lg, gg = run_steps(graphed, steps, _forward_step, S, B)
    return (le, ge), (lg, gg), graphed


@pytest.mark.smoke
@pytest.mark.usefixtures("mcore_parallel")
def test_stock_gpt_megatron_graphs_equal_eager_with_the_shim():
    """With the shim on 0.16.x; on 0.19.x with Megatron's own buffer handling, no shim."""
    with graph_session():
        (le, ge), (lg, gg), graphed = _eager_and_graphed(shim=True)
        runners = graph_runners(graphed)
        assert len(runners) == 3  # PP=1: one runner per layer serves every microbatch
        # step 1 records and captures at its end; steps 2 and 3 replay 3 microbatches each
        assert [(r.fwd_graph.replays, r.bwd_graph.replays) for r in runners] == [(6, 6)] * 3
        assert all(r.fwd_graph.num_ops > 20 and r.bwd_graph.num_ops > 20 for r in runners)
    for s in range(3):
        torch.testing.assert_close(lg[s], le[s], rtol=1e-5, atol=1e-6)
        for name in ge[s]:
            torch.testing.assert_close(gg[s][name], ge[s][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {s} {name}: {m}")


@pytest.mark.skipif(not (Version("0.16") <= __import__("megatron_fastpath.compat").compat.MCORE_VERSION
                         < Version("0.17")), reason="the recycling bug is megatron-core 0.16.x's")
@pytest.mark.usefixtures("mcore_parallel")
def test_without_the_shim_megatron_0161_corrupts_the_first_layer_backward():
    """create_fwd_graph returns layer 1's input buffer to the TensorReusePool; the last layer's
    backward graph takes it for its incoming gradient; replaying that backward overwrites
    layer 1's saved input: embedding and layer-1 layernorm gradients go wrong, the loss not."""
    with graph_session():
        (le, ge), (lg, gg), graphed = _eager_and_graphed(shim=False)
        runners = graph_runners(graphed)
        first_input = runners[0].fwd_graph_input_surface[0]
        last_grad_out = runners[-1].static_grad_outputs[0]
        assert first_input.data_ptr() == last_grad_out.data_ptr()
    torch.testing.assert_close(lg[1], le[1], rtol=1e-5, atol=1e-6)  # forward is fine
    diff = max_rel_diff(ge[1], gg[1])
    assert diff["embedding.word_embeddings.weight"] > 1e-3
    assert diff["decoder.layers.0.input_layernorm.weight"] > 1e-2
    assert diff["decoder.layers.2.mlp.linear_fc2.weight"] < 1e-5  # the last layer is untouched


@pytest.mark.parametrize("warmup", [1, 0])
@pytest.mark.usefixtures("mcore_parallel")
def test_frozen_embedding_needs_zero_capture_warmup_in_megatron_0161(warmup):
    """LoRA freezes the embedding, so the first layer's input needs no gradient. 0.16.1's
    create_fwd_graph warm-up calls torch.autograd.grad over the layer's *inputs* only (not its
    parameters): with none requiring grad it raises at the end of step 1. With
    cuda_graph_warmup_steps=0 (the eager step 1 already warmed up) capture works and matches."""
    from megatron_fastpath.graphs import prepare_cuda_graphs

    with graph_session():
        prepare_cuda_graphs(1234, use_te_rng_tracker=False)
        eager, graphed = _build(False), _build(True, warmup=warmup)
        graphed.load_state_dict(eager.state_dict())
        for m in (eager, graphed):
            m.embedding.requires_grad_(False)
        steps = _steps()
        le, ge = run_steps(eager, steps, _forward_step, S, B)
        if warmup:
            with pytest.raises(RuntimeError, match="argument to `grad\\(\\)` cannot be empty"):
                run_steps(graphed, steps, _forward_step, S, B)
            return
        lg, gg = run_steps(graphed, steps, _forward_step, S, B)
        assert [r.fwd_graph.replays for r in graph_runners(graphed)] == [6] * 3
    for s in range(3):
        torch.testing.assert_close(lg[s], le[s], rtol=1e-5, atol=1e-6)
        assert max(max_rel_diff(ge[s], gg[s]).values()) < 1e-5


@pytest.mark.usefixtures("mcore_parallel")
def test_graphed_model_needs_the_graph_safe_rng_tracker_set_up_first():
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    with graph_session():
        initialize_rng_tracker(force_reset=True)  # what a first get_cuda_rng_tracker() makes
        with pytest.raises(AssertionError, match="RNG tracker does not support cudagraphs"):
            _build(True, num_layers=1)
        from megatron_fastpath.graphs import prepare_cuda_graphs

        with pytest.raises(ValueError, match="use_te_rng_tracker=false"):
            prepare_cuda_graphs(1, use_te_rng_tracker=True)  # no Transformer Engine here
        with pytest.raises(ValueError, match="non-negative int"):
            prepare_cuda_graphs(-1, use_te_rng_tracker=False)
        prepare_cuda_graphs(1, use_te_rng_tracker=False)
        from megatron.core.transformer.transformer_layer import TransformerLayer

        model = _build(True, num_layers=1)
        assert [hasattr(m, "cudagraph_manager") for m in model.modules()
                if isinstance(m, TransformerLayer)] == [True]


def test_shim_refuses_an_unchecked_megatron_line():
    from megatron_fastpath.compat.graphs import CudaGraphShimError, keep_cudagraph_input_buffers

    with pytest.raises(CudaGraphShimError, match="CHECKED_MCORE_LINES"):
        keep_cudagraph_input_buffers(Version("0.17.0"))


def test_shim_checks_the_installed_source():
    import types

    from megatron_fastpath.compat.graphs import CudaGraphShimError, _check_fwd_input_recycling_source
    from megatron.core.transformer import cuda_graphs as cg

    if compat.mcore_line() == (0, 19):
        from megatron_fastpath.compat.graphs import _fwd_inputs_kept_upstream

        _fwd_inputs_kept_upstream(cg)  # 0.19: mempool buffers, kept for backward
        with pytest.raises(CudaGraphShimError, match="no longer contains"):
            _check_fwd_input_recycling_source(cg)  # the recycling is gone upstream
        return
    _check_fwd_input_recycling_source(cg)  # the installed 0.16.1 source has the recycling

    class Fixed:
        def create_fwd_graph(self):  # what upstream main looks like: no insert(buf)
            return None

    with pytest.raises(CudaGraphShimError, match="no longer contains"):
        _check_fwd_input_recycling_source(types.SimpleNamespace(_CudaGraphRunner=Fixed))
