"""``data.eval_samples``: at each evaluation the main job completes the first held-out prompts
greedily and prints / writes them. The prompts are what transformers' ``apply_chat_template``
(generation prompt on) tokenizes, and the completions are transformers' ``generate(do_sample=
False)`` of the same prompt ids -- with the checkpoint's weights before training, and with the
weights the job exported after it. Bad settings are refused at parse."""

import json
import os
import shutil

import pytest

from tests.hf.hf_reference import DATA
from tests.support.hydra_compose import compose_job
from tests.support.main_job import job_env, run_main_job

transformers = pytest.importorskip("transformers")

STEPS, EVERY, SAMPLES, NEW = 10, 5, 2, 8


# ------------------------------------------------------------------ parse refusals
def test_settings_are_checked_at_parse():
    from megatron_fastpath.hf.data import DataError, JsonlDataConfig

    with pytest.raises(DataError, match=r"data.eval_samples=2 .*data.eval_fraction=0 holds out no "
                                        r"records: set data.eval_fraction > 0"):
        JsonlDataConfig(path="x.jsonl", eval_fraction=0.0, eval_samples=2)
    with pytest.raises(DataError, match=r"data.eval_samples must be >= 0"):
        JsonlDataConfig(path="x.jsonl", eval_samples=-1)
    with pytest.raises(DataError, match=r"data.eval_max_new_tokens must be >= 1"):
        JsonlDataConfig(path="x.jsonl", eval_samples=1, eval_max_new_tokens=0)
    cfg = JsonlDataConfig(path="x.jsonl")
    assert (cfg.eval_samples, cfg.eval_max_new_tokens) == (0, 32)  # off by default


def test_main_job_refuses_samples_without_held_out_records(tiny):
    from megatron_fastpath.hf.data import DataError
    from megatron_fastpath.train import parse_job_config

    with pytest.raises(DataError, match=r"data.eval_fraction=0 holds out no records"):
        parse_job_config(compose_job(["model=hf", f"model.path={tiny}", "data=jsonl",
                                      f"data.path={DATA}", "data.eval_fraction=0",
                                      "data.eval_samples=2"]))
    with pytest.raises(ValueError, match=r"data.eval_samples='two': must be a whole number"):
        parse_job_config(compose_job(["model=hf", f"model.path={tiny}", "data=jsonl",
                                      f"data.path={DATA}", "data.eval_samples=two"]))


def test_synthetic_data_has_no_samples_setting():
    """Synthetic data has no text (no tokenizer): the setting is not in its group."""
    from megatron_fastpath.train import parse_job_config

    with pytest.raises(ValueError, match=r"data.eval_samples is a setting of data=jsonl: synthetic "
                                         r"data has no held-out split and no text .* use model=hf "
                                         r"model.path=<dir> data=jsonl data.path=<file>, or drop "
                                         r"data.eval_samples$"):
        parse_job_config(compose_job(["+data.eval_samples=2"]))
    with pytest.raises(ValueError, match=r"or drop data.eval_max_new_tokens, data.eval_samples$"):
        parse_job_config(compose_job(["+data.eval_samples=2", "+data.eval_max_new_tokens=4"]))


def test_prompt_and_reference_split_at_the_first_loss_token():
    import numpy as np

    from megatron_fastpath.hf.data import JsonlDataset, eval_prompts

    ids = [np.arange(10, 20), np.arange(30, 36)]
    masks = [np.array([0, 0, 0, 1, 1, 1, 0, 0, 1, 1]), np.array([0, 0, 1, 1, 1, 1])]
    held = JsonlDataset(ids, masks, [1, 2])
    assert eval_prompts(held, 5) == (((10, 11, 12), (13, 14, 15)), ((30, 31), (32, 33, 34, 35)))
    assert eval_prompts(held, 1) == (((10, 11, 12), (13, 14, 15)),)


# ------------------------------------------------------------------ the main job
@pytest.fixture(scope="module")
def sampled(tmp_path_factory, tiny):
    tmp = tmp_path_factory.mktemp("samples")
    data = str(tmp / "chat.jsonl")
    shutil.copy(DATA, data)  # the token cache is written beside the data
    out = {k: str(tmp / k) for k in ("merged", "metrics")}
    run = run_main_job([
        "model=hf", f"model.path={tiny}", "data=jsonl", f"data.path={data}", "fastpath.lora=true",
        f"export.merged_dir={out['merged']}", f"training.steps={STEPS}", f"data.eval_every={EVERY}",
        f"data.eval_samples={SAMPLES}", f"data.eval_max_new_tokens={NEW}",
        f"metrics.dir={out['metrics']}", "metrics.tensorboard=false", "metrics.wandb=off",
        "metrics.plot=false",
    ], tmp, env=job_env())
    rows = [json.loads(line) for line in open(os.path.join(out["metrics"], "eval_samples.jsonl"))]
    return dict(out, data=data, run=run, rows=rows)


def _generate(model_dir, prompt_ids):
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW, pad_token_id=5)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.integration
def test_samples_written_at_every_evaluation(sampled):
    rows = sampled["rows"]
    assert [(r["step"], r["index"]) for r in rows] == [
        (s, i) for s in range(0, STEPS + 1, EVERY) for i in range(SAMPLES)]
    assert {r["stop"] for r in rows} <= {"eos", "max_new_tokens"}
    assert all(len(r["completion_ids"]) <= NEW for r in rows)
    assert sampled["run"].summary["artifacts"]["eval_samples"] == os.path.join(
        sampled["metrics"], "eval_samples.jsonl")
    out = sampled["run"].stdout
    for r in rows:  # one printed line per sample, after its evaluation's line
        assert f"sample {r['index']}: " in out
    log = open(os.path.join(sampled["metrics"], "train.log")).read()
    assert log.count("  sample 0: ") == len(range(0, STEPS + 1, EVERY))


@pytest.mark.integration
def test_prompts_are_the_chat_templates_generation_prompt(sampled, tiny):
    from megatron_fastpath.hf.data import JsonlDataConfig, load_jsonl_splits

    _, held, _ = load_jsonl_splits(JsonlDataConfig(path=sampled["data"]), tiny, log=lambda m: None)
    records = [json.loads(line) for line in open(sampled["data"])]
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    for r in sampled["rows"][:SAMPLES]:
        msgs = records[held.lines[r["index"]] - 1]["messages"]
        want = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True)
        assert r["prompt_ids"] == list(want)
        assert r["prompt"] == tok.decode(want)
        assert r["reference"] == msgs[-1]["content"]


@pytest.mark.integration
def test_completions_equal_transformers_generate(sampled, tiny):
    """Step 0: the checkpoint's weights; the last step: the weights the job exported."""
    rows = sampled["rows"]
    for step, model_dir in ((0, tiny), (STEPS, sampled["merged"])):
        for r in (r for r in rows if r["step"] == step):
            want = _generate(model_dir, r["prompt_ids"])
            assert r["completion_ids"] == want, (step, r)
            tok = transformers.AutoTokenizer.from_pretrained(tiny)
            assert r["completion"] == tok.decode([t for t in want if t != 4], skip_special_tokens=True)
    # training changed what the model says
    assert [r["completion_ids"] for r in rows if r["step"] == 0] != [
        r["completion_ids"] for r in rows if r["step"] == STEPS]


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["tensor_model_parallel_size=2", "context_parallel_size=2",
                                    "data_parallel"])
def test_two_ranks_sample_what_transformers_generates(tmp_path, tiny, layout):
    """torchrun, 2 gloo processes: tensor parallel (both ranks run each forward; the argmax is
    over the gathered vocabulary), context parallel (the last token's logits live on one rank)
    and data parallel (rank 0 samples alone) -- the completions before training are the
    checkpoint's, after it the exported weights', as transformers generates them; rank 0
    writes each sample once."""
    data = str(tmp_path / "chat.jsonl")
    shutil.copy(DATA, data)
    par = [] if layout == "data_parallel" else [f"parallel.{layout}"]
    run = run_main_job([
        "model=hf", f"model.path={tiny}", "data=jsonl", f"data.path={data}", "fastpath.lora=true",
        f"export.merged_dir={tmp_path / 'merged'}", "training.steps=2", "data.eval_every=0",
        f"data.eval_samples={SAMPLES}", f"data.eval_max_new_tokens={NEW}", *par,
        f"metrics.dir={tmp_path / 'metrics'}", "metrics.tensorboard=false", "metrics.wandb=off",
        "metrics.plot=false"], tmp_path, nproc=2)
    assert run.summary["world_size"] == 2
    rows = [json.loads(line) for line in open(tmp_path / "metrics" / "eval_samples.jsonl")]
    assert [(r["step"], r["index"]) for r in rows] == [(s, i) for s in (0, 2) for i in range(SAMPLES)]
    for step, model_dir in ((0, tiny), (2, str(tmp_path / "merged"))):
        for r in (r for r in rows if r["step"] == step):
            assert r["completion_ids"] == _generate(model_dir, r["prompt_ids"]), (layout, r)
