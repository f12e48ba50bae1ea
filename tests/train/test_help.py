"""``python -m megatron_fastpath.train --help``: every key of the composed config with its value
and its description, read from the field that declares the key (``settings.setting``); a group
filter; an unknown group or key refused in one line (exit 2); nothing started."""

import os
import re
import signal
import subprocess
import sys

import pytest

from megatron_fastpath.train.config import config_dir
from megatron_fastpath.train.help import describe_group, job_help
from megatron_fastpath.train.overrides import compose_tree

GROUPS = ("model", "data", "training", "fastpath", "parallel", "cluster", "lora", "offload",
          "cuda_graphs", "fp8", "metrics", "export", "checkpoint")


def _other_options():
    """One override per option of every group that is not its default (model=hf, cluster=slurm, ...)."""
    _, chosen = compose_tree([], config_dir())
    out = []
    for group in GROUPS:
        for name in sorted(os.listdir(os.path.join(config_dir(), group))):
            if name.endswith(".yaml") and name[:-5] != chosen[group]:
                out.append(f"{group}={name[:-5]}")
    return out


@pytest.mark.parametrize("overrides", [[], *[[o] for o in _other_options()],
                                       ["model=hf", "data=jsonl"]], ids=lambda o: " ".join(o) or "default")
def test_every_key_of_the_composed_config_has_a_description(overrides):
    """A key added to a group's YAML (or a field added to its type and YAML) without a
    ``setting(..., help)`` fails here."""
    tree, _ = compose_tree(overrides, config_dir())
    assert tuple(tree) == GROUPS
    missing = [f"{group}.{key}" for group in GROUPS
               for key, text in describe_group(group, tree[group]).items() if not text.strip()]
    assert missing == []


def test_a_key_without_a_description_is_found():
    described = describe_group("training", {"steps": None, "a_new_key": 1})
    assert described["a_new_key"] == "" and described["steps"].startswith("steps to train")


def test_the_help_prints_every_default_key_with_its_composed_value_and_description():
    text = job_help([])
    tree, choices = compose_tree([], config_dir())
    lines = text.splitlines()
    for group in GROUPS:
        assert f"{group} ({group}={choices[group]}; options: " in text
        for key, value in tree[group].items():
            shown = ("null" if value is None else str(value).lower() if isinstance(value, bool)
                     else None if isinstance(value, (list, dict)) else str(value))
            line = next(i for i, l in enumerate(lines) if l.startswith(f"  {group}.{key}="))
            if shown is not None:
                assert lines[line] == f"  {group}.{key}={shown}"
            description = lines[line + 1]
            assert description.startswith("      ") and description.strip() != "(no description)"
    # values as composed (the YAML option's), not the dataclass defaults
    assert "  data.num_samples=1024\n      synthetic samples per epoch\n" in text
    assert "  training.steps=null\n      steps to train; null: 40," in text
    assert "  lora.targets=[linear_qkv, linear_proj]\n" in text
    assert sum(bool(re.match(r"  [a-z_0-9]+\.[a-z_0-9]+=", l)) for l in lines) == \
        sum(len(tree[g]) for g in GROUPS)
    assert "--cfg job: the composed config as YAML" in text


def _headers(text):
    return [l for l in text.splitlines() if re.match(r"[a-z_0-9]+ \(", l)]


def test_the_group_filter_prints_those_groups_only_as_composed():
    text = job_help(["model=hf", "model"])
    assert _headers(text) == ["model (model=hf; options: hf, llama2_70b, llama31_8b, llama3_8b, mixtral_8x7b, "
                       "qwen3_30b_a3b, tiny_dense, tiny_moe)"]
    assert "  model.path=???\n      the Hugging Face checkpoint directory" in text
    assert "  model.provider=hf\n      the model provider that reads this group: hf | synthetic" in text
    two = job_help(["training", "cluster", "cluster=slurm"])
    assert [h.split(" ")[0] for h in _headers(two)] == ["training", "cluster"]
    assert "  cluster.timeout_s=1800\n" in two and "model." not in two
    # Hydra's flags and their values are not group names
    assert job_help(["--cfg", "job", "-p", "training", "training"]) == job_help(["training"])


@pytest.mark.parametrize("args, message", [
    (["trainig"], "--help trainig: no config group 'trainig'; did you mean training?"),
    (["nothing_like_it"], "--help nothing_like_it: no config group 'nothing_like_it'; the groups are "
                          "model, data, training, fastpath, parallel, cluster, lora, offload, "
                          "cuda_graphs, fp8, metrics, export, checkpoint"),
    (["training", "training.step=3"], "training.step is not a setting of the job config: did you "
                                      "mean training.steps? (or training.seed, training.dtype)"),
])
def test_an_unknown_group_or_key_is_one_line(args, message):
    with pytest.raises(ValueError) as err:
        job_help(args)
    assert str(err.value) == message


def test_main_prints_the_help_and_returns_without_starting_anything(monkeypatch, capsys):
    from megatron_fastpath.train import main

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(sys, "argv", ["train", "--help", "fp8"])
    assert main() is None
    out = capsys.readouterr()
    assert out.out.startswith("python -m megatron_fastpath.train [<group>=<option> ...]")
    assert "  fp8.recipe=delayed\n      delayed (amax history) | tensorwise | mxfp8 | blockwise\n" in out.out
    assert out.err == ""
    assert signal.getsignal(signal.SIGTERM) is before  # EarlySignals not installed

    monkeypatch.setattr(sys, "argv", ["train", "-h", "trainig"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == "error: --help trainig: no config group 'trainig'; did you mean training?\n"


def test_the_entry_point_prints_one_group_and_exits_0_writing_nothing(tmp_path):
    from tests.support.main_job import job_env, main_job_cmd

    proc = subprocess.run(main_job_cmd(["--help", "data=jsonl", "data"]), cwd=tmp_path, env=job_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "  data.path=???\n      the data: a JSONL file, a JSON array (.json), Parquet" in proc.stdout
    assert "  training." not in proc.stdout and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no Hydra run directory, no output
