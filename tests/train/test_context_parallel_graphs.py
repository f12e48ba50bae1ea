"""Context parallelism with per-layer CUDA graphs: the main job at CP=2 with
``fastpath.cuda_graphs=true`` under ``torchrun`` (2 processes, gloo), each process inside the
GPU stand-ins (``tests/support/graph_safe_standins.py``: CUDA-as-CPU mode, the fake CUDA graph
that replays captured collectives) on ``training.device=cuda``, so Megatron's own
CudaGraphManager captures and replays every layer on the CPU.

What is checked:

* each layer is captured once (forward and backward graph) and replayed by every later
  microbatch (the runners' counts, as ``tests/support/matrix_runs.check_graphs``);
* the CP all-gather of K/V is inside the captured region: each layer's forward graph holds
  the 2 ``allgather_`` collectives (keys, values) and its backward graph the 2 ``allreduce_``
  of their gradients (``attention/context_parallel.py``), and the fake graph re-issues them at
  every replay (counted);
* the replays see other packings than the captured one: 2 epochs of 6 packings
  (``training.epochs`` reshuffles them), so the replays run every packing, the captured one
  again after others, epoch 2 in another order than epoch 1;
* per-step losses and gradient norms equal the eager CP=2 run's bit for bit, and the CP=1
  run's within rtol 1e-6 / 1e-5 (the tolerance of ``test_context_parallel_torchrun.py``: the
  data packs identically at CP=1 and CP=2, only the order of floating-point sums differs). The
  gradient norm guards the GPU step's loss scaling: Megatron's schedule multiplies the loss by
  the CP size, which ``train.step.gpu_train_step`` divides out (without it the GPU step's CP=2
  gradients would be twice CP=1's; the CPU-path tests cannot see it);
* on a CPU device the same request runs the graph-safety audit in place of the capture, and
  it passes at CP=2 (strict audit: a finding would fail the run).

Each rank of a launch runs ``tests/workers/cp_graphs_worker.py``: the main job inside the
stand-ins, then this rank's graph counts written to ``$CP_GRAPHS_STATS/rank<r>.json``.
"""

from __future__ import annotations

import json

import pytest

from tests.support.cp_graphs import (BINS, BWD_COLLECTIVES, COMMON, CP2, CUDA,
                                     FWD_COLLECTIVES, GRAPHS, LAYERS, MICRO, STEPS)

ENTRY = ["-m", "tests.workers.cp_graphs_worker"]


# --------------------------------------------------------------------------------- the tests
pytestmark = pytest.mark.integration


def _run(tmp_path, name, extra, nproc, entry=ENTRY):
    from tests.support.main_job import job_env, run_main_job

    cwd = tmp_path / name
    cwd.mkdir()
    run = run_main_job([*COMMON, *extra], cwd, nproc=nproc, name=name, entry=entry,
                       env=job_env(CP_GRAPHS_STATS=str(cwd)))
    stats = [json.loads((cwd / f"rank{r}.json").read_text()) for r in range(nproc)]
    return run, stats


def _losses(run):
    return [r["loss"] for r in run.summary["records"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp-graphs")
    return {
        "graphs": _run(tmp, "cp2-graphs", [*CUDA, *CP2, *GRAPHS], 2),
        "eager": _run(tmp, "cp2-eager", [*CUDA, *CP2], 2),
        "cp1": _run(tmp, "cp1-eager", [*CUDA], 1),
    }


def test_each_layer_captured_once_and_replayed_with_its_collectives(runs):
    run, stats = runs["graphs"]
    replays = (STEPS - 1) * MICRO  # captured at the end of step 1, replayed by every later microbatch
    for rank in stats:
        assert len(rank["layers"]) == LAYERS, "one runner per layer"
        for layer in rank["layers"]:
            assert layer["fwd_captured"] and layer["bwd_captured"]
            assert layer["fwd_replays"] == layer["bwd_replays"] == replays
            # the CP all-gather of K/V (and its backward) inside the captured graphs
            assert layer["fwd_collectives"] == FWD_COLLECTIVES
            assert layer["bwd_collectives"] == BWD_COLLECTIVES
        # ... and re-issued at every replay
        assert rank["replayed"] == {
            name: n * LAYERS * replays for name, n in {**FWD_COLLECTIVES, **BWD_COLLECTIVES}.items()}
    assert "world 2" in run.output


def test_replays_see_other_packings_in_other_orders(runs):
    """The graphs are captured with step 1's first microbatch; the replays (steps 2-6) run
    every packing of the data, the captured one again after others, epoch 2 in another order."""
    _, stats = runs["graphs"]
    assert all(s["packings"] == stats[0]["packings"] for s in stats)  # the same batches on both CP ranks
    packings = [tuple(mb) for step in stats[0]["packings"] for mb in step]
    assert len(packings) == STEPS * MICRO
    captured, replayed = packings[0], packings[MICRO:]
    epoch1, epoch2 = packings[:BINS], packings[BINS:]
    assert len(set(epoch1)) == BINS and set(epoch2) == set(epoch1) and epoch2 != epoch1, packings
    assert len(set(replayed) - {captured}) >= 3, packings
    assert captured in replayed and replayed.index(captured) > 0, packings


def test_losses_equal_eager_cp2_and_cp1(runs):
    graphs, eager, cp1 = runs["graphs"][0], runs["eager"][0], runs["cp1"][0]
    assert [r["step"] for r in graphs.summary["records"]] == list(range(1, STEPS + 1))
    assert _losses(graphs) == _losses(eager)
    for a, b in zip(_losses(cp1), _losses(graphs)):
        assert b == pytest.approx(a, rel=1e-6)
    for ra, rb in zip(cp1.summary["records"], graphs.summary["records"]):
        assert rb["tokens"] == ra["tokens"]
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-5), (ra, rb)
    assert ([r["grad_norm"] for r in graphs.summary["records"]]
            == [r["grad_norm"] for r in eager.summary["records"]])
    # the eager runs build no graphs
    assert all(s["layers"] == [] for s in runs["eager"][1] + runs["cp1"][1])


def test_graph_safety_audit_passes_at_cp2_on_cpu(tmp_path):
    """On a CPU device the graphs request runs the strict graph-safety audit at CP=2."""
    from tests.support.main_job import run_main_job

    run = run_main_job([*COMMON, *CP2, *GRAPHS, "training.device=cpu", "cuda_graphs.audit_steps=3"],
                       tmp_path, nproc=2, name="audit")
    assert "the graph-safety audit runs over 3 steps" in run.output
    assert "graph-safety audit over 3 steps: PASS (0 findings)" in run.output, run.output[-3000:]
    assert len(run.summary["records"]) == STEPS
