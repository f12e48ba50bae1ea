"""The main job's configuration: one frozen dataclass per component, parsed and validated once.

:func:`parse_job_config` turns the composed Hydra tree into a :class:`JobConfig` and raises, before
any device work, for every combination the job cannot run. It is a pure function of the tree and
of what is known without a device (the packages installed, the files the model and data name,
the launcher's world size): it gathers the run's facts once and calls the rules
(:mod:`megatron_fastpath.rules`) once; it creates, writes and sets nothing.
:func:`megatron_fastpath.train.preflight.preflight` does what the job then needs before its first
device work (output directories, environment, the GPU's capability, the memory check).

Each setting has one home: a feature is switched on or off in ``fastpath`` only; its group
(``lora``, ``offload``, ``cuda_graphs``, ``fp8``) holds only its settings and is read only when
the switch is on (``None`` when off).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_fastpath import rules
from megatron_fastpath import settings as key_rules
from megatron_fastpath.model import ModelConfig
from megatron_fastpath.providers import (
    ExportConfig,
    ModelSource,
    PackedDataSettings,
    data_provider,
    model_provider,
    pop_provider_key,
)
from megatron_fastpath.settings import (
    FINITE_NON_NEGATIVE,
    FINITE_POSITIVE,
    NON_NEGATIVE,
    POSITIVE,
    parse_group,
    setting,
)
from megatron_fastpath.train.parallel import (
    ClusterConfig,
    ParallelConfig,
    launched_world_size,
    resolve_data_parallel,
)

if TYPE_CHECKING:  # the feature groups' types, imported where parsed (they pull in torch / Megatron)
    from megatron_fastpath.checkpoint import CheckpointConfig
    from megatron_fastpath.fp8 import FP8Config
    from megatron_fastpath.graphs.config import CudaGraphConfig, GraphPlan
    from megatron_fastpath.lora import LoRAConfig
    from megatron_fastpath.offload import OffloadConfig
    from megatron_fastpath.train.metrics import MetricsConfig

__all__ = ["TrainingConfig", "FastpathConfig", "ParallelConfig", "ClusterConfig", "JobConfig",
           "config_dir", "parse_job_config", "section"]


SYNC_CHECK_MODES = ("first", "every", "off")
DTYPES = ("float32", "bfloat16")  # training.dtype (tests/train/test_feature_matrix.py reads it)
SYNC_CHECK_FIRST_STEPS = 3  # training.sync_check=first: steps counted, then none
DEFAULT_STEPS = 40  # training.steps when neither it nor training.epochs is set
# training.micro_batches when neither it nor training.batch_sequences / batch_tokens is set
DEFAULT_MICRO_BATCHES = 2
BATCH_KEYS = ("micro_batches", "batch_sequences", "batch_tokens")  # set at most one


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """The ``training`` group: the run's length, optimizer schedule, device and checks."""

    steps: Optional[int] = setting(
        None, "steps to train; null: 40, or the steps training.epochs' passes over the packed "
        "data take (set at most one of the two)", POSITIVE)
    epochs: Optional[int] = setting(
        None, "passes over the data, reshuffled and repacked each epoch by (data.seed, epoch); "
        "null: one packed order cycled through for training.steps steps", POSITIVE)
    micro_batches: Optional[int] = setting(
        None, "packed microbatches (bins of data.max_tokens) per step on each data-parallel rank; "
        "null with neither training.batch_sequences nor training.batch_tokens: 2 (set at most one "
        "of the three)", POSITIVE)
    batch_sequences: Optional[int] = setting(
        None, "sequences per step over all ranks, resolved into whole packed microbatches per "
        "rank (the nearest on the packed data's mean: data.resolve_batch)", POSITIVE)
    batch_tokens: Optional[int] = setting(
        None, "tokens per step over all ranks, resolved into whole packed microbatches per rank "
        "(the nearest on the packed data's mean: data.resolve_batch)", POSITIVE)
    lr: Optional[float] = setting(
        None, "peak learning rate; null: the model provider's default (train/defaults.py)", FINITE_POSITIVE)
    min_lr: Optional[float] = setting(
        None, "learning rate at the end of the schedule; null: the model provider's default",
        FINITE_NON_NEGATIVE)
    warmup_steps: Optional[int] = setting(
        None, "linear warm-up steps; null: the model provider's default", NON_NEGATIVE)
    lr_schedule: str = setting("cosine", "after the warm-up, from lr to min_lr: cosine | linear | constant")
    weight_decay: float = setting(0.01, "AdamW weight decay", FINITE_NON_NEGATIVE)
    clip_grad: float = setting(1.0, "gradient-norm clipping threshold (0: no clipping)", FINITE_NON_NEGATIVE)
    seed: int = setting(1234, "seed of the model's initialisation and dropout")
    device: str = setting("auto", "auto (cuda when available) | cpu | cuda")
    dtype: str = setting("float32", "training dtype: float32 | bfloat16")
    log_all_ranks: bool = setting(False, "print the step line on every rank, not only rank 0")
    dry_run: bool = setting(False, "parse, build the data, check memory, print the plan and exit 0 (no step)")
    summary_json: Optional[str] = setting(None, "write the run's summary to this JSON file")
    skip_memory_check: bool = setting(False, "skip the memory check that refuses jobs that cannot fit")
    stop_at_step: Optional[int] = setting(
        None, "stop after this step (saving a checkpoint when checkpoint.dir is set); the LR "
        "schedule and data order still span training.steps, so a rerun without it continues", POSITIVE)
    optimizer_step: str = setting(
        "auto", "GPU path: sync_free (clip, inf skip, loss scale on the device) | megatron "
        "(Megatron's step) | auto (sync_free where it applies: torch Adam/AdamW)")
    sync_check: str = setting(
        "first", "count host syncs (SyncSentinel) in: first (the first 3 steps) | every step "
        "(a diagnosis: it costs step time) | off")


@dataclasses.dataclass(frozen=True)
class FastpathConfig:
    """The ``fastpath`` group: the feature switches (the only place a feature is turned on or
    off); each feature's settings live in the group of the same name, read only when its switch
    is on."""

    attention_backend: str = setting(
        "auto", "auto | sdpa | flex | flash | te (auto: te > flash on CUDA in bf16 / fp16, else "
        "sdpa); attention always reads the packed cache")
    sdpa_layout: str = setting(
        "auto", "how the sdpa backend attends: mask (one [T,T] mask) | padded (a row per "
        "sequence) | auto (padded when it is smaller, or T is above the mask's limit)")
    linear_impl: str = setting("auto", "auto | local | te (Transformer Engine linears, needed for FP8)")
    offload: bool = setting(False, "double-buffered activation offload of layer inputs (group offload)")
    lora: bool = setting(False, "LoRA adapters, base weights frozen (group lora)")
    cuda_graphs: bool = setting(
        False, "per-layer CUDA graphs; on CPU the graph-safety audit (group cuda_graphs)")
    fp8: bool = setting(False, "Transformer Engine FP8 (group fp8)")
    moe_capacity_factor: Optional[float] = setting(
        None, "MoE dispatch: null = dropless; a number = capacity mode (static shapes)")
    linear_cross_entropy: Optional[str] = setting(
        None, "the loss: chunked (output layer and cross-entropy fused over token chunks, no [T, V] "
        "logits) | off (Megatron's) | null (chunked from rules.LINEAR_CROSS_ENTROPY_MIN_LOGITS logits per rank)")


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """Every group of the job, validated, plus what was decided from them.

    lora / offload / cuda_graphs / fp8: the feature's settings, None when its switch is off.
    device, attention_backend, linear_impl: resolved from the ``auto`` choices (the attention
    backend once: a ``ResolvedBackend`` the layer spec and the layers take as it is);
    linear_cross_entropy: the loss, "chunked" or "off" (``fastpath.linear_cross_entropy`` resolved).
    plan: the CUDA-graph / FP8 plan (TransformerConfig fields, environment, capture or audit).
    facts: the run as the rules read it (the preflight adds the GPU's capability); not a
    setting: left out of the config's repr, comparisons and the metrics' run config.
    training.steps: None until the data is built when unset (:func:`set_steps`);
    training.micro_batches: None until the data is built with training.batch_sequences /
    batch_tokens (:func:`set_from_data`).
    """

    model: ModelConfig
    data: PackedDataSettings  # the data provider's config (DataConfig, hf's JsonlDataConfig)
    training: TrainingConfig
    fastpath: FastpathConfig
    parallel: ParallelConfig
    cluster: ClusterConfig
    lora: Optional[LoRAConfig]
    offload: Optional[OffloadConfig]
    cuda_graphs: Optional[CudaGraphConfig]
    fp8: Optional[FP8Config]
    device: torch.device
    attention_backend: str
    linear_impl: str
    plan: GraphPlan
    model_source: Optional[ModelSource] = None  # the model provider's parse (providers/)
    data_provider: str = "synthetic"  # the data group's provider key
    metrics: Optional[MetricsConfig] = None  # None when the tree has no metrics group
    checkpoint: Optional[CheckpointConfig] = None  # checkpoint.dir None: off
    export: Optional[ExportConfig] = None  # what the run writes at the end (its model provider)
    linear_cross_entropy: str = "off"
    facts: Optional[rules.RunFacts] = dataclasses.field(
        default=None, repr=False, compare=False, metadata={"setting": False})

    @property
    def is_moe(self) -> bool:
        return self.model.num_experts is not None

    @property
    def features(self) -> tuple:
        return tuple(f for f in ("lora", "offload", "cuda_graphs", "fp8") if getattr(self.fastpath, f))


def _group_dict(cfg: Any, name: str) -> dict:
    from omegaconf import OmegaConf

    raw = cfg.get(name, {}) if cfg is not None else {}
    return OmegaConf.to_container(raw, resolve=True) if not isinstance(raw, dict) else dict(raw)


def section(cfg: Any, name: str, cls, fixed: Optional[dict] = None, switch: str = ""):
    """A config group as its frozen dataclass (unknown keys are an error). ``fixed`` fields are
    set by the job, not the group (``switch`` names where they are set instead)."""
    data = _group_dict(cfg, name)
    # a moved key left null in its old group's YAML (a set one is refused by _refuse_moved_keys)
    data = {k: v for k, v in data.items() if not (f"{name}.{k}" in dict(_MOVED_KEYS) and v is None)}
    return parse_group(name, cls, data, fixed, switch)  # types and bounds, naming the key


def config_dir() -> str:
    """The Hydra config directory: $MEGATRON_FASTPATH_CONFIGS or the package's configs/ (shipped
    in the wheel, so a non-editable install runs the main job)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.environ.get(
        "MEGATRON_FASTPATH_CONFIGS", os.path.join(os.path.dirname(here), "configs")
    )


def group_types() -> dict:
    """{group: its settings dataclass} of every group but ``model`` and ``data`` (whose keys
    are their provider's: ``ModelProvider.settings``): the types :func:`parse_job_config` reads
    them as, each field with its default and description (``train/help.py`` prints them)."""
    from megatron_fastpath.checkpoint import CheckpointConfig
    from megatron_fastpath.fp8 import FP8Config
    from megatron_fastpath.graphs.config import CudaGraphConfig
    from megatron_fastpath.lora import LoRAConfig
    from megatron_fastpath.offload import OffloadConfig
    from megatron_fastpath.train.metrics import MetricsConfig

    return {"training": TrainingConfig, "fastpath": FastpathConfig, "parallel": ParallelConfig,
            "cluster": ClusterConfig, "lora": LoRAConfig, "offload": OffloadConfig,
            "cuda_graphs": CudaGraphConfig, "fp8": FP8Config, "metrics": MetricsConfig,
            "export": ExportConfig, "checkpoint": CheckpointConfig}


@functools.lru_cache(maxsize=32)
def _yaml_file(path: str, mtime_ns: int) -> dict:
    """A YAML file as a plain dict, read once per version (its modification time): a group's
    defaults, which every parse with the group's switch off compares against."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path))


def _refuse_settings_while_off(cfg: Any, fast: FastpathConfig, types: dict) -> None:
    """A feature group's keys set away from its default option (``configs/<group>/default.yaml``)
    while its ``fastpath`` switch is off: refused (:func:`megatron_fastpath.settings.settings_while_off`)."""
    for group, switch in key_rules.FEATURE_SWITCHES.items():
        if getattr(fast, switch.split(".")[1]) or cfg is None or group not in cfg:
            continue
        cls, fixed = types[group]
        default = os.path.join(config_dir(), group, "default.yaml")
        defaults = parse_group(group, cls, {k: v for k, v in _yaml_file(
            default, os.stat(default).st_mtime_ns).items() if not (f"{group}.{k}" in dict(_MOVED_KEYS))}, fixed)
        changed = key_rules.changed_settings(group, section(cfg, group, cls, fixed), defaults,
                                          tuple(fixed or ()))
        refuse([r for r in (key_rules.settings_while_off(group, changed),) if r])


def _feature_sections(cfg: Any, fast: FastpathConfig) -> dict:
    """Settings of each feature switched on in ``fastpath`` (None when off)."""
    from megatron_fastpath.fp8 import FP8Config
    from megatron_fastpath.graphs.config import CudaGraphConfig
    from megatron_fastpath.lora import LoRAConfig
    from megatron_fastpath.offload import OffloadConfig

    _refuse_settings_while_off(cfg, fast, {
        "lora": (LoRAConfig, None), "offload": (OffloadConfig, {"enabled": True}),
        "cuda_graphs": (CudaGraphConfig, None), "fp8": (FP8Config, None)})
    graphs = section(cfg, "cuda_graphs", CudaGraphConfig) if fast.cuda_graphs else None
    return dict(
        lora=section(cfg, "lora", LoRAConfig) if fast.lora else None,
        # OffloadConfig.enabled is the library's "recompute only" baseline; the job's switch is
        # fastpath.offload, so the group cannot set it.
        offload=section(cfg, "offload", OffloadConfig, fixed={"enabled": True},
                        switch="fastpath.offload") if fast.offload else None,
        # the capture warm-up left unset: 3, or 0 with LoRA (graphs.config.default_warmup_steps)
        cuda_graphs=graphs.resolved(lora=fast.lora) if graphs is not None else None,
        fp8=section(cfg, "fp8", FP8Config) if fast.fp8 else None,
    )


def resolve_device(name: str) -> torch.device:
    from megatron_fastpath.distributed import default_device

    if name == "auto":
        return default_device()
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device=cuda but no CUDA device is available on this machine "
                         "(torch.cuda.is_available() is False); set training.device=cpu (or auto)")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"training.device must be auto, cpu or cuda; got {name!r}")
    return default_device() if name == "cuda" else torch.device("cpu")


def _check_training_and_cluster(train: TrainingConfig, cluster: ClusterConfig, device) -> None:
    if train.dtype not in DTYPES:
        raise ValueError(f"training.dtype must be {' or '.join(DTYPES)}; got {train.dtype!r}")
    if train.optimizer_step not in ("auto", "sync_free", "megatron"):
        raise ValueError(
            f"training.optimizer_step must be auto, sync_free or megatron; got {train.optimizer_step!r}")
    if train.sync_check not in SYNC_CHECK_MODES:
        raise ValueError(f"training.sync_check must be {', '.join(SYNC_CHECK_MODES[:-1])} or "
                         f"{SYNC_CHECK_MODES[-1]}; got {train.sync_check!r}")
    if train.steps is not None and train.epochs is not None:
        raise ValueError(
            f"training.steps={train.steps} and training.epochs={train.epochs} are both set: epochs "
            "sets the number of steps (the steps its passes over the packed data take), so the two "
            "can contradict; set one of them (training.steps=null with training.epochs)")
    check_stop_at_step(train, planned_steps(train.steps, train.epochs))
    if cluster.backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"cluster.backend must be auto, gloo or nccl; got {cluster.backend!r}")
    if cluster.backend == "nccl" and device.type != "cuda":
        raise ValueError("cluster.backend=nccl needs CUDA devices; use gloo (or auto) on CPU")
    launched = launched_world_size()
    if cluster.expected_world_size is not None and launched != cluster.expected_world_size:
        raise ValueError(
            f"cluster '{cluster.name}' expects {cluster.expected_world_size} processes but "
            f"the launcher started {launched}"
        )


def resolve_batch_keys(train: TrainingConfig) -> TrainingConfig:
    """``train`` with ``micro_batches`` DEFAULT_MICRO_BATCHES when none of :data:`BATCH_KEYS` is
    set (with ``batch_sequences`` / ``batch_tokens`` it stays None until the data is packed:
    :func:`set_from_data`); more than one set is refused."""
    given = [f"training.{k}={getattr(train, k)}" for k in BATCH_KEYS if getattr(train, k) is not None]
    if len(given) > 1:
        raise ValueError(
            f"{' and '.join(given)} are set together: each sets the batch a step trains (packed "
            "microbatches per rank, or sequences / tokens per step resolved into them from the "
            "packed data), so they can contradict; set one of training.micro_batches, "
            "training.batch_sequences, training.batch_tokens and leave the others null")
    return train if given else dataclasses.replace(train, micro_batches=DEFAULT_MICRO_BATCHES)


def planned_steps(steps: Optional[int], epochs: Optional[int]) -> Optional[int]:
    """``training.steps`` as known before the data is packed: the setting, DEFAULT_STEPS when
    neither it nor ``training.epochs`` is set, None with epochs (set from the packed data)."""
    return DEFAULT_STEPS if steps is None and epochs is None else steps


def check_stop_at_step(train: TrainingConfig, steps: Optional[int]) -> None:
    """``training.stop_at_step`` within the run's ``steps`` (None: not known before the data is
    packed; checked again once :func:`set_steps` knows them)."""
    if steps is not None and train.stop_at_step is not None and not 1 <= train.stop_at_step <= steps:
        raise ValueError(
            f"training.stop_at_step={train.stop_at_step} must be in [1, training.steps={steps}]"
        )


def set_steps(cfg: JobConfig, data) -> JobConfig:
    """``cfg`` with ``training.steps`` set -- the one place it is: the setting, else the steps
    ``training.epochs`` passes over the built data take (``data.StepData``), else DEFAULT_STEPS
    (``cfg`` itself when the setting is there)."""
    train = cfg.training
    if train.steps is not None:
        return cfg
    steps = planned_steps(train.steps, train.epochs) or data.epochs.steps(data.per_step)
    train = dataclasses.replace(train, steps=steps)
    check_stop_at_step(train, steps)
    return dataclasses.replace(cfg, training=train)


def set_from_data(cfg: JobConfig, data) -> JobConfig:
    """``cfg`` with what the built data (``data.StepData``) decides -- the one place it is set:
    ``training.micro_batches`` (the number ``training.batch_sequences`` / ``batch_tokens``
    resolves to on the packing: ``data.resolve_batch``), then ``training.steps``
    (:func:`set_steps`)."""
    if cfg.training.micro_batches != data.micro_batches:
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(
            cfg.training, micro_batches=data.micro_batches))
    return set_steps(cfg, data)


def _check_parallel(par: ParallelConfig, fast: FastpathConfig, is_moe: bool, device) -> None:
    """The layouts the main job refuses on its own settings (the others -- MoE with TP,
    sequence parallelism, offload with pipelining -- are rules: :mod:`megatron_fastpath.rules`)."""
    if device.type == "cpu" and par.pipeline_model_parallel_size > 1:
        raise ValueError(
            "pipeline parallelism needs Megatron's pipeline schedules, which allocate on CUDA in "
            "megatron-core 0.16.1; use parallel.pipeline_model_parallel_size=1 on CPU"
        )
    if not is_moe and par.expert_model_parallel_size > 1:
        raise ValueError("parallel.expert_model_parallel_size > 1 needs an MoE model (model.num_experts)")
    if fast.moe_capacity_factor is not None and not is_moe:
        raise ValueError("fastpath.moe_capacity_factor is set but the model has no experts")


def _run_facts(model: ModelConfig, data: Any, train: TrainingConfig, fast: FastpathConfig,
               par: ParallelConfig, features: dict, device, backend: str,
               linear_impl: str, gemma=None) -> rules.RunFacts:
    """Every fact of the job the rules read, gathered once (the GPU's capability is asked by
    the preflight, once the plan's environment is set: reading it initialises CUDA)."""
    graphs, fp8 = features["cuda_graphs"], features["fp8"]
    is_moe = model.num_experts is not None
    full = graphs is not None and graphs.scope == "full_iteration"
    cp, tp = par.context_parallel_size, par.tensor_model_parallel_size
    fp8_facts = {}
    if fp8 is not None:  # TE asserts its GEMM shapes at the first forward
        from megatron_fastpath.fp8.config import te_linear_gemms

        fp8_facts = dict(fp8_recipe=fp8.recipe, fp8_gemms=tuple(te_linear_gemms(model, tp)),
                         fp8_tokens=data.max_tokens // cp)
    return rules.RunFacts(
        names=rules.NAMES["main"],
        context_parallel_size=cp,
        graphs_requested=graphs is not None,
        graphs_captured=graphs is not None and device.type == "cuda",
        # per-layer capture warm-up passes (a full-iteration step has none: step 1 runs eagerly)
        graph_warmup_steps=graphs.warmup_steps if graphs is not None and not full else 0,
        lora=features["lora"] is not None,
        is_moe=is_moe,
        moe_dropless_ep=is_moe and par.expert_model_parallel_size > 1 and fast.moe_capacity_factor is None,
        dtype=getattr(torch, train.dtype),
        fp8_attention=fp8 is not None and fp8.dot_product_attention,
        attention_backend=str(backend),
        pipeline_parallel_size=par.pipeline_model_parallel_size,
        sequence_parallel=par.sequence_parallel,
        offload=features["offload"] is not None,
        full_iteration=full,
        head_dim=model.kv_channels or model.hidden_size // model.num_attention_heads,
        on_cpu=device.type == "cpu",
        tensor_parallel_size=tp,
        linear_impl=linear_impl,
        packed_tokens=data.max_tokens, pad_multiple=data.pad_multiple,
        megatron_optimizer_step=train.optimizer_step == "megatron",
        distributed_optimizer=par.distributed_optimizer,
        overlap_grad_reduce=par.overlap_grad_reduce,
        overlap_param_gather=par.overlap_param_gather,
        bucket_size=par.bucket_size,
        linear_cross_entropy=fast.linear_cross_entropy,
        logit_transforms=(f"Gemma's final-logit soft-capping ({gemma.final_logit_softcap})",)
        if getattr(gemma, "final_logit_softcap", None) else (),
        **fp8_facts,
    )


def _check_cuda_only(device, backend: str, linear_impl: str, fp8: bool) -> None:
    """Transformer Engine's modules and flash-attn's kernels run on CUDA only: with the packages
    installed, a CPU job reached its first forward ("TransformerEngine needs CUDA.", TE 2.10
    module/base.py) instead of stopping here."""
    if device.type == "cuda":
        return
    asked = [what for what, on in ((f"fastpath.attention_backend={backend}", backend in ("te", "flash")),
                                   ("fastpath.linear_impl=te", linear_impl == "te"),
                                   ("fastpath.fp8=true", fp8)) if on]
    if asked:
        raise ValueError(
            f"{' with '.join(asked)} on training.device={device.type}: Transformer Engine's "
            "modules (its attention, linears and FP8) and flash-attn's kernels run on CUDA only; "
            "on a CPU use fastpath.attention_backend=sdpa, fastpath.linear_impl=local and "
            "fastpath.fp8=false, or set training.device=cuda")


def _check_lora_dtype(lora, device, dtype: str) -> None:
    if lora is not None and device.type == "cuda" and dtype != "float32" and lora.dtype == "float32":
        raise ValueError(
            f"lora.dtype=float32 with training.dtype={dtype} on the GPU path: Megatron's "
            "mixed-precision optimizer checkpoints only 16-bit parameters (its sharded_state_dict "
            "maps its float16 groups), so the first checkpoint save would fail; leave lora.dtype "
            "unset (adapters in the training dtype, with fp32 main copies in the optimizer) or "
            "set training.dtype=float32")


def refuse(reasons: list) -> None:
    """Raise the first of the rules' ``reasons`` (the main job reports one line)."""
    if reasons:
        raise ValueError(reasons[0])


def _attention_backend(fast: FastpathConfig, par: ParallelConfig, device, max_tokens: int,
                       dtype: str) -> str:
    """``fastpath.attention_backend``'s choice (``attention.backend.choose_backend``; checked by
    ``check_backend`` once the rules have read it)."""
    from megatron_fastpath.attention.backend import choose_backend
    from megatron_fastpath.packed_seq.config import DEFAULT_SDPA_MASK_MAX_TOKENS, SDPA_LAYOUTS, sdpa_max_tokens

    if fast.sdpa_layout not in SDPA_LAYOUTS:
        raise ValueError(f"fastpath.sdpa_layout must be one of {', '.join(SDPA_LAYOUTS)}; got {fast.sdpa_layout!r}")
    # the mask's size limit binds only the [T, T] mask layout (sdpa_max_tokens: the padded view has none)
    sdpa_limit = sdpa_max_tokens(fast.sdpa_layout, DEFAULT_SDPA_MASK_MAX_TOKENS, par.context_parallel_size)
    return choose_backend(fast.attention_backend, device, max_tokens, sdpa_limit,
                          dtype=getattr(torch, dtype), context_parallel_size=par.context_parallel_size)


def parse_job_config(cfg: Any) -> JobConfig:
    """Validate the whole tree (groups model, data, training, fastpath, parallel, cluster and
    the feature groups) and resolve its ``auto`` choices -- a pure function: the rules are
    called once, with every fact known without a device; nothing is created, written or set
    (:func:`megatron_fastpath.train.preflight.preflight` runs next, before any device work)."""
    from megatron_fastpath.graphs.config import plan_graphs_and_fp8
    from megatron_fastpath.train.metrics import MetricsConfig

    _refuse_moved_keys(cfg)
    train = resolve_batch_keys(section(cfg, "training", TrainingConfig))
    fast = section(cfg, "fastpath", FastpathConfig)
    par = section(cfg, "parallel", ParallelConfig)
    cluster = section(cfg, "cluster", ClusterConfig)
    # the model and data groups name their providers; their parse checks on the host only
    model_key, model_group = pop_provider_key(_group_dict(cfg, "model"), "model")
    data_key, data_group = pop_provider_key(_group_dict(cfg, "data"), "data")
    model_prov = model_provider(model_key)
    source = model_prov.parse(model_group, par.tensor_model_parallel_size,
                              par.expert_model_parallel_size)
    model, data = source.config, data_provider(data_key).parse(data_group, source)
    features = _feature_sections(cfg, fast)
    export = section(cfg, "export", ExportConfig) if cfg is not None and "export" in cfg else None
    model_prov.check(source, lora=features["lora"], export=export, data=data,
                     pipeline_size=par.pipeline_model_parallel_size)
    if getattr(data, "evaluates", False) and par.pipeline_model_parallel_size > 1:
        raise ValueError("held-out evaluation runs the model outside Megatron's pipeline "
                         "schedule: with pipeline parallelism set data.eval_fraction=0 "
                         "(and no data.eval_path)")
    metrics = section(cfg, "metrics", MetricsConfig) if cfg is not None and "metrics" in cfg else None
    is_moe = model.num_experts is not None
    device = resolve_device(train.device)
    _check_training_and_cluster(train, cluster, device)
    graphs = features["cuda_graphs"]
    par = resolve_data_parallel(par, device.type == "cuda", launched_world_size(),
                                graphs is not None and graphs.scope == "full_iteration")
    backend = _attention_backend(fast, par, device, data.max_tokens, train.dtype)
    linear_impl = fast.linear_impl if fast.linear_impl != "auto" else (
        "te" if backend == "te" else "local")
    if fast.linear_cross_entropy not in (None, "chunked", "off"):
        raise ValueError(f"fastpath.linear_cross_entropy must be chunked, off or null; got {fast.linear_cross_entropy!r}")
    facts = _run_facts(model, data, train, fast, par, features, device, backend, linear_impl, source.gemma)
    refuse(rules.refusals(facts))  # the rules shared with the hooks, called once
    lce = rules.linear_cross_entropy_choice(fast.linear_cross_entropy, facts.logit_transforms, data.max_tokens
                                            // par.context_parallel_size, -(-model.vocab_size // par.tensor_model_parallel_size))
    _check_parallel(par, fast, is_moe, device)
    from megatron_fastpath.attention.backend import check_backend

    # resolved once: its package and the dtype (te/flash refuse fp32 on CUDA)
    backend = check_backend(backend, device, getattr(torch, train.dtype),
                            chosen_by_auto=fast.attention_backend == "auto")
    _check_cuda_only(device, backend, linear_impl, features["fp8"] is not None)
    lora = features["lora"]
    from megatron_fastpath.train.defaults import resolve_schedule_defaults

    train = resolve_schedule_defaults(train, model_key, lora is not None)
    _check_lora_dtype(lora, device, train.dtype)
    plan = plan_graphs_and_fp8(
        features["cuda_graphs"], features["fp8"], device,
        dropout=0.0,  # build_transformer_config sets hidden/attention dropout to 0
        lora_dropout=lora.dropout if lora else 0.0, lora=lora is not None,
        linear_impl=linear_impl,
        offload=features["offload"] is not None, attention_backend=backend,
    )
    job = JobConfig(model=model, data=data, training=train, fastpath=fast, parallel=par,
                    cluster=cluster, device=device, attention_backend=backend,
                    linear_impl=linear_impl, plan=plan, model_source=source,
                    data_provider=data_key, metrics=metrics,
                    checkpoint=_checkpoint_section(cfg, fast, data), export=export, facts=facts,
                    linear_cross_entropy=lce, **features)
    _refuse_export_overlap(export, {**model_prov.input_dirs(source), "checkpoint.dir": job.checkpoint.dir,
                                    "checkpoint.base_dir": job.checkpoint.base_dir})
    return job


# keys that moved to another group: (old, new)
_MOVED_KEYS = (("lora.export_dir", "export.adapter_dir"), ("lora.export_merged_dir", "export.merged_dir"))


def _refuse_moved_keys(cfg: Any) -> None:
    for old, new in _MOVED_KEYS:
        group, key = old.split(".")
        if cfg is not None and (cfg.get(group) or {}).get(key) is not None:
            raise ValueError(f"{old} moved to {new} (export settings are output only and do not "
                             f"enter the resume fingerprint): use {new}=<dir>")


def _refuse_export_overlap(export: Optional[ExportConfig], inputs: dict) -> None:
    """Each export directory outside every directory the job reads or saves into (``inputs``:
    {key: dir}; :func:`megatron_fastpath.paths.refuse_overlap`, which creates nothing: the
    preflight checks that the export can write there)."""
    from megatron_fastpath.paths import refuse_overlap

    if export is None:
        return
    for key, path in export.dirs().items():
        for other_key, other in inputs.items():
            refuse_overlap(key, path, other_key, other)


def _checkpoint_section(cfg: Any, fast: FastpathConfig, data: Any = None):
    from megatron_fastpath.checkpoint import CheckpointConfig

    ckpt = section(cfg, "checkpoint", CheckpointConfig)
    if ckpt.keep_best and not (ckpt.enabled and getattr(data, "evaluates", False)):
        raise ValueError(
            "checkpoint.keep_best keeps the checkpoint with the lowest held-out loss: it needs "
            "checkpoint.dir and held-out evaluation (data=jsonl with data.eval_fraction > 0 or "
            "data.eval_path)")
    if ckpt.adapters_only and not fast.lora:
        raise ValueError("checkpoint.adapters_only=true needs LoRA (fastpath.lora=true)")
    if ckpt.base_dir is not None and not os.path.isdir(ckpt.base_dir):
        raise ValueError(f"checkpoint.base_dir={ckpt.base_dir!r} is not a directory")
    return ckpt  # checkpoint.dir is created and probed by the preflight
