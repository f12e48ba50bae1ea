"""Bad override values are refused at parse (before any model or optimizer is built), the
message naming the key, the value and what is allowed."""

import pytest
from tests.support.hydra_compose import compose_job

from megatron_fastpath.train import parse_job_config

CASES = {
    "training.steps=abc": r"training\.steps='abc': must be a whole number",
    "training.epochs=two": r"training\.epochs='two': must be a whole number",
    "training.epochs=0": r"training\.epochs=0: must be > 0",
    "training.steps=3.5": r"training\.steps=3\.5: must be a whole number",
    "training.steps=0": r"training\.steps=0: must be > 0",
    "checkpoint.keep=two": r"checkpoint\.keep='two': must be a whole number",
    "training.lr=nan": r"training\.lr=nan: must be a finite number > 0",
    "training.lr=-1": r"training\.lr=-1: must be a finite number > 0",
    "training.weight_decay=nan": r"training\.weight_decay=nan: must be a finite number >= 0",
    "training.warmup_steps=-3": r"training\.warmup_steps=-3: must be >= 0",
    "training.clip_grad=nan": r"training\.clip_grad=nan: must be a finite number >= 0",
    "model.num_layers=0": r"model\.num_layers=0: must be > 0",
    "model.vocab_size=0": r"model\.vocab_size=0: must be > 0",
    "parallel.tensor_model_parallel_size=-1": r"parallel\.tensor_model_parallel_size=-1: must be > 0",
    "data.num_samples=-5": r"data\.num_samples=-5: must be > 0",
    "training.log_all_ranks=maybe": r"training\.log_all_ranks='maybe': must be true or false",
}


@pytest.mark.parametrize("override", sorted(CASES))
def test_bad_value_refused_at_parse_naming_the_key(override, monkeypatch):
    built = []
    import megatron_fastpath.train.job as job_mod

    monkeypatch.setattr(job_mod, "build_model", lambda *a, **k: built.append(1))  # must not run
    cfg = compose_job([override])
    with pytest.raises(ValueError, match=CASES[override]):
        parse_job_config(cfg)
    assert built == []


def test_good_values_still_parse():
    cfg = compose_job([
        "training.lr=1e-3", "training.clip_grad=0", "training.warmup_steps=0",
        "training.stop_at_step=null", "model.rope_scaling_factor=8"])
    job = parse_job_config(cfg)
    assert job.training.lr == 1e-3 and job.training.clip_grad == 0 and job.model.rope_scaling_factor == 8


@pytest.mark.integration
def test_main_job_prints_the_message_without_a_traceback(tmp_path):
    """A config error: the message alone on stderr and exit 2; HYDRA_FULL_ERROR=1 keeps the
    traceback."""
    from tests.support.main_job import job_env, run_main_job

    args = ["training.lr=nan", f"hydra.run.dir={tmp_path}/run"]
    plain = run_main_job(args, tmp_path, check=False, timeout=300)
    assert plain.returncode == 2
    assert "error: training.lr=nan: must be a finite number > 0" in plain.stderr
    assert "Traceback" not in plain.output
    full = run_main_job(args, tmp_path, check=False, timeout=300, env=job_env(HYDRA_FULL_ERROR="1"))
    assert full.returncode == 1 and "Traceback" in full.stderr and "training.lr=nan" in full.stderr
