"""Child process of ``tests/integrations/test_nemo_finetune_cpu.py``: NeMo 2's ``llm.finetune``
(LoRA recipe + ``apply_fastpath``) for the main job's steps, on the CPU under
:func:`tests.support.nemo_on_cpu.nemo_on_cpu`, on the main job's weights and data.

    python -m tests.workers.nemo_finetune_worker HF_DIR MAIN_JOB_DUMP WORK_DIR OUT_JSON

``MAIN_JOB_DUMP`` (written by the main job's entry in the test): the main job's initial LoRA
parameters and each step's packed microbatch (tokens, labels, loss mask, sequence lengths).
Alignments with the main job, each a public NeMo setting or the data handed to NeMo:

* weights: the HF checkpoint imported with ``llm.import_ckpt`` (NeMo's HF -> NeMo conversion),
  restored by ``AutoResume(restore_config=...)``; the LoRA adapters (``LoRA(dim=16, alpha=32,
  dropout=0, target_modules=[linear_qkv, linear_proj])``, the main job's ``lora`` group) get
  the main job's initial A / B before the first step (NeMo draws its own A; B is zero in both);
* data: the main job's packs written as NeMo's packed ``.npy`` (``input_ids`` per sequence +
  one label token, ``seq_start_id``, ``loss_mask``; ``tests/support/recipe_compare.py``), so
  NeMo's ``GPTSFTPackedDataset`` collate rebuilds the same tokens / labels / mask /
  boundaries; the file's order undoes NeMo's epoch shuffle (seed 1234) so step k trains on
  the main job's pack k (the lengths each step trained on are reported and compared by the
  test);
* one microbatch per step (``global_batch_size = micro_batch_size = 1``): NeMo averages the
  microbatches' per-token means, the main job divides by the global token count; with one
  microbatch both are the per-token mean of that pack;
* optimizer: Megatron Adam (torch AdamW on CPU) with the main job's lr 3e-3 (constant: no NeMo
  scheduler; the main job runs warmup 0 and min_lr = lr), betas (0.9, 0.95), eps 1e-8, weight
  decay 0.01, clip 1.0; fp32 (no mixed-precision plugin), no dropout.
"""

from __future__ import annotations

import json
import os
import sys

import torch

def main(hf_dir: str, dump_path: str, work: str, out_json: str) -> None:
    import fiddle as fdl
    import nemo_run as run
    from lightning.pytorch.callbacks import Callback
    from nemo import lightning as nl
    from nemo.collections import llm

    from megatron_fastpath.integrations import cache_for
    from megatron_fastpath.integrations.nemo import apply_fastpath
    from tests.support.nemo_on_cpu import NO_TE_FUSIONS, import_hf_llama, nemo_on_cpu
    from tests.support.recipe_compare import SEED, nemo_order, write_packed_npy

    dump = torch.load(dump_path, weights_only=False)
    steps = dump["steps"]
    t = int(steps[0][0]["tokens"].shape[1])
    shape = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, seq_length=t, rotary_base=10000.0, layernorm_epsilon=1e-5,
                 share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=128)
    nemo_dir = import_hf_llama(hf_dir, os.path.join(work, "nemo_ckpt"), **shape)

    packs = write_packed_npy(steps, os.path.join(work, "data"), nemo_order(len(steps), SEED))
    data, meta = os.path.dirname(packs["train"]), packs["metadata"]

    recipe = llm.llama32_1b.finetune_recipe(dir=os.path.join(work, "run"), name="fastpath_cpu", num_nodes=1,
                                            num_gpus_per_node=1, peft_scheme="lora", packed_sequence=True,
                                            seq_length=t)
    recipe.model = run.Config(llm.LlamaModel, config=run.Config(
        llm.LlamaConfig, **shape, params_dtype=torch.float32, bf16=False, hidden_dropout=0.0,
        attention_dropout=0.0, **NO_TE_FUSIONS))
    recipe.data = run.Config(
        llm.FineTuningDataModule, dataset_root=data, seq_length=t, micro_batch_size=1, global_batch_size=1,
        seed=SEED, packed_sequence_specs=run.Config(
            llm.gpt.data.packed_sequence.PackedSequenceSpecs, packed_sequence_size=t,
            packed_train_data_path=packs["train"], packed_val_data_path=packs["val"],
            packed_metadata_path=meta),
        dataset_kwargs={"pad_to_max_length": True})
    recipe.resume = run.Config(nl.AutoResume, restore_config=run.Config(nl.RestoreConfig, path=nemo_dir))
    recipe.peft = run.Config(llm.peft.LoRA, dim=16, alpha=32, dropout=0.0,
                             target_modules=["linear_qkv", "linear_proj"])
    recipe.trainer.accelerator = "cpu"
    recipe.trainer.plugins = None  # fp32
    recipe.trainer.max_steps = len(steps)
    recipe.trainer.limit_val_batches = 0
    recipe.trainer.val_check_interval = len(steps)
    recipe.trainer.enable_checkpointing = False
    recipe.trainer.strategy.ckpt_async_save = False
    recipe.trainer.strategy.pipeline_dtype = torch.float32
    recipe.log.ckpt = None
    opt = recipe.optim.config
    opt.bf16, opt.lr, opt.weight_decay, opt.clip_grad = False, 3e-3, 0.01, 1.0
    opt.adam_beta1, opt.adam_beta2, opt.adam_eps = 0.9, 0.95, 1e-8
    recipe.optim.lr_scheduler = None  # constant lr
    recipe = apply_fastpath(recipe)

    report = {"losses": [], "lengths": [], "attention": [], "adapters": None}

    class MainJobAdapters(Callback):
        """The main job's initial LoRA A / B into NeMo's adapters (NeMo's PEFT transform adds
        them at on_train_epoch_start, after on_train_start): once, before the first step."""

        done = False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.done:
                return
            self.done = True
            named = {n.replace("module.module.", "module."): p for n, p in pl_module.named_parameters()}
            adapters = {n: p for n, p in named.items() if ".adapter." in n}
            want = {}
            for name, value in dump["lora"].items():
                base, which = name.rsplit(".", 1)
                side = {"lora_A": "linear_in", "lora_B": "linear_out"}[which]
                want[f"module.{base}.adapter.{side}.weight"] = value
            with torch.no_grad():
                for name, value in want.items():
                    adapters[name].copy_(value)
            report["adapters"] = {
                "nemo": sorted(adapters), "main_job": sorted(want),
                "trainable": sorted(n for n, p in named.items() if p.requires_grad),
            }

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            cache = cache_for(pl_module.config.data_step_fn.settings)[0]
            report["losses"].append(float(outputs["loss"]))
            report["lengths"].append(cache.current.lengths_N.tolist())
            layer = pl_module.module.module.decoder.layers[0]
            report["attention"].append(type(layer.self_attention.core_attention).__name__)

    finetune = fdl.build(recipe)
    finetune.keywords["trainer"].callbacks.append(MainJobAdapters())
    with nemo_on_cpu():
        finetune()
    with open(out_json, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
