"""``model=hf`` refusals at parse, one line each with the fix: model.path unset, missing, a file
or a Hugging Face Hub id the local hub cache lacks (a cached one resolves to its snapshot), and
an export of a checkpoint trained on the synthetic token data (no data=jsonl)."""

import os
import shutil

import pytest

pytest.importorskip("transformers")

from tests.hf.hf_reference import DATA
from tests.support.hydra_compose import compose_job


def parse(*overrides):
    from megatron_fastpath.train import parse_job_config

    return parse_job_config(compose_job(["training.steps=2", "model=hf", *overrides]))


def test_model_path_unset_is_one_line_naming_the_key():
    with pytest.raises(ValueError) as err:
        parse()  # model/hf.yaml: path: ???
    assert str(err.value) == ("model=hf needs model.path: it is unset; set model.path=<a Hugging "
                              "Face checkpoint directory> (config.json + *.safetensors + tokenizer files)")


def test_model_path_missing_or_a_file(tmp_path):
    with pytest.raises(ValueError, match=r"^model.path='.*/nope' does not exist: model=hf reads a "
                                         r"Hugging Face checkpoint directory .*; set model.path="):
        parse(f"model.path={tmp_path / 'nope'}")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"^model.path='.*/f' is a file: model=hf reads"):
        parse(f"model.path={tmp_path / 'f'}")


def test_hub_id_not_cached_says_it_needs_a_local_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        parse("model.path=meta-llama/Llama-3.2-1B")
    assert str(err.value) == (
        "model.path='meta-llama/Llama-3.2-1B' is not a directory; as a Hugging Face Hub id it is "
        "not resolved: the job reads a local copy only and the local hub cache does not hold it; "
        "download it first (huggingface-cli download meta-llama/Llama-3.2-1B --local-dir <dir>) "
        "and set model.path=<dir>")


def test_hub_id_in_the_local_hub_cache_resolves_to_its_snapshot(tiny, tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--org--tiny-llama"
    shutil.copytree(tiny, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    job = parse("model.path=org/tiny-llama")
    assert job.model_source.handle.path == str(repo / "snapshots" / "abc123")


@pytest.mark.parametrize("key", ["export.merged_dir", "export.adapter_dir"])
def test_export_of_a_checkpoint_trained_on_synthetic_tokens_is_refused(tiny, tmp_path, key):
    lora = ["fastpath.lora=true"] if key == "export.adapter_dir" else []
    with pytest.raises(ValueError) as err:
        parse(f"model.path={tiny}", *lora, f"{key}={tmp_path / 'out'}")
    assert str(err.value) == (
        f"{key} with the synthetic token data (no data=jsonl): the job would train the checkpoint "
        "on random tokens and export it as fine-tuned; add data=jsonl data.path=<your data file> "
        "(export.synthetic_data=true: a test of the export)")
    assert not os.path.exists(tmp_path / "out")
    # the fix in one line, and the opt-in for a test of the export itself
    assert parse(f"model.path={tiny}", *lora, f"{key}={tmp_path / 'out'}", "data=jsonl",
                 f"data.path={DATA}").data_provider == "jsonl"
    assert parse(f"model.path={tiny}", *lora, f"{key}={tmp_path / 'out'}",
                 "export.synthetic_data=true").export.synthetic_data
