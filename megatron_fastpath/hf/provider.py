"""The Hugging Face pair of providers of the main job: ``model=hf`` (a checkpoint directory) and
``data=jsonl`` (chat / prompt-completion records), registered with
:mod:`megatron_fastpath.providers` under ``hf`` and ``jsonl``::

    python -m megatron_fastpath.train model=hf model.path=<hf dir> data=jsonl \\
        data.path=<file.jsonl> fastpath.lora=true export.adapter_dir=<dir>

* :class:`HFModel` parses the ``model`` group (its ``path``): the checkpoint's config.json and
  file headers are checked before any device work (unsupported architecture, missing /
  truncated files, TP / EP sizes that do not divide the heads or experts); each rank then loads
  only its shard into the model the job built, and the run ends with the PEFT adapter and / or
  the (merged) weights written (``export`` group).
* :class:`JsonlData`: train bins per step and held-out bins, tokenized with the checkpoint's
  tokenizer (or ``data.tokenizer_path``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import torch

from megatron_fastpath.hf.config import HFModelSpec
from megatron_fastpath.hf.hub import hub_cache_snapshot, looks_like_hub_id
from megatron_fastpath.providers import (
    DataParts,
    DataProvider,
    ModelProvider,
    ModelSource,
    register_data_provider,
    register_model_provider,
)
from megatron_fastpath.settings import setting

__all__ = ["HFJobConfig", "HFModel", "HFModelSettings", "JsonlData"]


@dataclasses.dataclass(frozen=True)
class HFModelSettings:
    """The ``model`` group's keys for ``model=hf`` (the architecture comes from config.json)."""

    path: Optional[str] = setting(
        None, "the Hugging Face checkpoint directory (config.json + *.safetensors + tokenizer "
        "files), or a Hub id the local hub cache holds")


@dataclasses.dataclass(frozen=True)
class HFJobConfig:
    """``model=hf``: the checkpoint (path and its parsed config)."""

    path: str
    spec: HFModelSpec


def _model_dir(source: ModelSource):
    """The checkpoint directory of ``model=hf`` (its generation_config.json), else None."""
    return source.handle.path if isinstance(source.handle, HFJobConfig) else None


def _is_main_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _check_window(spec: HFModelSpec, data) -> None:
    """LongRoPE is served with its short factors, so no sequence of the data may be longer than
    its original context (checked at parse, before any weight is read; a sliding window has no
    bound: the windowed layers attend through it). The bound: data=jsonl refuses (or skips)
    records longer than data.max_tokens and completes held-out prompts within it; the synthetic
    data draws lengths up to data.max_len (<= max_tokens)."""
    if spec.max_sequence is None:  # no LongRoPE
        return
    longest, knob = data.max_tokens, "data.max_tokens"
    if getattr(data, "max_len", None) is not None and data.max_len < longest:
        longest, knob = data.max_len, "data.max_len"
    extra = (" (data=jsonl refuses longer records, or skips them with data.bad_records=skip)"
             if knob == "data.max_tokens" else "")
    spec.check_sequence_bound(longest, f"{knob}={longest}",
                              f"set {knob}<={spec.max_sequence}{extra}")


def checkpoint_dir(path) -> str:
    """``model.path`` as a local checkpoint directory: refused unset, missing, or a Hugging Face
    Hub id that the local hub cache does not hold (the job downloads nothing)."""
    if path is None or str(path) == "???":
        raise ValueError("model=hf needs model.path: it is unset; set model.path=<a Hugging Face "
                         "checkpoint directory> (config.json + *.safetensors + tokenizer files)")
    path = str(path)
    if os.path.isdir(path):
        return path
    if looks_like_hub_id(path):
        cached = hub_cache_snapshot(path, "model")
        if cached is not None:
            return cached
        raise ValueError(
            f"model.path={path!r} is not a directory; as a Hugging Face Hub id it is not resolved: "
            "the job reads a local copy only and the local hub cache does not hold it; download "
            f"it first (huggingface-cli download {path} --local-dir <dir>) and set model.path=<dir>")
    what = "is a file" if os.path.exists(path) else "does not exist"
    raise ValueError(f"model.path={path!r} {what}: model=hf reads a Hugging Face checkpoint "
                     "directory (config.json + *.safetensors); set model.path=<that directory>")


class HFModel(ModelProvider):
    key = "hf"

    def settings(self) -> type:
        return HFModelSettings

    def parse(self, group: dict, tp: int, ep: int) -> ModelSource:
        from megatron_fastpath.hf.checkpoint import SafetensorsCheckpoint
        from megatron_fastpath.hf.config import read_hf_config

        extra = sorted(set(group) - {f.name for f in dataclasses.fields(HFModelSettings)})
        if extra:
            raise ValueError(f"model=hf takes only model.path (the architecture comes from its "
                             f"config.json); unknown key(s) {extra}")
        spec = read_hf_config(checkpoint_dir(group.get("path")))
        spec.check_parallel(tp, ep)
        SafetensorsCheckpoint(spec.path).close()  # missing / truncated files, headers only
        return ModelSource(self.key, spec.model_config(), spec.rope_config(),
                           tie_embeddings=spec.tie_embeddings, tokenizer_path=spec.path,
                           handle=HFJobConfig(spec.path, spec),
                           sliding_window=spec.sliding_window, window_layers=spec.window_layers,
                           rope_local=spec.rope_config_local(), gemma=spec.gemma_options())

    def transformer_overrides(self, source: ModelSource, device) -> dict:
        """The checkpoint's fields (norm eps, QKV bias, router) and, on GPU, parameters allocated
        on the device (no host copy of the shard before its weights are loaded)."""
        return dict(source.handle.spec.transformer_overrides(),
                    use_cpu_initialization=device.type != "cuda")

    def check(self, source: ModelSource, *, lora, export, data, pipeline_size: int) -> None:
        from megatron_fastpath.data import DataConfig

        _check_window(source.handle.spec, data)
        if export is not None and export.enabled and isinstance(data, DataConfig) and not export.synthetic_data:
            raise ValueError(
                f"{' and '.join(export.dirs())} with the synthetic token data (no data=jsonl): the "
                "job would train the checkpoint on random tokens and export it as fine-tuned; add "
                "data=jsonl data.path=<your data file> (export.synthetic_data=true: a test of the "
                "export)")
        if export is not None and export.adapter_dir and lora is None:
            raise ValueError("export.adapter_dir writes a PEFT adapter and needs fastpath.lora=true; "
                             "a full fine-tune exports its weights with export.merged_dir=<dir>")
        if export is not None and export.enabled and pipeline_size > 1:
            raise ValueError("export.* with pipeline parallelism is not supported (each stage "
                             "holds other layers); export from a pipeline_model_parallel_size=1 run")

    def input_dirs(self, source: ModelSource) -> dict:
        return {"model.path": source.handle.path}

    def load_weights(self, model, source: ModelSource, log=print) -> None:
        from megatron_fastpath.hf.checkpoint import SafetensorsCheckpoint
        from megatron_fastpath.hf.model import load_hf_weights

        spec, show = source.handle.spec, _is_main_rank()
        ckpt = SafetensorsCheckpoint(spec.path)
        t0 = time.perf_counter()
        try:
            n = load_hf_weights(model, spec, ckpt, show_progress=show)
        finally:
            ckpt.close()
        if show:
            log(f"checkpoint: {spec.model_type} from {spec.path}: {n} tensors (this rank's TP/EP "
                f"shards) loaded in {time.perf_counter() - t0:.1f} s")

    def export(self, job, log=print) -> dict:
        """The PEFT adapter (``export.adapter_dir``) and the weights (``export.merged_dir``: LoRA
        merged in, or a full fine-tune's) of a finished run; returns {kind: dir}."""
        from megatron_fastpath.hf.export import save_merged_checkpoint, save_peft_adapter

        export, out = job.cfg.export, {}
        if export is None:
            return out
        spec = job.cfg.model_source.handle.spec
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


class JsonlData(DataProvider):
    key = "jsonl"

    def settings(self) -> type:
        from megatron_fastpath.hf.data import JsonlDataConfig

        return JsonlDataConfig

    def parse(self, group: dict, model: ModelSource):
        from megatron_fastpath.hf.data import JsonlDataConfig
        from megatron_fastpath.settings import parse_group

        data = parse_group("data", JsonlDataConfig, group)  # unknown keys, types: naming the key
        if model.tokenizer_path is None and not data.tokenizer_path:
            raise ValueError("data=jsonl needs the checkpoint's tokenizer: use model=hf "
                             "model.path=<dir> (or set data.tokenizer_path)")
        return data

    def build(self, cfg, dp_rank: int, dp_world: int, log=print) -> DataParts:
        from megatron_fastpath.data import pack_microbatches, train_step_data
        from megatron_fastpath.hf.data import build_eval_prompts, load_jsonl_splits

        show = dp_rank == 0 and _is_main_rank()
        train, held, report = load_jsonl_splits(cfg.data, cfg.model_source.tokenizer_path,
                                                log=log if show else (lambda m: None))
        if train.max_token_id >= cfg.model.vocab_size:
            raise ValueError(f"{cfg.data.path}: token ids exceed the model's vocab_size "
                             f"{cfg.model.vocab_size}: the tokenizer does not belong to the checkpoint")
        order = train_step_data(train, cfg, dp_rank, dp_world)  # identical on every rank
        bins = order.bins
        if len(bins) < order.per_step:
            raise ValueError(f"{cfg.data.path}: {len(bins)} packed microbatches for {order.per_step} "
                             f"per step; lower {order.batch_key}"
                             + (" or data.max_tokens" if order.batch_size is None else ""))
        held_bins = pack_microbatches(held, cfg.data) if held is not None else []
        report = dict(report, train_microbatches=len(bins), eval_microbatches=len(held_bins),
                      train_loss_tokens=train.num_loss_tokens,
                      eval_loss_tokens=held.num_loss_tokens if held else 0)
        return DataParts(order,
                         eval_bins=held_bins.every(dp_rank, dp_world) if held_bins else (),
                         report=report,
                         evaluate=bool(report["eval_records"]),
                         eval_prompts=build_eval_prompts(cfg.data, held, cfg.model_source.tokenizer_path,
                                                         _model_dir(cfg.model_source)))


register_model_provider(HFModel())
register_data_provider(JsonlData())
