"""The ranks of ``tests/train/test_context_parallel_te_graphs.py``'s launch: the same job trained
twice in each process inside the GPU stand-ins, eager and with ``fastpath.cuda_graphs=true``;
each rank writes ``<out>.rank<r>.json`` (losses, graph counts, the stand-in's calls).

    torchrun --nproc_per_node=2 -m tests.workers.cp_te_graphs_worker <out> <overrides...>

``cuda_graphs.use_te_rng_tracker`` stays false and the worker lifts
``graphs/config._check_capture``'s te clause (its other clauses still run) and, with it, the
assert that clause guards (the test module's docstring says why).
"""

from __future__ import annotations

import collections
import json
import sys

from tests.support.cp_graphs import GRAPHS


def _train(overrides, replayed):
    from unittest import mock

    from megatron_fastpath.graphs import config as graphs_config
    from tests.support import gpu_standins as standins
    from tests.support import graph_safe_standins
    from tests.support.hydra_compose import compose_job
    from tests.support.main_job import train_in_standins
    from tests.support.cp_graphs import counting_replays, layer_graphs

    real_check, real_waited, real_capturing = (graphs_config._check_capture, graph_safe_standins._waited,
                                               standins._capturing)
    captured_calls = [0]

    def check_capture(graphs, offload, attention_backend):  # all but the TE RNG tracker clause
        return real_check(graphs, offload, "sdpa" if attention_backend == "te" else attention_backend)

    def capturing():
        answer = real_capturing()
        captured_calls[0] += answer
        return answer

    summary, job = train_in_standins(compose_job(overrides), [
        mock.patch.object(graphs_config, "_check_capture", check_capture),
        mock.patch.object(standins, "_te_cuda_rng_states_tracker_cls", lambda: object),
        mock.patch.object(graph_safe_standins, "_waited", counting_replays(real_waited, replayed)),
        mock.patch.object(standins, "_capturing", capturing)])
    calls = len(standins.TEDotProductAttentionStandIn.calls)  # recorded since the stand-ins were entered
    layers = layer_graphs(job.model)
    packings = [[list(map(int, mb.lengths)) for mb in job.data.batch(s).microbatches]
                for s in range(1, job.cfg.training.steps + 1)]
    records = [[r.step, r.loss, r.grad_norm, r.tokens] for r in summary.records]
    return dict(records=records, layers=layers, packings=packings, standin_calls=calls,
                captured_calls=captured_calls[0], backend=job.cfg.fastpath.attention_backend)


def main(out: str, overrides: list) -> None:
    import torch

    eager = _train(overrides, collections.Counter())
    replayed = collections.Counter()
    graphs = _train(overrides + GRAPHS, replayed)
    graphs["replayed"] = dict(replayed)
    with open(f"{out}.rank{torch.distributed.get_rank()}.json", "w") as f:
        json.dump({"eager": eager, "graphs": graphs}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
