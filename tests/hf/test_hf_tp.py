"""Tensor parallel on CPU (torchrun, 2 gloo processes): each rank loads its TP shard of the
checkpoint (the held-out loss before training equals transformers' on the full model), and the
TP-gathered exports (PEFT adapter, merged checkpoint) reproduce the TP model's final held-out
loss in transformers."""

import os
import shutil

import pytest

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.support.main_job import TINY_CHECKPOINT_OPTIMIZER, run_main_job  # noqa: E402
from tests.hf.hf_reference import DATA, held_out_loss  # noqa: E402


def _main_job(tmp_path, nproc: int, args, summary) -> dict:
    """Run the main job with ``args`` (under torchrun when ``nproc`` > 1); its summary JSON."""
    name = os.path.splitext(os.path.basename(str(summary)))[0]
    run = run_main_job([*args, "metrics.tensorboard=false", "metrics.wandb=off", "metrics.plot=false"],
                       tmp_path, nproc=nproc, name=name)
    return run.summary


def test_tp2_load_train_export(tmp_path):
    from peft import PeftModel

    from megatron_fastpath.hf.data import JsonlDataConfig, load_jsonl_splits
    import make_tiny_hf_llama

    ckpt, data = str(tmp_path / "ckpt"), str(tmp_path / "chat.jsonl")
    make_tiny_hf_llama.main(ckpt, DATA)
    shutil.copy(DATA, data)
    s = _main_job(tmp_path, 2, [
        "model=hf", f"model.path={ckpt}", "data=jsonl", f"data.path={data}", "fastpath.lora=true",
        "lora.targets=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
        f"export.adapter_dir={tmp_path / 'adapter'}", f"export.merged_dir={tmp_path / 'merged'}",
        "parallel.tensor_model_parallel_size=2", "training.steps=4", "training.clip_grad=0",
        f"hydra.run.dir={tmp_path / 'run'}", *TINY_CHECKPOINT_OPTIMIZER], tmp_path / "s.json")
    assert s["world_size"] == 2

    _, held, _ = load_jsonl_splits(JsonlDataConfig(path=data), ckpt, log=lambda m: None)
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    base_loss = held_out_loss(base, held.samples)
    assert abs(s["evals"][0][1] - base_loss) < 1e-4 * base_loss  # TP shards loaded right
    ours = s["eval_loss"]
    assert ours < base_loss - 0.2
    tuned = held_out_loss(PeftModel.from_pretrained(base, str(tmp_path / "adapter")), held.samples)
    merged = held_out_loss(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")),
                           held.samples)
    assert abs(tuned - ours) < 1e-4 * ours and abs(merged - ours) < 1e-4 * ours


def test_ep2_loads_and_exports_expert_shards(tmp_path):
    """Qwen3-MoE with expert_model_parallel_size=2: same losses as one process, and the merged
    export gathers both ranks' experts back to exactly the checkpoint's (frozen) tensors."""
    import glob

    from safetensors.torch import load_file

    from tests.hf.hf_reference import make_checkpoint

    ckpt = str(tmp_path / "moe")
    make_checkpoint("qwen3_moe_norm", ckpt)
    common = ["model=hf", f"model.path={ckpt}", "fastpath.lora=true", "training.steps=3",
              "data.num_samples=128", "data.max_tokens=128", "data.max_len=48"]
    summaries = {}
    for ep in (1, 2):
        out = tmp_path / f"ep{ep}"
        summaries[ep] = _main_job(tmp_path, ep, common + [
            f"parallel.expert_model_parallel_size={ep}", f"training.micro_batches={3 - ep}",
            f"export.merged_dir={out}", "export.synthetic_data=true",
            f"hydra.run.dir={tmp_path / f'run{ep}'}"], f"{out}.json")
    for a, b in zip(summaries[1]["records"], summaries[2]["records"]):
        assert abs(a["loss"] - b["loss"]) <= 2e-4 * abs(a["loss"])
    src, merged = {}, {}
    for f in glob.glob(os.path.join(ckpt, "*.safetensors")):
        src.update(load_file(f))
    for f in glob.glob(str(tmp_path / "ep2" / "*.safetensors")):
        merged.update(load_file(f))
    assert set(src) == set(merged)
    experts = [k for k in src if ".mlp." in k]
    assert len(experts) == 2 * (1 + 3 * 4)  # per layer: router + 4 experts x (gate, up, down)
    assert all(src[k].equal(merged[k]) for k in experts)


def test_dp2_matches_one_process_including_eval(tmp_path):
    """data=jsonl under data parallelism: 2 ranks x 1 microbatch == 1 rank x 2 microbatches, per
    step and for the held-out loss (each rank evaluates its share, sums all-reduced)."""
    import make_tiny_hf_llama

    ckpt, data = str(tmp_path / "ckpt"), str(tmp_path / "chat.jsonl")
    make_tiny_hf_llama.main(ckpt, DATA)
    shutil.copy(DATA, data)
    out = {}
    for n in (1, 2):
        out[n] = _main_job(tmp_path, n, [
            "model=hf", f"model.path={ckpt}", "data=jsonl", f"data.path={data}", "fastpath.lora=true",
            "lora.dropout=0", "training.steps=4", "data.eval_every=2",
            f"training.micro_batches={3 - n}", f"hydra.run.dir={tmp_path / f'run{n}'}"],
            tmp_path / f"dp{n}.json")
    assert out[2]["world_size"] == 2
    for a, b in zip(out[1]["records"], out[2]["records"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"]
    assert [s for s, _ in out[1]["evals"]] == [s for s, _ in out[2]["evals"]] == [0, 2, 4]
    for (_, a), (_, b) in zip(out[1]["evals"], out[2]["evals"]):
        assert abs(a - b) <= 1e-5 * a


FAMILIES = {"qwen3_full_finetune": ("qwen3", False), "llama_lora": ("llama", True),
            "gemma2_lora": ("gemma2", True), "gemma3_lora": ("gemma3", True)}


@pytest.fixture(scope="module")
def tp_records(tmp_path_factory):
    """{(family id, TP size): the step records}: every family's TP = 1 run in one process and
    its TP = 2 run in one torchrun launch (tests/workers/main_jobs_worker.py: the runs one after
    the other, each as the main job trains it; one start and one import of torch, Megatron and
    transformers per launch instead of per run). The main job's own command line under torchrun
    at TP = 2 is test_tp2_load_train_export's."""
    import json
    import subprocess

    from tests.hf.hf_reference import make_checkpoint
    from tests.support.main_job import job_env, main_job_cmd

    root = tmp_path_factory.mktemp("tp")
    runs = {}
    for name, (family, lora) in FAMILIES.items():
        ckpt = str(root / family)
        make_checkpoint(family, ckpt)
        lora_settings = ["lora.dropout=0.0", "lora.targets=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"]
        common = ["model=hf", f"model.path={ckpt}", f"fastpath.lora={str(lora).lower()}",
                  *(lora_settings if lora else []),
                  "training.lr=1e-2", "training.steps=4", "training.micro_batches=1",
                  "data.num_samples=128", "data.max_tokens=128", "data.max_len=48",
                  "metrics.tensorboard=false", "metrics.wandb=off", "metrics.plot=false"]
        for tp in (1, 2):
            runs[name, tp] = common + [f"parallel.tensor_model_parallel_size={tp}",
                                       f"training.summary_json={root / f'{name}-tp{tp}.json'}"]
    for tp in (1, 2):
        spec = root / f"tp{tp}.json"
        spec.write_text(json.dumps([o for (_, t), o in runs.items() if t == tp]))
        proc = subprocess.run(main_job_cmd([str(spec)], nproc=tp, entry=["-m", "tests.workers.main_jobs_worker"]),
                              cwd=root, env=job_env(), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {key: json.loads((root / f"{key[0]}-tp{key[1]}.json").read_text())["records"] for key in runs}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp2_trains_as_one_process(tp_records, name):
    """TP = 2 on the CPU path takes the same steps as one process, with gradient clipping on
    (every step's norm > clip_grad = 1): the clip uses Megatron's TP-aware norm, which needs
    the TP marks of the sharded weights (the loaded base: Megatron sets them only when it
    initialises; the LoRA adapters) and the qk layernorm gradients summed over TP (Qwen3);
    Gemma 2 through the main job: its layer (post norms, soft-capping, windows) built there."""
    records = {tp: tp_records[name, tp] for tp in (1, 2)}
    assert len(records[1]) == len(records[2]) == 4
    for a, b in zip(records[1], records[2]):
        assert a["grad_norm"] > 1.0  # clipped
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a, b)
