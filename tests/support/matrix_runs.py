"""Test-only: one combination of the feature matrix (tests/train/feature_matrix/)
trained straight and across a checkpoint, in this process: a worker process
(tests/workers/matrix_worker.py; every rank of a ``torchrun`` launch for a world of 2), or the
pytest process under the ``mcore_parallel`` fixture.

The job is built from the plain config tree the matrix classified (``config_tree``: Hydra's
composition of the overrides, which the matrix checks against Hydra itself), so a run composes
nothing; the two runs of a combination set ``checkpoint.dir`` (and the first
``checkpoint.interval``) on it.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
from pathlib import Path
from typing import Optional

import torch

STEPS, STOP = 4, 3


@contextlib.contextmanager
def frozen_heap():
    """Yields ``settle``, to call after every run: it collects what the run left and moves the
    objects alive out of the collector's sight (``gc.freeze``; unfrozen on exit). Megatron's
    graph capture runs ``gc.collect()`` (3 a graphed run), which otherwise walks the whole heap of
    a process holding torch and Megatron, ~0.3 s each. Speed only."""
    def settle():
        gc.collect()
        gc.freeze()

    settle()
    try:
        yield settle
    finally:
        gc.unfreeze()


def with_keys(tree: dict, **keys) -> dict:
    """``tree`` with ``group__leaf=value`` set (the groups copied, ``tree`` unchanged)."""
    out = dict(tree)
    for key, value in keys.items():
        group, leaf = key.split("__")
        assert leaf in out[group], f"{group}.{leaf} is not a key of the config"
        out[group] = dict(out[group], **{leaf: value})
    return out


def records(summary) -> list:
    return [(r.step, r.loss, r.lr) for r in summary.records]


def unpickled_extra_state(key: str, blob: torch.Tensor) -> dict:
    """Transformer Engine's pickled ``_extra_state`` (the FP8 recipe, scales, amax history) as
    comparable tensors -- the pickle's bytes are not stable across runs, its content is:
    ``key/<name>`` per tensor, ``key/recipe`` the repr of the recipe and its other variables."""
    import pickle

    content = pickle.loads(blob.detach().cpu().numpy().tobytes())
    out = {f"{key}/{name}": t for name, t in content.items() if torch.is_tensor(t)}
    text = repr((content["recipe"], sorted(content["extra_fp8_variables"].items())))
    out[f"{key}/recipe"] = torch.tensor(list(text.encode()), dtype=torch.uint8)
    return out


def params(job) -> dict:
    """This rank's model state (its shards with a parallel size of 2): the parameters, buffers
    and TE's FP8 ``_extra_state`` unpickled."""
    out = {}
    for k, v in job.model.state_dict().items():
        if k.endswith("_extra_state") and torch.is_tensor(v) and v.numel():
            out.update(unpickled_extra_state(k, v))
        elif torch.is_tensor(v):
            out[k] = v.detach().clone()
    return out


def check_graphs(job, feature: dict) -> None:
    """Graphs as the combination asks: none, Megatron's full-iteration pair (captured at step
    2, replayed in steps 2-4) or per-layer runners on this rank's layers, captured at the end
    of step 1 and replayed by every microbatch after it."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from tests.support.megatron_graphs import graph_runners

    runners = graph_runners(job.model)
    if not feature["graphs"]:
        assert runners == [], "graph runners without cuda_graphs"
        return
    if feature["graph_scope"] == "full_iteration":
        from megatron_fastpath.compat.graphs import full_cuda_graph_captured

        assert runners == [], "per-layer graph runners inside a full-iteration step"
        fwd_bwd, opt = full_cuda_graph_captured(), job.step.graphs.opt_graph
        assert fwd_bwd.replays == opt.replays == STEPS - 1
        return
    # Megatron's CudaGraphManager: without pipelining one runner a layer, replayed by every
    # microbatch; with it (reuse_cudagraphs off) one a layer and microbatch, replayed once a step
    layers = sum(isinstance(m, TransformerLayer) for m in job.model.modules())
    micro = job.cfg.training.micro_batches
    per_layer = 1 if job.cfg.parallel.pipeline_model_parallel_size == 1 else micro
    assert layers and len(runners) == layers * per_layer, \
        f"{len(runners)} graph runners for {layers} layers x {per_layer}"
    for r in runners:
        assert r.fwd_graph.captured and r.bwd_graph.captured
        assert r.fwd_graph.replays == r.bwd_graph.replays == (STEPS - 1) * micro // per_layer, \
            (r.fwd_graph.replays, r.bwd_graph.replays)


def check_experts(job, feature: dict) -> None:
    from megatron_fastpath.moe.experts import expert_class

    if feature["experts"] is None:
        return
    built = {type(m) for n, m in job.model.named_modules() if n.endswith(".experts")}
    assert built == {expert_class(feature["experts"])}, built


def expected_syncs(tree: dict) -> int:
    """The host reads the sync sentinel counts in a counted step of the job ``tree``: none, but

    * dropless expert parallelism's all-to-all split sizes, read back once per layer and
      microbatch (``moe/token_dispatcher.py``: "the one counted host sync of dropless EP"; with
      graphs on ``rules._dropless_ep_in_graphs`` refuses it);
    * with sequence parallelism on Megatron's RNG tracker (TE's is used only with graphs and
      ``cuda_graphs.use_te_rng_tracker``), two per microbatch: megatron-core 0.16.1's
      ``CudaRNGStatesTracker.fork`` checks the CPU RNG state unchanged with ``.item()``
      (tensor_parallel/random.py:264), and sequence parallelism forks for the embedding's
      dropout (language_model_embedding.py:145) and the transformer block
      (transformer_block.py:707). That is a read of a CPU tensor: no device sync on a GPU,
      where the sentinel does not count it; on this CPU build every tensor stands for a device
      one, so it is counted here."""
    model, par, fast = tree["model"], tree["parallel"], tree["fastpath"]
    micro = tree["training"]["micro_batches"]
    dropless_ep = (model.get("num_experts") is not None and fast["moe_capacity_factor"] is None
                   and par["expert_model_parallel_size"] > 1)
    te_tracker = fast["cuda_graphs"] and tree["cuda_graphs"]["use_te_rng_tracker"]
    sp_forks = par["sequence_parallel"] and not te_tracker
    return (model["num_layers"] * micro if dropless_ep else 0) + (2 * micro if sp_forks else 0)


def straight_vs_resumed(tree: dict, ckpt_dir, feature: dict, stage: Optional[list] = None) -> str:
    """The straight run: ``STEPS`` steps with checkpoints on, saving at step ``STOP``
    (``checkpoint.interval``; an async save is written while step ``STOP + 1`` trains) and at
    the end. The resumed run: the step-``STOP`` checkpoint alone in a fresh directory (copied;
    the straight run's latest is its last step), resumed and trained to the end. The losses and
    learning rates of every step and this rank's final parameters must be bit-identical.
    ``feature``: the combination's ``graphs`` / ``graph_scope`` / ``experts`` (None: a dense
    model), checked on the straight run.

    The sync sentinel (``training.sync_check``) is off in the straight run and as ``tree`` asks
    (by default its first steps) in the resumed run, which must count its one step: so every
    combination trains a step inside the sentinel's modes -- where graphs are on, the resumed
    run's capture too -- and that step must equal the straight run's step, trained without
    them (the diagnosis changes no number) -- and make exactly :func:`expected_syncs` host
    syncs (the stand-ins' own checks are unseen by the sentinel:
    ``gpu_standins.unseen_by_the_sync_sentinel``). A counted step costs ~20% of a run, so the
    straight run's steps are not counted.

    ``stage`` (a list) gets the part in progress appended:
    ``straight``, ``resume``, ``compare``. Returns what was checked; raises on any difference."""
    from tests.support.main_job import train_in_standins

    stage = [] if stage is None else stage
    ckpt_dir = Path(ckpt_dir)
    saved, resume_dir = ckpt_dir / "straight", ckpt_dir / "resume"
    stage.append("straight")
    straight, job_s = train_in_standins(with_keys(tree, checkpoint__dir=str(saved), checkpoint__interval=STOP,
                                                  training__sync_check="off"))
    assert len(records(straight)) == STEPS, records(straight)
    assert straight.sync_checked_steps == 0
    assert [s["step"] for s in straight.checkpoint_saves] == [STOP, STEPS], straight.checkpoint_saves
    check_graphs(job_s, feature)
    check_experts(job_s, feature)
    p_straight = params(job_s)
    del job_s
    stage.append("resume")
    step_dir = f"step_{STOP:08d}"
    dist = torch.distributed.is_initialized()
    if not dist or torch.distributed.get_rank() == 0:  # one copy; the ranks share the directory
        shutil.copytree(saved / step_dir, resume_dir / step_dir)
    if dist:
        torch.distributed.barrier()
    resumed, job_r = train_in_standins(with_keys(tree, checkpoint__dir=str(resume_dir)))
    stage.append("compare")
    assert resumed.resumed_from == f"{resume_dir}/{step_dir}", resumed.resumed_from
    assert records(resumed) == records(straight), "resumed run differs from the straight run"
    assert tree["training"]["sync_check"] == "off" or resumed.sync_checked_steps == 1, resumed.sync_checked_steps
    if resumed.sync_checked_steps:
        assert resumed.syncs_per_step == expected_syncs(tree), (
            f"{resumed.syncs_per_step:g} host syncs in the counted step, expected {expected_syncs(tree)}")
    p_resumed = params(job_r)
    assert p_straight.keys() == p_resumed.keys()
    differ = [k for k in p_straight if not torch.equal(p_straight[k], p_resumed[k])]
    kinds = sorted({k.rsplit(".", 1)[-1] for k in differ})  # the last name: lora_A, weight, ...
    assert not differ, f"final parameters differ ({len(differ)}), kinds {kinds}: {differ[:4]}"
    syncs = "" if not resumed.sync_checked_steps else f", {resumed.syncs_per_step:g} host syncs counted"
    return f"straight {STEPS} (saving at {STOP}) == resumed at {STOP} + {STEPS - STOP}{syncs}"
