"""Bad model=hf / data=jsonl inputs stop the main job before any step, naming file/line/key."""

import json
import os

import pytest

pytest.importorskip("transformers")

from tests.support.hydra_compose import compose_job


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "examples", "data", "arith_chat.jsonl")


def cfg(overrides):
    return compose_job(list(overrides))


def run_expecting(overrides, exc, match, capsys):
    from megatron_fastpath.train import run

    with pytest.raises(exc, match=match):
        run(cfg(["training.steps=2", "metrics.wandb=off", *overrides]))
    assert "| loss " not in capsys.readouterr().out  # no step ran


def test_jsonl_line_without_messages(mcore_parallel, tiny, tmp_path, capsys):
    from megatron_fastpath.hf.data import DataError

    bad = tmp_path / "bad.jsonl"
    lines = open(DATA).read().splitlines()[:50]
    lines[6] = json.dumps({"conversation": []})
    bad.write_text("\n".join(lines) + "\n")
    run_expecting(["model=hf", f"model.path={tiny}", "data=jsonl", f"data.path={bad}",
                   "data.cache=false"], DataError, r"bad.jsonl: 1 malformed record\(s\): line 7 \(no 'messages' key", capsys)


def test_tokenizer_without_chat_template(mcore_parallel, tiny, tmp_path, capsys):
    import shutil

    from megatron_fastpath.hf.tokenizer import TokenizerError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    tc = json.load(open(ckpt / "tokenizer_config.json"))
    del tc["chat_template"]
    json.dump(tc, open(ckpt / "tokenizer_config.json", "w"))
    run_expecting(["model=hf", f"model.path={ckpt}", "data=jsonl", f"data.path={DATA}",
                   "data.cache=false"], TokenizerError, "tokenizer_config.json has no 'chat_template'", capsys)


def test_truncated_checkpoint_refused_at_parse(mcore_parallel, tiny, tmp_path, capsys):
    import shutil

    from megatron_fastpath.hf.checkpoint import CheckpointError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(ckpt / "model.safetensors") // 2)
    run_expecting(["model=hf", f"model.path={ckpt}"], CheckpointError,
                  "model.safetensors: truncated safetensors file", capsys)


@pytest.mark.parametrize("overrides, match", [
    (["parallel.tensor_model_parallel_size=3"], "num_attention_heads=4 is not divisible by tensor_model_parallel_size=3"),
    (["+model.hidden_size=32"], r"model=hf takes only model.path"),
])
def test_bad_hf_job_config(mcore_parallel, tiny, overrides, match, capsys):
    run_expecting(["model=hf", f"model.path={tiny}", *overrides], ValueError, match, capsys)


def test_export_needs_model_hf(mcore_parallel, capsys):
    run_expecting(["fastpath.lora=true", "export.adapter_dir=/tmp/x"], ValueError,
                  "need model=hf model.path", capsys)


def test_unsupported_architecture_refused(mcore_parallel, tmp_path, capsys):
    from megatron_fastpath.hf.config import UnsupportedCheckpointError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    run_expecting(["model=hf", f"model.path={tmp_path}"], UnsupportedCheckpointError,
                  "model_type 'gpt2'", capsys)


@pytest.mark.parametrize("old, new", [("lora.export_dir", "export.adapter_dir"),
                                      ("lora.export_merged_dir", "export.merged_dir")])
def test_moved_export_keys_name_the_new_key(mcore_parallel, capsys, old, new):
    run_expecting(["fastpath.lora=true", f"{old}=/tmp/x"], ValueError, f"{old} moved to {new}", capsys)


def test_adapter_export_needs_lora(mcore_parallel, tiny, capsys):
    run_expecting(["model=hf", f"model.path={tiny}", "export.adapter_dir=/tmp/x", "export.synthetic_data=true"], ValueError,
                  "export.adapter_dir writes a PEFT adapter and needs fastpath.lora=true", capsys)


@pytest.mark.integration
@pytest.mark.parametrize("case", ["unknown_format", "empty_file", "empty_reply"])
def test_data_that_trains_nothing_stops_the_main_job_in_one_line(tiny, tmp_path, case):
    """Records of no known format, an empty file and an empty assistant reply: the main job
    exits 2 with one ``error:`` line saying so, before any step; data that gave no record leaves
    no token cache."""
    from tests.support.main_job import run_main_job

    data = tmp_path / "data" / "d.jsonl"
    data.parent.mkdir()
    if case == "unknown_format":
        data.write_text("".join(json.dumps({"question": f"{k} + 1?", "answer": str(k + 1)}) + "\n"
                                for k in range(12)))
        want = (f"error: {data}: none of its 12 records is in a format data=jsonl reads; the keys "
                "found: 'question', 'answer' (12 records). A record needs 'messages'")
    elif case == "empty_file":
        data.write_text("")
        want = (f"error: data.path {str(data)!r} is empty (0 bytes): there are no records to train "
                "on; point data.path at the data")
    else:
        lines = open(DATA).read().splitlines()[:20]
        lines[4] = json.dumps({"messages": [{"role": "user", "content": "2 + 2?"},
                                            {"role": "assistant", "content": ""}]})
        data.write_text("\n".join(lines) + "\n")
        want = (f"error: {data}: 1 malformed record(s): line 5 (an empty assistant reply (message 2 "
                "of the conversation): nothing to learn but the template's end-of-turn token) "
                "[by reason: no_loss_token=1]. Fix the records, or set data.bad_records=skip\n")
    job = run_main_job(["model=hf", f"model.path={tiny}", "data=jsonl", f"data.path={data}",
                        "training.steps=2", "metrics.wandb=off"], tmp_path, check=False, timeout=600)
    assert job.returncode == 2, job.stdout[-3000:] + job.stderr[-3000:]
    errors = [line for line in job.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and (errors[0] + "\n").startswith(want), job.stderr[-3000:]
    assert "Traceback" not in job.stderr and "| loss " not in job.stdout
    if case != "empty_reply":  # data that gave nothing: no token cache beside it
        assert "tokenized 0 records" not in job.stdout and os.listdir(data.parent) == ["d.jsonl"]
