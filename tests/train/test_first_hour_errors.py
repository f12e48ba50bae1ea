"""A fine-tuner's first mistakes, each refused at parse in one line with the fix: a feature
group's settings while its switch is off (they would be ignored), a misspelled key ("did you
mean", not Hydra's "+key"), a data=jsonl key without data=jsonl, training.device=cuda on a CPU."""

import subprocess

import pytest

from tests.support.hydra_compose import compose_job


def parse(*overrides):
    from megatron_fastpath.train import parse_job_config

    return parse_job_config(compose_job(["training.steps=2", *overrides]))


def test_lora_settings_without_the_lora_switch_are_refused():
    with pytest.raises(ValueError) as err:
        parse("lora.rank=8", "lora.targets=all-linear")
    assert str(err.value) == (
        "lora.rank=8, lora.targets=('linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2') set "
        "while fastpath.lora=false: the lora group is read only when its switch is on, so the run "
        "would silently ignore it; add fastpath.lora=true (or drop the lora.* settings)")
    job = parse("lora.rank=8", "lora.targets=all-linear", "fastpath.lora=true")
    assert job.lora.rank == 8 and job.fastpath.lora


@pytest.mark.parametrize("group, setting", [
    ("lora", "lora.dropout=0.0"), ("offload", "offload.min_offload_bytes=0"),
    ("cuda_graphs", "cuda_graphs.scope=full_iteration"), ("fp8", "fp8.recipe=mxfp8")])
def test_every_feature_group_is_refused_while_its_switch_is_off(group, setting):
    with pytest.raises(ValueError, match=rf"^{group}\.\w+=.* set while fastpath.{group}=false: .*; "
                                         rf"add fastpath.{group}=true \(or drop the {group}.\* settings\)$"):
        parse(setting)


def test_a_feature_group_at_its_defaults_is_not_refused_while_off():
    job = parse("lora.rank=16", "offload.min_offload_bytes=65536", "cuda_graphs.scope=layers")
    assert job.lora is None and job.offload is None and job.cuda_graphs is None


@pytest.mark.parametrize("overrides, message", [
    (["training.step=3"], "training.step is not a setting of the job config: did you mean "
                          "training.steps? (or training.seed, training.dtype)"),
    (["trainig.steps=3"], "trainig.steps is not a setting of the job config: did you mean "
                          "training.steps? (or training.epochs, training.seed)"),
    (["data.path=chat.jsonl"], "data.path is a setting of data=jsonl, not of data=synthetic_sft "
                               "(the data option chosen): add data=jsonl"),
])
def test_an_unknown_key_says_what_to_write(overrides, message):
    from megatron_fastpath.train.overrides import check_overrides

    with pytest.raises(ValueError) as err:
        check_overrides(overrides)
    assert str(err.value) == message


@pytest.mark.parametrize("overrides", [["training.steps=3"], ["data=jsonl", "data.path=x.jsonl"],
                                       ["+training.extra=1"], ["model=hf", "model.path=x"]])
def test_known_keys_pass_the_override_check(overrides):
    from megatron_fastpath.train.overrides import check_overrides

    check_overrides(overrides)


def test_cuda_on_a_cpu_machine_names_the_real_key(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as err:
        parse("training.device=cuda")
    assert str(err.value) == ("training.device=cuda but no CUDA device is available on this "
                              "machine (torch.cuda.is_available() is False); set "
                              "training.device=cpu (or auto)")


@pytest.mark.integration
def test_the_main_job_prints_did_you_mean_and_exits_2(tmp_path):
    from tests.support.main_job import job_env, main_job_cmd

    proc = subprocess.run(main_job_cmd(["training.step=3", f"hydra.run.dir={tmp_path}"]),
                          cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "error: training.step is not a setting of the job config: did you mean training.steps? "
        "(or training.seed, training.dtype)")
    assert "Traceback" not in proc.stderr and "+training.step" not in proc.stderr
