"""Child process of ``tests/integrations/test_bridge_finetune_cpu.py``: Megatron-Bridge 0.6's
``finetune`` with its LLM PEFT recipe (``megatron.bridge.recipes.common._peft_common``, the
template of every Bridge Llama LoRA recipe), with or without ``apply_fastpath_to_config``, on
the CPU under :func:`tests.support.bridge_on_cpu.bridge_on_cpu`, on the main job's weights and
data.

    python -m tests.workers.bridge_finetune_worker import HF_DIR MAIN_JOB_DUMP WORK_DIR OUT_JSON
    python -m tests.workers.bridge_finetune_worker stock|fastpath HF_DIR MAIN_JOB_DUMP WORK_DIR OUT_JSON

``import``: the HF checkpoint into a Megatron checkpoint (``WORK_DIR/ckpt``) the way
``AutoBridge.import_ckpt`` does (``from_hf_pretrained`` -> ``to_megatron_provider(load_weights=
True)`` -> ``provide_distributed_model`` -> ``save_megatron_model``), with the TE-only fusions
off (``import_ckpt`` finalizes the provider with them on, which megatron-core refuses without
TE: ``megatron/core/transformer/transformer_config.py:2185`` in 0.19.2, "apply_rope_fusion is
not available"). Its own process: the
save initializes megatron-core's global state (the rerun state machine, parallel_state), which
``finetune``'s setup initializes again.

``stock`` / ``fastpath``: ``finetune(cfg, forward_step)`` with Bridge's own
``gpt_step.forward_step``, or with the hook's config and forward step. Alignments with the main
job (``MAIN_JOB_DUMP``: its initial LoRA parameters and each step's packed microbatch), each a
public Bridge setting or the data handed to Bridge:

* weights: ``cfg.checkpoint.pretrained_checkpoint`` = the imported checkpoint (Bridge loads it
  before the PEFT transform); the LoRA adapters (``LoRA(dim=16, alpha=32, dropout=0,
  target_modules=[linear_qkv, linear_proj])``, the main job's ``lora`` group) get the main
  job's initial A / B at ``on_train_start`` (Bridge draws its own A; B is zero in both);
* data: the main job's packs as Bridge's packed ``.npy`` (``offline_packing_specs.
  packed_train_data_path``, ``tests/support/recipe_compare.py``), placed where the SFT
  sampler's shuffle (``cfg.dataset.seed`` 1234) reads pack k at step k;
* one microbatch per step (``global_batch_size = micro_batch_size = 1``), fp32
  (``mixed_precision = None``, ``params_dtype = float32``), no dropout;
* optimizer: Megatron Adam (torch AdamW without TE / Apex), lr 3e-3 constant (warmup 0,
  ``lr_decay_style = "constant"``), betas (0.9, 0.95), eps 1e-8, weight decay 0.01 (the
  scheduler's ``start_weight_decay`` / ``end_weight_decay``: Bridge's scheduler sets each
  step's, the recipe's 0.033 otherwise), clip 1.0, no distributed optimizer.

Writes ``OUT_JSON``: per step the reported ``lm loss``, and for the hooked run the sequence
lengths the packed cache held and the core attention of layer 0; the adapters' names (Bridge's,
the main job's mapped onto them, the trainable parameters).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.support.nemo_on_cpu import NO_TE_FUSIONS  # the TE-only fusions, off (one home)

LORA = dict(dim=16, alpha=32, dropout=0.0, target_modules=["linear_qkv", "linear_proj"])


def import_hf(hf_dir: str, out_dir: str) -> None:
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = bridge.to_megatron_provider(load_weights=True)
    for k, v in NO_TE_FUSIONS.items():
        setattr(provider, k, v)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    bridge.save_megatron_model(model, out_dir, hf_tokenizer_path=hf_dir)


def recipe(hf_dir: str, ckpt: str, packs: dict, tokens: int, steps: int):
    """Bridge's PEFT recipe template with the tiny model, the main job's data and settings."""
    from megatron.bridge.data.builders import GPTSFTDatasetConfig
    from megatron.bridge.data.packing import PackedSequenceSpecs
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.recipes.common import _peft_common

    from tests.support.recipe_compare import SEED

    cfg = _peft_common()
    model = AutoBridge.from_hf_pretrained(hf_dir).to_megatron_provider(load_weights=False)
    for k, v in NO_TE_FUSIONS.items():
        setattr(model, k, v)
    model.params_dtype, model.bf16 = torch.float32, False
    model.hidden_dropout = model.attention_dropout = 0.0
    model.seq_length = tokens
    cfg.model = model
    cfg.mixed_precision = None
    cfg.dataset = GPTSFTDatasetConfig(
        seq_length=tokens, dataset_root=os.path.dirname(packs["train"]), enable_offline_packing=True,
        offline_packing_specs=PackedSequenceSpecs(
            packed_sequence_size=tokens, packed_train_data_path=packs["train"],
            packed_val_data_path=packs["val"], packed_metadata_path=packs["metadata"]),
        dataset_kwargs={"pad_to_max_length": True}, do_validation=False, do_test=False,
        num_workers=0, seed=SEED)
    cfg.tokenizer.tokenizer_model = hf_dir
    cfg.checkpoint.pretrained_checkpoint = ckpt
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.checkpoint.async_save = False
    cfg.train.train_iters = steps
    cfg.train.global_batch_size = cfg.train.micro_batch_size = 1
    cfg.validation.eval_interval, cfg.validation.eval_iters = None, 0
    opt = cfg.optimizer
    opt.optimizer, opt.use_distributed_optimizer, opt.bf16, opt.fp16 = "adam", False, False, False
    opt.lr, opt.min_lr, opt.weight_decay, opt.clip_grad = 3e-3, 3e-3, 0.01, 1.0
    opt.adam_beta1, opt.adam_beta2, opt.adam_eps = 0.9, 0.95, 1e-8
    cfg.scheduler.lr_warmup_iters, cfg.scheduler.lr_decay_style = 0, "constant"
    # Bridge's scheduler sets each step's weight decay (the recipe's 0.033, constant)
    cfg.scheduler.start_weight_decay = cfg.scheduler.end_weight_decay = opt.weight_decay
    cfg.ddp.use_distributed_optimizer = False
    cfg.dist.distributed_backend = "gloo"
    cfg.logger.tensorboard_dir = None
    for k, v in LORA.items():
        setattr(cfg.peft, k, v)
    return cfg


def main(mode: str, hf_dir: str, dump_path: str, work: str, out_json: str) -> None:
    from tests.support.fake_te.activate import activate

    activate()
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.finetune import finetune
    from megatron.bridge.training.gpt_step import forward_step

    from megatron_fastpath.integrations import cache_for
    from megatron_fastpath.integrations.bridge import apply_fastpath_to_config
    from tests.support.bridge_on_cpu import bridge_on_cpu
    from tests.support.recipe_compare import SEED, bridge_order, write_packed_npy

    from tests.support.subproc import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    ckpt = os.path.join(work, "ckpt")
    if mode == "import":
        with bridge_on_cpu():
            torch.distributed.init_process_group("gloo")
            import_hf(hf_dir, ckpt)
        return

    dump = torch.load(dump_path, weights_only=False)
    steps = dump["steps"]
    tokens = int(steps[0][0]["tokens"].shape[1])
    packs = write_packed_npy(steps, os.path.join(work, f"data_{mode}"),
                             bridge_order(len(steps), SEED))
    cfg = recipe(hf_dir, ckpt, packs, tokens, len(steps))
    step = forward_step
    if mode == "fastpath":  # before the CPU block: the hook asks torch.cuda for the GPU it plans for
        cfg, step = apply_fastpath_to_config(cfg, max_seqs=16)
    report = {"losses": [], "lengths": [], "attention": [], "adapters": None,
              "provider": type(cfg.model).__name__, "rope": cfg.model.position_embedding_type}

    class MainJobAdapters(Callback):
        """The main job's initial LoRA A / B into Bridge's adapters (added by the PEFT pre-wrap
        hook when the model is built), before the first step; each step's loss."""

        def on_train_start(self, context):
            named = {n.replace("module.", "", 1): p for n, p in context.model[0].named_parameters()}
            adapters = {n: p for n, p in named.items() if ".adapter." in n}
            want = {}
            for name, value in dump["lora"].items():
                base, which = name.rsplit(".", 1)
                side = {"lora_A": "linear_in", "lora_B": "linear_out"}[which]
                want[f"{base}.adapter.{side}.weight"] = value
            with torch.no_grad():
                for name, value in want.items():
                    adapters[name].copy_(value)
            report["adapters"] = {
                "bridge": sorted(adapters), "main_job": sorted(want),
                "trainable": sorted(n for n, p in named.items() if p.requires_grad),
            }

        def on_train_step_end(self, context):
            report["losses"].append(float(context.loss_dict["lm loss"]))
            layer = context.model[0].module.decoder.layers[0]
            report["attention"].append(type(layer.self_attention.core_attention).__name__)
            if mode == "fastpath":
                report["lengths"].append(cache_for(step.settings)[0].current.lengths_N.tolist())

    with bridge_on_cpu():
        finetune(cfg, step, callbacks=[MainJobAdapters()])
    with open(out_json, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
