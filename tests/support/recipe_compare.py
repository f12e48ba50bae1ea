"""The main job's side of the recipe hooks' end-to-end tests (NeMo 2's ``llm.finetune``,
Megatron-Bridge's ``finetune``): run it as a user does, dumping its initial LoRA parameters and
each step's packed microbatch, and write those microbatches in the frameworks' packed ``.npy``
format so their recipes train on the same packs in the same order.

Both frameworks read one format (NeMo 2.7 ``GPTSFTPackedDataset``, Bridge 0.6
``megatron/bridge/data/packing/gpt_sft.py``: ``input_ids`` per sequence + one label token,
``seq_start_id``, ``loss_mask``), each shuffling it its own way: :func:`nemo_order`,
:func:`bridge_order`.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np

SEED = 1234  # the datasets' default seed: GPTSFTPackedDataset's epoch shuffle

# The main job as a user runs it, plus a dump of its initial LoRA parameters and of the packed
# microbatch of each step (taken from the built job, before its first step).
MAIN_JOB_ENTRY = """
import sys, torch
import megatron_fastpath.train as T
from megatron_fastpath.train import loop
OUT = sys.argv.pop()
_train = loop.train  # what loop.run calls
def train(job, *args, **kwargs):
    lora = {n: p.detach().clone() for n, p in job.model.named_parameters() if "lora" in n}
    steps = [[dict(tokens=mb.tokens_1T.clone(), labels=mb.labels_1T.clone(),
                   mask=mb.loss_mask_1T.clone(), lengths=mb.lengths.copy())
              for mb in job.data.batch(s).microbatches] for s in range(1, job.cfg.training.steps + 1)]
    torch.save({"lora": lora, "steps": steps}, OUT)
    return _train(job, *args, **kwargs)
loop.train = train
sys.argv = ["megatron_fastpath.train"] + sys.argv[1:]
T.main()
"""


def run_main_job(tmp_path, hf: str, data: str, tokens: int, steps: int, env: dict):
    """The main job's LoRA fine-tune (rank 16, alpha 32, qkv + proj, no dropout; one pack of
    ``tokens`` per step; constant lr 3e-3) from ``hf`` on ``data``: (its per-step losses, the
    dump's path, the sequence lengths of each step's pack)."""
    import torch

    from tests.support.main_job import main_job_cmd

    dump, summary = str(tmp_path / "main_job.pt"), str(tmp_path / "main_job.json")
    overrides = [
        "model=hf", f"model.path={hf}", "data=jsonl", f"data.path={data}", f"data.max_tokens={tokens}",
        "fastpath.lora=true", "lora.dropout=0.0",  # rank 16, alpha 32, qkv + proj
        f"training.steps={steps}", "training.micro_batches=1",  # one pack per step (gbs = mbs = 1)
        "training.lr=3e-3", "training.warmup_steps=0", "training.min_lr=3e-3",  # constant lr 3e-3
        f"training.summary_json={summary}", f"hydra.run.dir={tmp_path / 'hydra'}",
        f"metrics.dir={tmp_path / 'metrics'}", dump,
    ]
    main = subprocess.run(main_job_cmd(overrides, entry=["-c", MAIN_JOB_ENTRY]), cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=600)
    assert main.returncode == 0, main.stdout[-3000:] + main.stderr[-3000:]
    losses = [r["loss"] for r in json.load(open(summary))["records"]]
    lengths = [mb["lengths"].tolist() for (mb,) in torch.load(dump, weights_only=False)["steps"]]
    return losses, dump, lengths


def nemo_order(n: int, seed: int = SEED) -> list:
    """The file index NeMo 2.7 reads at step k (first epoch): ``GPTSFTPackedDataset`` seeds
    ``np.random.seed(seed)`` in ``__init__``, then ``_build_samples_mapping`` shuffles one
    ``arange(len)`` per epoch."""
    np.random.seed(seed)
    perm = np.arange(n)
    np.random.shuffle(perm)
    return perm.tolist()


def bridge_order(n: int, seed: int = SEED) -> list:
    """The file index Megatron-Bridge 0.6 reads at step k (first epoch): its packed dataset
    builds no samples mapping without ``max_train_samples`` (``data/packing/gpt_sft.py:117``;
    its recipes leave it None); the ``"batch"`` sampler (``MegatronPretrainingBatchSampler``,
    the SFT default) shuffles each epoch with ``torch.randperm`` seeded ``seed + epoch``
    (``data/samplers.py:334-335``; ``seed`` = ``cfg.dataset.seed``, ``data/loaders.py:314``)."""
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g).tolist()


def packed_npy_items(steps: list, order: list) -> list:
    """The frameworks' packed-dataset items for the main job's step microbatches, each at the
    file index its framework reads at that step (``order[k]``: :func:`nemo_order`,
    :func:`bridge_order`)."""
    items = []
    for (mb,) in steps:
        ids, starts, mask, pos = [], [], [], 0
        for n in mb["lengths"].tolist():
            starts.append(len(ids))
            # the collate drops each sequence's last input id (inputs) / first (labels): the
            # sequence's n tokens plus the main job's label of its last position
            ids += mb["tokens"][0, pos:pos + n].tolist() + [int(mb["labels"][0, pos + n - 1])]
            mask += mb["mask"][0, pos:pos + n].long().tolist() + [0]
            pos += n
        items.append({"input_ids": ids, "seq_start_id": starts, "loss_mask": mask})
    ordered = [None] * len(items)
    for k, item in enumerate(items):
        ordered[order[k]] = item
    return ordered


def write_packed_npy(steps: list, out_dir: str, order: list) -> dict:
    """:func:`packed_npy_items` as ``train.npy`` (and ``val.npy``, the same: validation is off)
    plus the packing ``metadata.json`` in ``out_dir``: the three paths."""
    import os

    os.makedirs(out_dir, exist_ok=True)
    packs = np.array(packed_npy_items(steps, order), dtype=object)
    paths = {k: os.path.join(out_dir, f) for k, f in
             (("train", "train.npy"), ("val", "val.npy"), ("metadata", "metadata.json"))}
    np.save(paths["train"], packs, allow_pickle=True)
    np.save(paths["val"], packs, allow_pickle=True)
    longest = max(int(max(mb["lengths"])) for (mb,) in steps)
    with open(paths["metadata"], "w") as f:
        json.dump([{"dataset_max_seqlen": longest + 1,
                    "max_samples_per_bin": max(len(mb["lengths"]) for (mb,) in steps),
                    "min_packed_seqlen": min(int(sum(mb["lengths"])) for (mb,) in steps)}], f)
    return paths
