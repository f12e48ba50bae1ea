"""The main job's Hugging Face pieces: ``model=hf``, ``data=jsonl``, evaluation, export.

    python -m megatron_fastpath.train model=hf model.path=<hf dir> data=jsonl \\
        data.path=<file.jsonl> fastpath.lora=true export.adapter_dir=<dir>

* :func:`parse_hf_groups` reads the ``model`` group when it names a checkpoint (``path``) and
  the ``data`` group when it names a JSONL file: the checkpoint's config.json and file headers
  are checked here, before any device work (unsupported architecture, missing / truncated
  files, TP / EP sizes that do not divide the heads or experts).
* :func:`build_hf_job_model` replaces the job's ``build_model``: the checkpoint's architecture on
  the fastpath spec with the switched-on features, each rank loading only its shard.
* :func:`build_jsonl_data` replaces ``build_data``: train bins per step and held-out bins.
* :func:`export_hf`: the PEFT adapter and / or the (merged) weights at the end of the run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import torch

from megatron_fastpath.hf.config import HFModelSpec

__all__ = ["HFJobConfig", "ExportConfig", "parse_hf_groups", "build_hf_job_model",
           "build_jsonl_data", "export_hf"]


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """The ``export`` group: what a ``model=hf`` run writes at the end (output only, so not part
    of the resume fingerprint). adapter_dir: a PEFT adapter directory (needs LoRA); merged_dir:
    the weights as a Hugging Face checkpoint (LoRA merged in; a full fine-tune as trained)."""

    adapter_dir: Optional[str] = None
    merged_dir: Optional[str] = None

    @property
    def enabled(self) -> bool:
        return bool(self.adapter_dir or self.merged_dir)


@dataclasses.dataclass(frozen=True)
class HFJobConfig:
    """``model=hf``: the checkpoint (path and its parsed config)."""

    path: str
    spec: HFModelSpec


def _group(cfg: Any, name: str) -> dict:
    from omegaconf import OmegaConf

    raw = cfg.get(name, {}) if cfg is not None else {}
    return OmegaConf.to_container(raw, resolve=True) if not isinstance(raw, dict) else dict(raw)


def parse_hf_groups(cfg: Any, tp: int = 1, ep: int = 1):
    """(ModelConfig or None, JsonlDataConfig or None, HFJobConfig or None) -- None where the
    group is not ``model=hf`` / ``data=jsonl``. All checks run on the host."""
    from megatron_fastpath.hf.checkpoint import SafetensorsCheckpoint
    from megatron_fastpath.hf.config import read_hf_config
    from megatron_fastpath.hf.data import JsonlDataConfig

    model_group, data_group = _group(cfg, "model"), _group(cfg, "data")
    hf = model = data = None
    if "path" in model_group:
        extra = sorted(set(model_group) - {"path"})
        if extra:
            raise ValueError(f"model=hf takes only model.path (the architecture comes from its "
                             f"config.json); unknown key(s) {extra}")
        spec = read_hf_config(str(model_group["path"]))
        spec.check_parallel(tp, ep)
        SafetensorsCheckpoint(spec.path).close()  # missing / truncated files, headers only
        hf, model = HFJobConfig(spec.path, spec), spec.model_config()
    if "path" in data_group:
        fields = {f.name for f in dataclasses.fields(JsonlDataConfig)}
        unknown = sorted(set(data_group) - fields)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in config group 'data' (jsonl); valid: "
                             f"{sorted(fields)}")
        data = JsonlDataConfig(**data_group)
        if hf is None and not data.tokenizer_path:
            raise ValueError("data=jsonl needs the checkpoint's tokenizer: use model=hf "
                             "model.path=<dir> (or set data.tokenizer_path)")
    return model, data, hf


def build_hf_job_model(cfg, tcfg, cache):
    """The job's model for ``model=hf``: build, load this rank's shard, freeze for LoRA.
    Returns (model, total parameters, trainable parameters)."""
    from megatron_fastpath.hf.checkpoint import SafetensorsCheckpoint
    from megatron_fastpath.hf.model import build_hf_gpt, load_hf_weights

    hook = None
    if cfg.offload is not None:
        from megatron_fastpath.offload import with_activation_offload

        def hook(spec):
            return with_activation_offload(spec, cfg.offload)

    spec = cfg.hf.spec
    model = build_hf_gpt(spec, tcfg, cache, lora=cfg.lora, backend=cfg.attention_backend,
                         linear_impl=cfg.linear_impl, layer_spec_hook=hook)
    ckpt = SafetensorsCheckpoint(spec.path)
    show = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    t0 = time.perf_counter()
    try:
        n = load_hf_weights(model, spec, ckpt, show_progress=show)
    finally:
        ckpt.close()
    if show:
        print(f"checkpoint: {spec.model_type} from {spec.path}: {n} tensors (this rank's TP/EP "
              f"shards) loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    total = trainable = sum(p.numel() for p in model.parameters())
    if cfg.lora is not None:
        from megatron_fastpath.lora import freeze_base_parameters, lock_lora

        trainable = freeze_base_parameters(model)
        if cfg.plan.capture:
            lock_lora(model)
    return model, total, trainable


def build_jsonl_data(cfg, dp_rank: int, dp_world: int, log=print):
    """(StepData of the train split, this rank's held-out bins or (), data report)."""
    from megatron_fastpath.data import StepData, pack_microbatches
    from megatron_fastpath.hf.data import load_jsonl_splits

    tok_path = cfg.hf.path if cfg.hf is not None else None
    show = dp_rank == 0 and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
    train, held, report = load_jsonl_splits(cfg.data, tok_path, log=log if show else (lambda m: None))
    if max(int(x.max()) for x, _ in train.samples) >= cfg.model.vocab_size:
        raise ValueError(f"{cfg.data.path}: token ids exceed the model's vocab_size "
                         f"{cfg.model.vocab_size}: the tokenizer does not belong to the checkpoint")
    bins = pack_microbatches(train, cfg.data)  # global order, identical on every rank
    per_step = cfg.training.micro_batches * dp_world
    if len(bins) < per_step:
        raise ValueError(f"{cfg.data.path}: {len(bins)} packed microbatches for {per_step} per "
                         "step; lower training.micro_batches or data.max_tokens")
    held_bins = pack_microbatches(held, cfg.data) if held is not None else []
    report = dict(report, train_microbatches=len(bins), eval_microbatches=len(held_bins),
                  train_loss_tokens=train.num_loss_tokens,
                  eval_loss_tokens=held.num_loss_tokens if held else 0)
    step_data = StepData(tuple(bins), cfg.training.micro_batches, dp_rank, dp_world)
    return step_data, tuple(held_bins[dp_rank::dp_world]), report


def export_hf(job, log=print) -> dict:
    """Write the PEFT adapter (``export.adapter_dir``) and the weights (``export.merged_dir``:
    LoRA merged in, or a full fine-tune's) of a finished ``model=hf`` run; returns {kind: dir}."""
    from megatron_fastpath.hf.export import save_merged_checkpoint, save_peft_adapter

    export, out = job.cfg.export, {}
    if export is None or job.cfg.hf is None:
        return out
    spec = job.cfg.hf.spec
    if export.adapter_dir:
        save_peft_adapter(job.model, spec, job.cfg.lora, export.adapter_dir)
        out["peft_adapter"] = export.adapter_dir
        log(f"exported PEFT adapter to {export.adapter_dir}")
    if export.merged_dir:
        save_merged_checkpoint(job.model, spec, export.merged_dir)
        out["merged"] = export.merged_dir
        what = "merged" if job.cfg.lora is not None else "fine-tuned"
        log(f"exported {what} Hugging Face checkpoint to {export.merged_dir}")
    return out


def check_hf_job(lora, export: Optional[ExportConfig], hf: Optional[HFJobConfig], data, pp: int) -> None:
    """Export and evaluation settings the job cannot honour, refused before anything is built."""
    exporting = export is not None and export.enabled
    if exporting and hf is None:
        raise ValueError("export.adapter_dir / export.merged_dir write Hugging Face files and "
                         "need model=hf model.path=<checkpoint>")
    if export is not None and export.adapter_dir and lora is None:
        raise ValueError("export.adapter_dir writes a PEFT adapter and needs fastpath.lora=true; "
                         "a full fine-tune exports its weights with export.merged_dir=<dir>")
    if exporting and pp > 1:
        raise ValueError("export.* with pipeline parallelism is not supported (each stage "
                         "holds other layers); export from a pipeline_model_parallel_size=1 run")
    if getattr(data, "eval_fraction", 0) > 0 and pp > 1:
        raise ValueError("held-out evaluation runs the model outside Megatron's pipeline "
                         "schedule: with pipeline parallelism set data.eval_fraction=0")
