"""Context parallelism in the main job: ``torchrun --nproc_per_node=2 -m
megatron_fastpath.train parallel.context_parallel_size=2`` on CPU (gloo, sdpa backend, K/V
all-gathered over the CP group) against the one-process CP=1 run of the same data.

The data packs identically at CP=1 and CP=2 (every sample counted padded to
``data.pad_multiple``, whatever the CP size; padded to 2 x CP, this data's bins would differ from
step 3 on), so the two runs train on the same batches at every step; they differ only in the
order of floating-point sums. Per-step losses agree within rtol 1e-6 and
the final parameters (read back from each run's checkpoint) within 1e-6; the CP run's steps are
free of host syncs in forward+backward and the cache builds once per batch. The same holds with
LoRA (adapter dropout off: a CP rank draws the dropout of its own tokens only) and with TP=2 x
CP=2 (4 processes) against TP=2. A checkpoint resumes at the other CP size (the model is
replicated over CP): CP=1 -> CP=2 and CP=2 -> CP=1 continue with the straight run's losses.
"""

import pytest
import torch

STEPS = 4
# 96 samples of 8-48 tokens in bins of 256 tokens / 8 sequences, one bin a step
MAIN_JOB_COMMON = [f"training.steps={STEPS}", "data.num_samples=96", "data.max_tokens=256",
                   "data.max_len=48", "data.max_seqs=8", "model=tiny_dense", "parallel=single",
                   "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=96",
                   "training.micro_batches=1", "fastpath.attention_backend=sdpa"]

pytestmark = pytest.mark.integration


def _run(runs, name, extra, nproc):
    return runs(name, [*extra, f"checkpoint.dir={{root}}/{name}/ckpt"], nproc)


def _params(root, name):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = root / f"{name}.pt"
    dcp_to_torch_save(str(root / name / "ckpt" / f"step_{STEPS:08d}" / "model"), str(out))
    flat = {}

    def walk(d, pre=""):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, pre + k + ".")
            elif isinstance(v, torch.Tensor) and v.is_floating_point():
                flat[pre + k] = v

    walk(torch.load(out, weights_only=False))
    return flat


# LoRA without dropout: each CP rank draws the dropout mask of its own tokens, so with dropout
# the masks (not the math) differ from the CP=1 run's
# TP=2 x CP=2: 4 processes against the TP=2 run (2 processes)
@pytest.mark.parametrize("tag,features,nproc", [
    ("dense", [], 1),
    pytest.param("lora", ["fastpath.lora=true", "lora.dropout=0.0"], 1, marks=pytest.mark.every_line),
    ("tp2", ["parallel.tensor_model_parallel_size=2"], 2),
], ids=["dense", "lora", "tp2"])
def test_cp2_equals_cp1(main_job_runs, tag, features, nproc):
    one = _run(main_job_runs, f"cp1-{tag}", features, nproc)
    two = _run(main_job_runs, f"cp2-{tag}", [*features, "parallel.context_parallel_size=2"],
               2 * nproc)
    a, b = one.summary["records"], two.summary["records"]
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6), (ra, rb)
        assert rb["tokens"] == ra["tokens"]
        assert rb["syncs_fwd_bwd"] == (0 if rb["step"] <= 3 else None)  # counted in steps 1-3
        assert rb["cache_builds"] == ra["cache_builds"]  # once per batch, as without CP
    pa, pb = _params(main_job_runs.root, f"cp1-{tag}"), _params(main_job_runs.root, f"cp2-{tag}")
    assert pa.keys() == pb.keys() and pa
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=0, atol=1e-6, msg=k)
    assert f"world {2 * nproc}" in two.output


def test_cp_refuses_what_is_not_served_before_any_work():
    """The parse (before any device work) refuses CP 2 with offload with the rules' reason, in
    this process: the ValueError the main job prints as its one error line before exiting 2
    (the command line's path for a parse refusal: tests/train/test_config_values.py
    test_main_job_prints_the_message_without_a_traceback)."""
    from megatron_fastpath import rules
    from megatron_fastpath.train import parse_job_config
    from tests.support.hydra_compose import compose_job

    want = rules.refusals(rules.RunFacts(names=rules.NAMES["main"], context_parallel_size=2,
                                         offload=True))[0]
    with pytest.raises(ValueError) as refused:
        parse_job_config(compose_job([*MAIN_JOB_COMMON, "parallel.context_parallel_size=2",
                                      "fastpath.offload=true"]))
    assert want in str(refused.value)


def _resumed_steps_match(resumed, straight, done=2):
    """The restored records are the saving run's; the resumed steps the straight run's
    (another CP size: within rtol 1e-6, the order of floating-point sums)."""
    a, b = resumed.summary["records"], straight.summary["records"]
    assert [r["step"] for r in a] == list(range(1, STEPS + 1))
    for ra, rb in zip(a[done:], b[done:], strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6), (ra, rb)
        assert ra["tokens"] == rb["tokens"]


def test_resume_at_cp2_is_exact_and_cp2_reshards_to_cp1(main_job_runs):
    """Stopped at step 2 under CP=2: resumed at CP=2 the records equal the straight CP=2 run's
    bit for bit; resumed at CP=1 (the model is replicated over CP, so the checkpoint is the same
    state) steps 3-4 equal the straight CP=1 run's within rtol 1e-6."""
    import shutil

    root = main_job_runs.root
    cp2 = ["parallel.context_parallel_size=2"]
    main_job_runs("cp2-stop", [*cp2, "training.stop_at_step=2", "checkpoint.dir={root}/stop-ckpt"], 2)
    shutil.copytree(root / "stop-ckpt", root / "stop-ckpt-cp1")
    again = main_job_runs("cp2-again", [*cp2, "checkpoint.dir={root}/stop-ckpt"], 2)
    straight2 = _run(main_job_runs, "cp2-dense", ["parallel.context_parallel_size=2"], 2)
    assert [r["step"] for r in again.summary["records"]] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "tokens"):  # restored steps 1-2 and the resumed step 3
        assert ([r[key] for r in again.summary["records"]]
                == [r[key] for r in straight2.summary["records"]]), key
    as_cp1 = main_job_runs("cp1-from-cp2", ["checkpoint.dir={root}/stop-ckpt-cp1"], 1)
    straight1 = _run(main_job_runs, "cp1-dense", [], 1)
    assert "resuming from" in as_cp1.output
    _resumed_steps_match(as_cp1, straight1)


def test_resume_at_cp1_reshards_to_cp2(main_job_runs):
    """Stopped at step 3 under CP=1 (one process), resumed under CP=2 (two): the packing is the
    same at both sizes, so steps 1-3 trained the straight CP=2 run's batches (step 3 is the
    first whose batch a per-CP padding would change) and step 4 continues with its loss within
    rtol 1e-6; the final parameters equal its within 1e-6."""
    main_job_runs("cp1-stop", ["training.stop_at_step=3", "checkpoint.dir={root}/cp1-stop/ckpt"], 1)
    as_cp2 = main_job_runs("cp2-from-cp1", ["parallel.context_parallel_size=2",
                                            "checkpoint.dir={root}/cp1-stop/ckpt"], 2)
    straight2 = _run(main_job_runs, "cp2-dense", ["parallel.context_parallel_size=2"], 2)
    assert "resuming from" in as_cp2.output and "world 2" in as_cp2.output
    _resumed_steps_match(as_cp2, straight2, done=3)
    pa, pb = _params(main_job_runs.root, "cp1-stop"), _params(main_job_runs.root, "cp2-dense")
    assert pa.keys() == pb.keys() and pa
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=1e-6, msg=k)
