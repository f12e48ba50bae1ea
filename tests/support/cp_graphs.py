"""Test-only: the context-parallel CUDA-graph runs' shared settings (the sdpa and te tests of
tests/train/test_context_parallel_graphs.py and test_context_parallel_te_graphs.py)."""

# 24 samples pack into 6 microbatches (data.max_seqs binds): 3 steps of 2 an epoch; epoch 2
# replays them in another order (training.epochs reshuffles the packed bins every epoch)
EPOCHS, MICRO, BINS = 2, 2, 6
STEPS = EPOCHS * BINS // MICRO
COMMON = [f"training.epochs={EPOCHS}", f"training.micro_batches={MICRO}", "training.warmup_steps=1",
          "data.num_samples=24", "data.max_tokens=256", "data.max_len=40", "data.max_seqs=4",
          "model=tiny_dense", "parallel=single", "model.num_layers=2", "model.hidden_size=64",
          "model.ffn_hidden_size=96", "fastpath.attention_backend=sdpa",
          # what a GPU-path run needs on a CPU (tests/train/feature_matrix/matrix.py FIXED; the graphs' own: GRAPHS)
          "training.skip_memory_check=true", "cluster.backend=gloo", "fastpath.linear_impl=local"]
CP2 = ["parallel.context_parallel_size=2"]
GRAPHS = ["fastpath.cuda_graphs=true", "cuda_graphs.use_te_rng_tracker=false"]
CUDA = ["training.device=cuda"]
LAYERS = 2
# per layer and replay: forward K and V all-gathered, backward their gradients all-reduced
FWD_COLLECTIVES = {"allgather_": 2}
BWD_COLLECTIVES = {"allreduce_": 2}


def counting_replays(real_waited, replayed):
    """A stand-in for ``graph_safe_standins._waited`` (the fake graph's replay of a captured
    collective) that counts each replayed collective by name into ``replayed`` (a Counter)."""

    def waited(collective):
        run = real_waited(collective)
        name = collective.overloadpacket.__name__

        def counted(*args, **kwargs):
            replayed[name] += 1
            return run(*args, **kwargs)

        counted.collective = name
        return counted

    return waited


def layer_graphs(model) -> list:
    """Per layer of ``model``: whether its forward / backward graphs were captured, how often
    each was replayed and the collectives each captured ({name: count})."""
    import collections

    from tests.support.megatron_graphs import graph_runners

    def collectives(graph):
        return dict(collections.Counter(op.func.collective for op in graph.ops
                                        if hasattr(op.func, "collective")))

    return [dict(fwd_captured=r.fwd_graph.captured, bwd_captured=r.bwd_graph.captured,
                 fwd_replays=r.fwd_graph.replays, bwd_replays=r.bwd_graph.replays,
                 fwd_collectives=collectives(r.fwd_graph), bwd_collectives=collectives(r.bwd_graph))
            for r in graph_runners(model)]
