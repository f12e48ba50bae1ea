"""Context parallelism with the ``te`` attention backend: the main job at CP=2
on ``training.device=cuda`` inside the GPU stand-ins, where Transformer Engine's
``DotProductAttention`` is ``tests/support/gpu_standins.TEDotProductAttentionStandIn``: it takes
the CP arguments Megatron's ``TEDotProductAttention`` hands TE, asserts TE 2.9-2.11's THD + CP
contract at every call (TE's messages, TE's source lines cited there) and computes the result on
the CPU (K/V all-gathered over the CP group, causal per sequence at global positions, the token
layout derived from TE's inputs alone: global ``cu_seqlens`` and the rank).

One torchrun launch (2 processes, ``tests/workers/cp_te_worker.py``) trains ``te`` and ``sdpa``
at CP=2 on the same data and seed and then calls the stand-in by hand (a good call against
global attention, broken calls); one more process trains ``te`` at CP=1. What is checked:

* per-step losses and gradient norms of ``te`` at CP=2 equal the ``sdpa`` CP=2 run's bit for
  bit: the stand-in's computation is the sdpa path's (the package's ``all_gather_cp`` and one
  masked SDPA over the gathered keys) with a mask built from TE's inputs -- equal on every real
  token, which is all the loss reads;
* and the ``te`` CP=1 run's within rtol 2e-4 (bf16): at CP=1 the stand-in attends each
  sequence on its own (another SDPA call shape, another reduction order), and the bf16
  activations (eps 2^-8) round differently from there on; the loss and gradient norm are sums
  over thousands of such values, so they move far less: measured 1.5e-5 at most on the loss
  and 4.2e-5 on the gradient norm over these 3 steps; the limit is ~5x that;
* every layer's call went through the CP contract (``padding_causal``, no padding between
  sequences) with Megatron's CP arguments: both ranks of the group, ``p2p``, one shared stream;
* the stand-in's own result on a hand-built call equals global attention over the full
  sequences (rows of this rank) and its backward runs; each broken call raises TE's message;
* the te run's only host syncs are the stand-in's own value checks (the package reads nothing
  back on the te path either).
"""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.integration

# test_context_parallel_torchrun.py's job (the data packs identically at CP=1 and CP=2), on the
# GPU step in bf16
COMMON = ["training.steps=3", "data.num_samples=64", "data.max_tokens=256", "data.max_len=40",
          "data.max_seqs=4", "model=tiny_dense", "parallel=single", "model.num_layers=2",
          "model.hidden_size=64", "model.ffn_hidden_size=96", "training.micro_batches=1",
          "training.device=cuda", "training.dtype=bfloat16", "fastpath.linear_impl=local",
    "cluster.backend=gloo", "training.skip_memory_check=true"]
CP2 = ["parallel.context_parallel_size=2"]
RTOL_LOSS, RTOL_GRAD = 2e-4, 2e-4
# the TE message (or the stand-in's named limit) each broken call must raise
BROKEN = {
    "mask_bottom_right": "Attention mask type must be padding or padding_causal for qkv_format=thd!",
    "cu_seqlens_int64": "cu_seqlens_q and cu_seqlens_q must both be in dtype torch.int32!",
    "cu_seqlens_none": "cu_seqlens_q and cu_seqlens_kv can not be None when qkv_format = thd!",
    "max_seqlen_differs": "No dot product attention backend is available",
    "not_divisible": "sequence lengths must be divisible by 2 x cp_size = 4",
    "local_tokens": "not the global 64 / cp_size 2",
    "comm_all_gather": "thd format is not supported!",
    "comm_a2a": "thd format is not supported!",
    "comm_unknown": "Unsupported communication type: ring!",
    "global_ranks_none": "cp_global_ranks must list the global ranks of cp_group",
    "cp_stream_none": "cp_stream is None",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.support.main_job import REPO, job_env, main_job_cmd, run_main_job

    tmp = tmp_path_factory.mktemp("cp-te")
    out = tmp / "cp2"
    cmd = main_job_cmd([str(out), *COMMON, *CP2], nproc=2,
                       entry=["-m", "tests.workers.cp_te_worker"])
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp / f"cp2.rank{r}.json").read_text()) for r in range(2)]
    (tmp / "cp1").mkdir()
    cp1 = run_main_job([*COMMON, "fastpath.attention_backend=te"], tmp / "cp1", nproc=1, name="cp1",
                       entry=["-m", "tests.workers.standin_main"])
    return ranks, cp1


def test_te_cp2_losses_equal_sdpa_cp2_and_te_cp1(runs):
    ranks, cp1 = runs
    te, sdpa = ranks[0]["te"], ranks[0]["sdpa"]
    assert all(r["te"] == te and r["sdpa"] == sdpa for r in ranks)  # one record, both ranks
    assert [r[0] for r in te] == list(range(1, 4))
    assert te == sdpa  # step, loss, grad norm, tokens: bit for bit
    one = cp1.summary["records"]
    assert len(one) == len(te)
    for (step, loss, grad, tokens), r1 in zip(te, one):
        assert tokens == r1["tokens"]
        assert loss == pytest.approx(r1["loss"], rel=RTOL_LOSS), (step, loss, r1["loss"])
        assert grad == pytest.approx(r1["grad_norm"], rel=RTOL_GRAD), (step, grad, r1["grad_norm"])


def test_every_call_went_through_tes_cp_contract_with_megatrons_cp_arguments(runs):
    ranks, _ = runs
    for r in ranks:
        # 2 layers, each called once per microbatch (3 steps x 1)
        assert r["te_layers"] == 2
        assert r["te_calls"] and set(map(tuple, r["te_calls"])) == {("padding_causal", False)}
        assert r["cp_args"] == {"cp_global_ranks": [0, 1], "cp_comm_type": "p2p",
                                "cp_group_size": 2, "cp_stream_shared": True}


def test_stand_in_computes_global_attention_and_raises_tes_messages(runs):
    ranks, _ = runs
    for r in ranks:
        c = r["contract"]
        assert c["max_abs_diff"] < 1e-5 and c["grads_finite"], c
        for name, message in BROKEN.items():
            assert c["broken"][name] is not None and message in c["broken"][name], (name, c["broken"][name])


def test_no_host_syncs(runs):
    """The package's te path reads nothing back, nor does sdpa's: no host sync in either run.
    The stand-in's own checks of cu_seqlens on the host (TE reads them on the device) run
    unseen by the sentinel (``gpu_standins.unseen_by_the_sync_sentinel``)."""
    ranks, _ = runs
    for r in ranks:
        assert r["sync_sites"] == {"sdpa": [], "te": []}, r["sync_sites"]
