"""The README's fine-tune flow, end to end on CPU: the example builds a tiny Llama checkpoint and
tokenizer, the main job fine-tunes LoRA on the shipped chat JSONL with the command line read from
docs/fine-tuning.md and prints the page's "Output of that run", the page's ``generate`` example
answers what the page says, train and held-out loss fall, the exported adapter loads in peft and
lowers the transformers model's held-out loss against the base (to exactly our reported eval
loss), and the job runs with transformers / peft unimportable."""

import json
import math
import os
import re
import shlex
import shutil

import pytest
import yaml

from tests.hf.hf_reference import DATA, REPO, held_out_loss
from tests.support.main_job import TINY_CHECKPOINT_OPTIMIZER, job_env, run_main_job

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

STEPS = 60  # the page's command's training.steps (the fixture checks it)
PAGE = os.path.join(REPO, "docs", "fine-tuning.md")


def page_command(module: str) -> list[str]:
    """The arguments of docs/fine-tuning.md's one ``.venv/bin/python -m <module> ...`` line."""
    head = f".venv/bin/python -m {module} "
    found = [line for line in open(PAGE, encoding="utf-8").read().splitlines() if line.startswith(head)]
    assert len(found) == 1, f"docs/fine-tuning.md shows {len(found)} lines running {module}"
    return shlex.split(found[0])[3:]


def page_block(after: str) -> list[str]:
    """The lines of docs/fine-tuning.md's first fenced block after the text ``after``."""
    text = open(PAGE, encoding="utf-8").read()
    assert after in text, f"docs/fine-tuning.md has no {after!r}"
    return text.split(after, 1)[1].split("\n```", 1)[1].split("\n", 1)[1].split("\n```", 1)[0].splitlines()


def local_args(args, places: dict) -> list[str]:
    """``key=value`` arguments with each value that is a path of the page (a key of ``places``)
    replaced by the test's own."""
    return [f"{k}={places.get(v, v)}" for k, v in (a.split("=", 1) for a in args)]


PLACEHOLDERS = {"...": ".*", "<hash>": "[0-9a-f]+", "<date>": r"\d{4}-\d{2}-\d{2}",
                "<time>": r"\d{2}-\d{2}-\d{2}"}


def line_regex(line: str, places: dict) -> re.Pattern:
    """A line of the page's output as a regex: ``...`` any text, ``<hash>`` a hex hash,
    ``<date>`` / ``<time>`` Hydra's run-directory date and time, a key of ``places`` (a path
    the page shows) the test's own path, anything else itself."""
    table = {**PLACEHOLDERS, **{k: re.escape(v) for k, v in places.items()}}
    parts = re.split("(" + "|".join(map(re.escape, sorted(table, key=len, reverse=True))) + ")", line)
    return re.compile("".join(table[p] if i % 2 else re.escape(p) for i, p in enumerate(parts)))


def assert_output_matches(page: list[str], printed: list[str], places: dict) -> None:
    """``printed`` is ``page`` line for line (:func:`line_regex`), where a line that is only
    ``...`` stands for any number of lines: the page's next line is the first printed line
    after them that matches. No printed line is left after the page's last (unless it is ``...``)."""
    at, skipping = 0, False
    for n, line in enumerate(page, 1):
        if line.strip() == "...":
            skipping = True
            continue
        want = line_regex(line, places)
        if skipping:
            hit = next((j for j in range(at, len(printed)) if want.fullmatch(printed[j])), None)
            assert hit is not None, (f"the page's output line {n} {line!r} matches no printed line "
                                     "from here on:\n" + "\n".join(printed[at:]))
            at, skipping = hit + 1, False
        else:
            got = printed[at] if at < len(printed) else "(the end of the output)"
            assert want.fullmatch(got), f"the page's output line {n}:\n  {line!r}\nprinted:\n  {got!r}"
            at += 1
    assert skipping or at == len(printed), f"printed after the page's last line: {printed[at:]}"

BLOCK_HF = """
import importlib.abc, sys
class _NoHF(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('transformers', 'peft'):
            raise ImportError(f'{name} is blocked: the package must train without it')
sys.meta_path.insert(0, _NoHF())
sys.argv = ['megatron_fastpath.train'] + sys.argv[1:]
from megatron_fastpath.train import main
main()
assert 'transformers' not in sys.modules and 'peft' not in sys.modules
"""


def run_job(args, cwd, block_hf=False):
    """The main job's stdout; ``block_hf``: run it where transformers and peft cannot import."""
    run = run_main_job(args, cwd, env=job_env(WANDB_MODE="offline"),
                       entry=["-c", BLOCK_HF] if block_hf else None)
    return run.stdout


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """docs/fine-tuning.md's command, run as the page runs it: in a directory holding the page's
    relative ``examples/data/arith_chat.jsonl``, on the example's checkpoint, with the page's
    /tmp paths in that directory (``places``: what the page's paths stand for here). Added are
    outputs only, none changing a figure: ``export.merged_dir`` (its lines are left out of
    ``printed``), ``training.summary_json``, ``hydra.run.dir`` set to Hydra's default
    (megatron_fastpath/configs/config.yaml; ``run_main_job`` names another otherwise) and the
    token cache under the directory (``XDG_CACHE_HOME``)."""
    tmp = tmp_path_factory.mktemp("ft")
    import make_tiny_hf_llama

    places = {"/tmp/tiny-llama-lora": str(tmp / "tiny-llama-lora"), "/tmp/tiny-llama": str(tmp / "tiny-llama"),
              "~/.cache": str(tmp / ".cache"), "<repo>": str(tmp)}
    ckpt, adapter = places["/tmp/tiny-llama"], places["/tmp/tiny-llama-lora"]
    make_tiny_hf_llama.main(ckpt, DATA)
    data = tmp / "examples" / "data" / "arith_chat.jsonl"
    data.parent.mkdir(parents=True)
    shutil.copy(DATA, data)
    args = page_command("megatron_fastpath.train")
    assert "data.path=examples/data/arith_chat.jsonl" in args and f"training.steps={STEPS}" in args, args
    hydra_run_dir = yaml.safe_load(open(os.path.join(REPO, "megatron_fastpath", "configs", "config.yaml")))[
        "hydra"]["run"]["dir"]
    merged, summary = str(tmp / "merged"), str(tmp / "summary.json")
    stdout = run_main_job([*local_args(args, places), f"export.merged_dir={merged}",
                           f"training.summary_json={summary}", f"hydra.run.dir={hydra_run_dir}"],
                          cwd=str(tmp), env=job_env(WANDB_MODE="offline", XDG_CACHE_HOME=places["~/.cache"])).stdout
    s = json.load(open(summary))
    return dict(adapter=adapter, merged=merged, metrics=os.path.dirname(s["artifacts"]["plot"]),
                ckpt=ckpt, data=str(data), stdout=stdout, summary=s, places=places,
                printed=[line for line in stdout.splitlines() if merged not in line])


def test_the_page_shows_what_its_command_prints(finetuned):
    """docs/fine-tuning.md's "Output of that run" is what its command prints, line for line."""
    assert_output_matches(page_block("Output of that run"), finetuned["printed"], finetuned["places"])


def test_the_page_s_generate_example_answers_what_the_page_says(finetuned):
    """The page's ``generate`` line, on the adapter its command trained, answers what the page
    says it answers (the answer is transformers + peft's: tests/hf/test_generate.py)."""
    from megatron_fastpath.generate import generate, parse_args

    said = re.search(rf"after the {STEPS}-step run above: `([^`]*)`", open(PAGE, encoding="utf-8").read())
    assert said, "docs/fine-tuning.md does not say what generate answers after the run"
    _, text = generate(parse_args(local_args(page_command("megatron_fastpath.generate"), finetuned["places"])))
    assert text == said.group(1)


def test_train_and_eval_loss_fall_sync_free(finetuned):
    s, out = finetuned["summary"], finetuned["stdout"]
    assert s["steps"] == STEPS and s["syncs_per_step"] == 0
    assert s["last_loss"] < s["first_loss"] - 1.0, (s["first_loss"], s["last_loss"])
    evals = s["evals"]
    assert evals[0][0] == 0 and evals[-1][0] == STEPS and len(evals) == 1 + STEPS // 10
    assert s["eval_loss"] == evals[-1][1] < evals[0][1] - 1.0, evals
    assert s["data"]["records"] == 400 and s["data"]["eval_records"] == 40
    assert "eval loss" in out and "held-out loss" in out and "grad norm" in out
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in s["records"])


def test_metrics_files_written(finetuned):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = os.path.join(finetuned["metrics"], "tensorboard")
    acc = EventAccumulator(tb)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/grad_norm",
            "train/host_syncs_step", "eval/loss", "eval/perplexity", "eval/token_accuracy"} <= tags
    assert len(acc.Scalars("train/loss")) == STEPS
    assert [e.step for e in acc.Scalars("eval/loss")] == list(range(0, STEPS + 1, 10))
    png = os.path.join(finetuned["metrics"], "loss_curves.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert finetuned["summary"]["artifacts"]["plot"] == png
    try:  # W&B offline run when wandb is installed (metrics.wandb=auto)
        import wandb  # noqa: F401
    except ImportError:
        return
    run_dir = finetuned["summary"]["artifacts"]["wandb"]
    assert run_dir.startswith(finetuned["metrics"]) and "offline-run" in run_dir


@pytest.mark.smoke
def test_exported_adapter_lowers_transformers_held_out_loss(finetuned):
    from peft import PeftModel

    from megatron_fastpath.hf.data import JsonlDataConfig, load_jsonl_splits

    _, held, _ = load_jsonl_splits(JsonlDataConfig(path=finetuned["data"]), finetuned["ckpt"],
                                   log=lambda m: None)  # the job's held-out split (same seed)
    records = held.samples
    base = transformers.AutoModelForCausalLM.from_pretrained(finetuned["ckpt"])
    base_loss = held_out_loss(base, records)
    tuned = PeftModel.from_pretrained(base, finetuned["adapter"])
    tuned_loss = held_out_loss(tuned, records)
    merged = transformers.AutoModelForCausalLM.from_pretrained(finetuned["merged"])
    merged_loss, merged_accuracy = held_out_loss(merged, records, with_accuracy=True)
    ours = finetuned["summary"]["eval_loss"]
    # token accuracy and perplexity of the job's last evaluation, against transformers'
    assert finetuned["summary"]["eval_token_accuracy"] == pytest.approx(merged_accuracy, abs=1e-9)
    assert finetuned["summary"]["eval_perplexity"] == pytest.approx(math.exp(merged_loss), rel=1e-4)
    assert finetuned["summary"]["eval_accuracy"][0][1] < merged_accuracy  # training helped
    assert tuned_loss < base_loss - 1.0, (base_loss, tuned_loss)
    assert abs(base_loss - finetuned["summary"]["evals"][0][1]) < 1e-4 * base_loss
    assert abs(tuned_loss - ours) < 1e-4 * ours and abs(merged_loss - ours) < 1e-4 * ours
    tok = transformers.AutoTokenizer.from_pretrained(finetuned["merged"])  # tokenizer copied
    assert tok.chat_template and tok.eos_token == "<|eot_id|>"


def test_job_trains_without_transformers(finetuned, tmp_path):
    out = run_job([
        "model=hf", f"model.path={finetuned['ckpt']}", "data=jsonl", f"data.path={finetuned['data']}",
        "fastpath.lora=true", f"export.adapter_dir={tmp_path / 'a'}", "training.steps=3",
        "metrics.tensorboard=false", "metrics.wandb=off", f"hydra.run.dir={tmp_path / 'run'}",
    ], cwd=str(tmp_path), block_hf=True)
    assert "summary: 3 steps" in out
    assert os.path.isfile(tmp_path / "a" / "adapter_model.safetensors")


def test_readme_shows_the_documented_command():
    readme = open(os.path.join(REPO, "docs", "fine-tuning.md")).read()  # linked from the README
    assert "# Fine-tune a Hugging Face model" in readme
    assert "examples/make_tiny_hf_llama.py /tmp/tiny-llama" in readme
    assert ("python -m megatron_fastpath.train model=hf model.path=/tmp/tiny-llama data=jsonl "
            "data.path=examples/data/arith_chat.jsonl fastpath.lora=true "
            f"export.adapter_dir=/tmp/tiny-llama-lora training.steps={STEPS} "
            + " ".join(TINY_CHECKPOINT_OPTIMIZER)) in readme  # the resume test's settings


def test_step_lines_reach_train_log(finetuned):
    """Every printed step line and the summary are in the metrics directory's train.log."""
    log = open(os.path.join(finetuned["metrics"], "train.log")).read().splitlines()
    printed = finetuned["stdout"].splitlines()
    steps = [line for line in printed if line.startswith("step ")]
    assert len(steps) == STEPS and [line for line in log if line.startswith("step ")] == steps
    assert [line for line in log if line.startswith("summary: ")] == [
        line for line in printed if line.startswith("summary: ")]


def test_eval_history_survives_a_resume(finetuned, tmp_path):
    """Stopped at step 15 (after the evaluation at step 10) and resumed: the summary holds every
    evaluation of the run, equal to the straight run's, and the loss-curve data too."""
    ckpt_dir, summary = str(tmp_path / "ckpt"), str(tmp_path / "summary.json")
    common = ["model=hf", f"model.path={finetuned['ckpt']}", "data=jsonl", f"data.path={finetuned['data']}",
              "fastpath.lora=true", f"training.steps={STEPS}", f"checkpoint.dir={ckpt_dir}",
              "checkpoint.interval=10", "checkpoint.keep=1", "checkpoint.keep_best=true",
              f"hydra.run.dir={tmp_path}/run", "metrics.tensorboard=false", "metrics.wandb=off",
              *TINY_CHECKPOINT_OPTIMIZER]  # the straight run's (the finetuned fixture's)
    run_job(common + ["training.stop_at_step=15"], cwd=str(tmp_path))
    out = run_job(common + [f"training.summary_json={summary}"], cwd=str(tmp_path))
    assert out.splitlines()[0].startswith(f"resuming from {ckpt_dir}/step_00000015")
    resumed, straight = json.load(open(summary)), finetuned["summary"]
    assert resumed["evals"] == straight["evals"] and [e[0] for e in resumed["evals"]] == list(range(0, STEPS + 1, 10))
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in straight["records"]]
    assert resumed["eval_accuracy"] == straight["eval_accuracy"]
    # checkpoint.keep_best with keep=1: the newest, the one resumed from and the lowest
    # held-out loss survive (the rotation rules themselves: test_checkpoint_manager.py)
    best_step = min(resumed["evals"][1:], key=lambda e: (e[1], -e[0]))[0]
    assert resumed["best_checkpoint"] == f"{ckpt_dir}/step_{best_step:08d}"
    assert sorted(n for n in os.listdir(ckpt_dir) if n.startswith("step_")) == sorted(
        {f"step_{best_step:08d}", "step_00000015", f"step_{STEPS:08d}"})
    assert open(os.path.join(ckpt_dir, "best")).read() == f"step_{best_step:08d}"


def test_full_fine_tune_exports_hf_weights_and_export_does_not_block_resume(finetuned, tmp_path):
    """A full fine-tune (no LoRA) stopped at step 2 and resumed with export.merged_dir added
    (output only: not in the resume fingerprint) writes a Hugging Face checkpoint whose
    transformers held-out loss equals the job's final eval loss and differs from the base."""
    from megatron_fastpath.hf.data import JsonlDataConfig, load_jsonl_splits

    ckpt_dir, summary, out = tmp_path / "ckpt", tmp_path / "s.json", tmp_path / "full"
    common = ["model=hf", f"model.path={finetuned['ckpt']}", "data=jsonl", f"data.path={finetuned['data']}",
              "training.steps=4", "data.eval_every=0", f"checkpoint.dir={ckpt_dir}",
              "metrics.tensorboard=false", "metrics.wandb=off", f"hydra.run.dir={tmp_path}/run"]
    run_job(common + ["training.stop_at_step=2"], cwd=str(tmp_path))
    stdout = run_job(common + [f"export.merged_dir={out}", f"training.summary_json={summary}"],
                     cwd=str(tmp_path))
    assert stdout.splitlines()[0].startswith(f"resuming from {ckpt_dir}/step_00000002")
    assert f"exported fine-tuned Hugging Face checkpoint to {out}" in stdout
    s = json.load(open(summary))
    _, held, _ = load_jsonl_splits(JsonlDataConfig(path=finetuned["data"]), finetuned["ckpt"],
                                   log=lambda m: None)
    tuned = held_out_loss(transformers.AutoModelForCausalLM.from_pretrained(str(out)), held.samples)
    base = held_out_loss(transformers.AutoModelForCausalLM.from_pretrained(finetuned["ckpt"]), held.samples)
    assert abs(tuned - s["eval_loss"]) < 1e-4 * s["eval_loss"] and tuned < base - 1e-3, (tuned, base)
