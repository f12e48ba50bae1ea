"""Model and data providers: what the main job trains, and on what.

A *model provider* turns the ``model`` config group into a :class:`ModelSource` (architecture,
RoPE, the provider's parsed state; host checks only, before any device work), adds its
TransformerConfig fields, loads its weights into the model the job built with the one
:func:`megatron_fastpath.model.build_fastpath_gpt`, and exports at the end. A *data provider*
turns the ``data`` group into its config and builds the train bins, held-out bins and report.

Each group names its provider with the key ``provider`` (the group's YAML sets it; a group
without one is the synthetic provider). The synthetic model and data are one pair (here);
the Hugging Face checkpoint and JSONL data another, registered by :mod:`megatron_fastpath.hf`
(each provider's module is imported by name when first asked for, so the job never imports
``hf`` itself)::

    providers.model_provider("hf").parse(group, parallel)      # -> ModelSource
    providers.data_provider("jsonl").build(job_cfg, dp_rank, dp_world)

Registering a provider: subclass :class:`ModelProvider` / :class:`DataProvider`, set ``key``
and call :func:`register_model_provider` / :func:`register_data_provider` at import.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from megatron_fastpath.settings import setting

if TYPE_CHECKING:
    from megatron_fastpath.data import StepData

__all__ = [
    "DataParts", "DataProvider", "EvalPrompts", "ExportConfig", "ModelProvider", "ModelSource", "PackedDataSettings",
    "data_provider",
    "model_provider", "pop_provider_key", "provider_key_help", "register_data_provider", "register_model_provider",
]


class PackedDataSettings(Protocol):
    """What the job reads from any data provider's config: the packed microbatch capacities
    (the cache's static ``max_tokens`` / ``max_seqs``) and the data seed."""

    max_tokens: int
    max_seqs: int
    seed: int


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What a model provider parsed from the ``model`` group.

    provider: the registry key. config: the architecture (``model.ModelConfig``) the job
    reads. rope: the cache's ``RopeConfig``. tie_embeddings: output layer shares the
    embedding. tokenizer_path: the tokenizer a data provider uses by default (None: none).
    handle: the provider's own parsed state, handed back to it (HF: ``HFJobConfig``).
    sliding_window / window_layers: the attention window of the layers (0-based) it applies
    to, None / (): none (a Hugging Face checkpoint's sliding window). rope_local: the cache's
    second ``RopeConfig`` (Gemma 3's sliding layers), None: none. gemma: the layer / model
    options of a Gemma checkpoint (``gemma.GemmaOptions``), None for every other model."""

    provider: str
    config: Any
    rope: Any
    tie_embeddings: bool = False
    tokenizer_path: Optional[str] = None
    handle: Any = None
    sliding_window: Optional[int] = None
    window_layers: tuple = ()
    rope_local: Any = None
    gemma: Any = None


@dataclasses.dataclass(frozen=True)
class DataParts:
    """What a data provider builds for one data-parallel rank: the train bins per step
    (``data.StepData``), this rank's held-out bins, whether the job evaluates (the same on
    every rank: a rank may hold no held-out bin and still joins the evaluation's reduction),
    and a report (printed / written to the summary; None: nothing to report)."""

    train: StepData
    eval_bins: tuple = ()
    report: Optional[dict] = None
    evaluate: bool = False
    eval_prompts: Optional["EvalPrompts"] = None  # held-out prompts to complete at each evaluation

    @property
    def longest_sequence(self) -> int:
        """The longest sequence of any bin, train or held-out (host lengths): the bound the
        packed cache is sized by (its ``max_seqlen``)."""
        def longest(bins):  # packed bins know it from the lengths, without packing a microbatch
            if hasattr(bins, "longest"):
                return bins.longest
            return max((int(mb.lengths.max()) for mb in bins), default=0)

        return max(longest(self.train.bins), longest(self.eval_bins))


@dataclasses.dataclass(frozen=True)
class EvalPrompts:
    """Held-out prompts the evaluator completes greedily at each evaluation (``data.eval_samples``).

    prompts: (prompt token ids, reference reply token ids) per sample, the same on every rank.
    stop_ids: tokens a completion stops at (EOS / end of turn; included in the completion).
    max_new_tokens: the most tokens a completion runs to. decode: token ids -> text (special
    tokens kept); decode_reply: token ids -> text without special tokens."""

    prompts: tuple
    stop_ids: frozenset
    max_new_tokens: int
    decode: Callable[[list], str]
    decode_reply: Callable[[list], str]


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """The ``export`` group: what a run writes at the end (output only, so not part of the
    resume fingerprint), by its model provider. ``synthetic_data`` is a test of the export
    itself; without it an export after the synthetic data is refused, since the exported model
    would not be fine-tuned on anything."""

    adapter_dir: Optional[str] = setting(None, "write the PEFT adapter (adapter_config.json + "
                                         "adapter_model.safetensors) here; needs fastpath.lora")
    merged_dir: Optional[str] = setting(
        None, "write the weights as a Hugging Face checkpoint here (LoRA merged in; a full "
        "fine-tune as trained)")
    synthetic_data: bool = setting(
        False, "export a model trained on the synthetic token data (a test of the export only)")

    @property
    def enabled(self) -> bool:
        return bool(self.adapter_dir or self.merged_dir)

    def dirs(self) -> dict:
        """{config key: directory} of the exports asked for."""
        return {f"export.{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name.endswith("_dir") and getattr(self, f.name)}


class ModelProvider:
    """Base: a random-initialised model (nothing loaded, nothing exported)."""

    key: str = ""

    def settings(self) -> type:  # pragma: no cover - abstract
        """The dataclass of the keys this provider reads from the ``model`` group (each field's
        default and ``help``: ``settings.setting``), less ``provider``."""
        raise NotImplementedError

    def parse(self, group: dict, tp: int, ep: int) -> ModelSource:  # pragma: no cover - abstract
        raise NotImplementedError

    def transformer_overrides(self, source: ModelSource, device) -> dict:
        """TransformerConfig fields beyond the Llama defaults of ``build_transformer_config``."""
        return {}

    def check(self, source: ModelSource, *, lora, export, data, pipeline_size: int) -> None:
        """Refusals that need the whole job's settings (raised at parse)."""
        if export is not None and export.enabled:
            raise ValueError(
                "export.adapter_dir / export.merged_dir write Hugging Face files and need "
                f"model=hf model.path=<checkpoint> (this model comes from provider {self.key!r})")

    def input_dirs(self, source: ModelSource) -> dict:
        """{config key: directory} the model is read from (no export may write into them)."""
        return {}

    def load_weights(self, model, source: ModelSource, log=print) -> None:
        """Fill the built model's weights (this rank's shard); the default keeps the init."""

    def export(self, job, log=print) -> dict:
        """Write the run's artefacts at the end; returns {kind: path}."""
        return {}


class DataProvider:
    key: str = ""

    def settings(self) -> type:  # pragma: no cover - abstract
        """The dataclass of the keys this provider reads from the ``data`` group, less ``provider``."""
        raise NotImplementedError

    def parse(self, group: dict, model: ModelSource) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def build(self, cfg, dp_rank: int, dp_world: int) -> DataParts:  # pragma: no cover - abstract
        raise NotImplementedError


# key -> module that registers it when imported (providers outside this folder)
_MODULES = {"model": {"synthetic": "megatron_fastpath.providers.synthetic",
                      "hf": "megatron_fastpath.hf.provider"},
            "data": {"synthetic": "megatron_fastpath.providers.synthetic",
                     "jsonl": "megatron_fastpath.hf.provider"}}
_REGISTRY: dict[str, dict[str, Any]] = {"model": {}, "data": {}}


def register_model_provider(provider: ModelProvider) -> ModelProvider:
    _REGISTRY["model"][provider.key] = provider
    return provider


def register_data_provider(provider: DataProvider) -> DataProvider:
    _REGISTRY["data"][provider.key] = provider
    return provider


def _lookup(kind: str, key: str):
    if key not in _REGISTRY[kind] and key in _MODULES[kind]:
        importlib.import_module(_MODULES[kind][key])
    if key not in _REGISTRY[kind]:
        known = sorted(set(_REGISTRY[kind]) | set(_MODULES[kind]))
        raise ValueError(f"{kind}.provider={key!r} is not a registered {kind} provider; known: {known}")
    return _REGISTRY[kind][key]


def model_provider(key: str) -> ModelProvider:
    return _lookup("model", key)


def data_provider(key: str) -> DataProvider:
    return _lookup("data", key)


def provider_key_help(kind: str) -> str:
    """The description of the ``provider`` key of the ``model`` / ``data`` group (``kind``)."""
    known = sorted(set(_REGISTRY[kind]) | set(_MODULES[kind]))
    return f"the {kind} provider that reads this group: {' | '.join(known)} (unset: synthetic)"


def pop_provider_key(group: dict, name: str) -> tuple[str, dict]:
    """(provider key, the group without it): ``synthetic`` when the group names none."""
    group = dict(group)
    key = group.pop("provider", None) or "synthetic"
    if not isinstance(key, str):
        raise ValueError(f"{name}.provider must be a provider name (a string); got {key!r}")
    return key, group

