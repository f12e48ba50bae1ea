"""Megatron's DistributedOptimizer (ZeRO-1) through the package's checkpoints at DP 2 and across
DP sizes, under torchrun (gloo, CPU, the CUDA-as-CPU mode; tests/workers/dist_optim_ckpt_worker.py),
in both formats (``checkpoint.optimizer_format``: dp_reshardable, fully_reshardable):

* exact resume at DP 2 (and of the MoE model at EP 2): each rank's optimizer shard (fp32 main parameters, exp_avg, exp_avg_sq,
  step) loaded into a model and optimizer drawn from another seed equals the saved one bit for
  bit, and so do the parameters after the next step;
* DP 2 -> 1: the one process's optimizer state is the concatenation of the two DP 2 shards, bit
  for bit; DP 1 -> 2: each rank's shard is its slice of the DP 1 state, bit for bit;
* the step after a resharded load equals the step the saving run took at its own DP size within
  fp32 tolerance (atol 1e-6 + rtol 1e-6; measured here: 0 after DP 2 -> 1, 1.2e-7 after
  DP 1 -> 2): the state is the same, the global batch is the same (the same two microbatches,
  each loss halved at DP 1 where DP 2's DDP halves the summed gradients), and what differs is
  the order of the sums -- the gradient norm (Adam's clip factor) is one sum at DP 1 and two
  shard sums all-reduced at DP 2 -- a few fp32 rounding steps, which one Adam step at
  lr 8.3e-3 carries into the parameters (about 1e-7 on weights of about 1).

Four launches shared by the module, each doing both formats (about 4 minutes in all on this shared
2-core machine): DP 1 trains and saves; DP 2 trains, saves, resumes its own checkpoint and loads
the DP 1 one; DP 1 loads the DP 2 one; EP 2 (the MoE model, two chained optimizers) trains, saves
and resumes.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.support.subproc import child_env, free_port

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("param", "exp_avg", "exp_avg_sq")
TOL = dict(atol=1e-6, rtol=1e-6)
FORMATS = ("dp_reshardable", "fully_reshardable")  # checkpoint.optimizer_format: both, in each launch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_optim")
    out = {}
    for world, phase in ((1, "dp1"), (2, "dp2"), (1, "dp2to1"), (2, "ep2")):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               f"--master_port={free_port()}", "-m", "tests.workers.dist_optim_ckpt_worker", phase, str(root)]
        proc = subprocess.run(cmd, cwd=root, env=child_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO),
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, phase + "\n" + proc.stdout[-3000:] + proc.stderr[-6000:]
        out[phase] = [torch.load(os.path.join(root, f"{phase}.rank{r}.pt")) for r in range(world)]
    return lambda fmt: {phase: [dict(r[fmt], world=r["world"]) for r in ranks] for phase, ranks in out.items()}


def _whole(shards: list) -> dict:
    """Parameter name -> each state tensor over the whole flattened parameter: the ranks' pieces
    in order, which must cover it without gap or overlap; and the set of their step counts."""
    whole = {}
    for name in set().union(*shards):
        pieces = sorted((s[name] for s in shards if name in s), key=lambda p: p["start"])
        assert pieces[0]["start"] == 0 and all(a["end"] == b["start"] for a, b in zip(pieces, pieces[1:])), name
        whole[name] = {k: torch.cat([p[k] for p in pieces]) for k in KEYS}
        whole[name]["steps"] = {float(p["step"]) for p in pieces}
        assert whole[name]["param"].numel() == pieces[-1]["end"], name
    return whole


@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_resume_at_dp2(runs, fmt):
    runs = runs(fmt)
    for rank in runs["dp2"]:
        assert rank["world"] == 2 and rank["resumed_step"] == 3
        assert rank["resumed_lr"] == rank["saved_lr"]
        assert sorted(rank["resumed"]) == sorted(rank["saved"])
        for name, saved in rank["saved"].items():
            loaded = rank["resumed"][name]
            assert (loaded["start"], loaded["end"]) == (saved["start"], saved["end"])
            for key in KEYS + ("step",):
                assert torch.equal(loaded[key], saved[key]), (name, key)
        for name, p in rank["next"].items():
            assert torch.equal(rank["resumed_next"][name], p), name
    # the two ranks hold different halves: ZeRO-1, not replicas
    a, b = (r["saved"] for r in runs["dp2"])
    assert sum(s["end"] - s["start"] for s in a.values()) + sum(s["end"] - s["start"] for s in b.values()) \
        == sum(p.numel() for p in runs["dp2"][0]["next"].values())


@pytest.mark.parametrize("fmt", FORMATS)
def test_dp2_checkpoint_at_dp1(runs, fmt):
    runs = runs(fmt)
    (one,) = runs["dp2to1"]
    two = _whole([r["saved"] for r in runs["dp2"]])
    assert one["world"] == 1 and one["from_dp2_step"] == 3 and one["from_dp2_lr"] == runs["dp2"][0]["saved_lr"]
    assert sorted(one["from_dp2"]) == sorted(two)
    for name, state in one["from_dp2"].items():
        assert state["start"] == 0 and state["end"] == two[name]["param"].numel()
        for key in KEYS:
            assert torch.equal(state[key], two[name][key]), (name, key)
        assert two[name]["steps"] == {float(state["step"])} == {3.0}
    for name, p in runs["dp2"][0]["next"].items():
        torch.testing.assert_close(one["from_dp2_next"][name], p, **TOL, msg=name)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dp1_checkpoint_at_dp2(runs, fmt):
    runs = runs(fmt)
    (one,) = runs["dp1"]
    for rank in runs["dp2"]:
        assert rank["from_dp1_step"] == 3 and rank["from_dp1_lr"] == one["saved_lr"]
        for name, state in rank["from_dp1"].items():
            whole = one["saved"][name]
            for key in KEYS:
                assert torch.equal(state[key], whole[key][state["start"]:state["end"]]), (name, key)
            assert torch.equal(state["step"], whole["step"])
        for name, p in one["next"].items():
            torch.testing.assert_close(rank["from_dp1_next"][name], p, **TOL, msg=name)
    assert _whole([r["from_dp1"] for r in runs["dp2"]]).keys() == one["saved"].keys()


@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_resume_of_moe_at_ep2(runs, fmt):
    """The MoE model at EP 2: its optimizer chains two DistributedOptimizers (dense parameters
    over DP 2, each rank's experts over expert-DP 1); resumed, every shard and the next step's
    parameters equal bit for bit on both ranks. In dp_reshardable each expert-DP group has its
    own objects, which only its rank holds: the checkpoint's JSON has both ranks'."""
    runs = runs(fmt)
    for rank in runs["ep2"]:
        assert rank["leaves"] == 2 and rank["resumed_step"] == 3
        assert any(".experts." in n for n in rank["saved"]) and sorted(rank["resumed"]) == sorted(rank["saved"])
        for name, saved in rank["saved"].items():
            for key in KEYS + ("step",):
                assert torch.equal(rank["resumed"][name][key], saved[key]), (name, key)
        for name, p in rank["next"].items():
            assert torch.equal(rank["resumed_next"][name], p), name
