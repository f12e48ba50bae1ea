"""One flag for per-layer CUDA graphs (and FP8): the TransformerConfig fields, environment and
the combinations that cannot work, refused before any step runs. FP8's own settings, fields and
refusals are :mod:`megatron_fastpath.fp8` (:func:`~megatron_fastpath.fp8.plan_fp8`, which
:func:`plan_graphs_and_fp8` calls).

Passing a ``CudaGraphConfig`` (``None`` = off) gives what the MLPerf Llama-2-70B LoRA submissions run
(Megatron-Core 0.16.1 ``cuda_graph_impl="local"``, i.e. the deprecated ``enable_cuda_graph=True``):
a ``CudaGraphManager`` per ``TransformerLayer`` capturing the whole layer, Transformer Engine's
RNG tracker (dropout inside graphs), and the environment graph runs need. In megatron-core
0.16.1 the first ``forward_backward`` runs eagerly and records each layer's calls; capture
happens at its end (``create_cudagraphs()``), and every later step replays.
On a CPU there is nothing to capture: the graph-safety audit runs in its place.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Optional

import torch

from megatron_fastpath.compat import TORCH_RELEASE
from megatron_fastpath.fp8.config import plan_fp8
from megatron_fastpath.settings import setting

if TYPE_CHECKING:
    from megatron_fastpath.fp8 import FP8Config

__all__ = ["CudaGraphConfig", "GRAPH_SCOPES", "GraphPlan", "default_warmup_steps", "plan_graphs_and_fp8"]

# What one capture covers: "layers" = a CudaGraphManager per TransformerLayer (MLPerf's setup);
# "full_iteration" = the forward+backward of every microbatch of a step in one graph (Megatron's
# FullCudaGraphWrapper) and the optimizer step in a second (train/full_iteration.py).
GRAPH_SCOPES = ("layers", "full_iteration")


@dataclasses.dataclass(frozen=True)
class CudaGraphConfig:
    """Settings of per-layer capture (cuda_graph_impl="local"); whether graphs are on is the
    caller's choice (``plan_graphs_and_fp8(graphs=None)`` = off; the main job's switch is
    ``fastpath.cuda_graphs``).

    ``warmup_steps`` is Megatron's ``cuda_graph_warmup_steps``. In megatron-core 0.16.1 this is
    NOT a number of eager training steps: capture always happens at the end of the first
    ``forward_backward``; it is the number of warm-up forward (and backward) passes that
    ``_CudaGraphRunner.create_fwd_graph`` runs on zero-filled copies of a layer's inputs right
    before capturing it (the first step runs each layer 1 + warmup_steps times). None:
    :func:`default_warmup_steps` -- 3, or 0 for a LoRA model, whose first layer's inputs do not
    require grad, so the warm-up's ``autograd.grad`` over the layer inputs has none
    (megatron-core 0.16.1 ``transformer/cuda_graphs.py:920-930``)."""

    warmup_steps: Optional[int] = setting(
        None, "capture warm-up passes per layer (Megatron's cuda_graph_warmup_steps); null: 3, or "
        "0 with LoRA")
    use_te_rng_tracker: bool = setting(True, "Transformer Engine's graph-safe RNG tracker (needed for dropout)")
    audit_steps: int = setting(3, "steps the CPU graph-safety audit (run in place of capture) checks")
    strict_audit: bool = setting(True, "raise at the CPU audit's first violation (false: report them)")
    scope: str = setting(
        "layers", f"what a capture covers: {' | '.join(GRAPH_SCOPES)} (the whole step as two "
        "graphs, captured at step 2; needs training.device=cuda)")

    def __post_init__(self):
        if self.scope not in GRAPH_SCOPES:
            raise ValueError(
                f"cuda_graphs.scope must be one of {', '.join(GRAPH_SCOPES)}; got {self.scope!r}")
        if self.warmup_steps is not None and (
                not isinstance(self.warmup_steps, int) or self.warmup_steps < 0):
            raise ValueError(
                "cuda_graphs.warmup_steps must be an int >= 0 (zero-input warm-up passes per "
                f"layer before its capture) or null (3, or 0 with LoRA); got {self.warmup_steps!r}"
            )

    def resolved(self, lora: bool) -> "CudaGraphConfig":
        """This config with ``warmup_steps`` decided (:func:`default_warmup_steps` when None)."""
        if self.warmup_steps is not None:
            return self
        return dataclasses.replace(self, warmup_steps=default_warmup_steps(lora))


def default_warmup_steps(lora: bool) -> int:
    """Megatron's capture warm-up passes per layer when the config leaves them unset: 3, as
    Megatron-Bridge's recipes; 0 for a LoRA model. megatron-core 0.16.1-0.19 run the warm-up's
    backward as ``torch.autograd.grad`` over the layer's input tensors that require grad only
    (``_CudaGraphRunner.create_fwd_graph``, 0.16.1 ``transformer/cuda_graphs.py:920-930``, 0.19.0
    ``:1272-1282``); with LoRA the embedding is frozen, the first layer's hidden states do not
    require grad and the call gets no inputs (the refusal is ``rules._lora_graph_warmup``). The
    framework hooks write 0 for PEFT models for the same reason (``integrations/core.py``)."""
    return 0 if lora else 3


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """What :func:`plan_graphs_and_fp8` decided.

    transformer_config: TransformerConfig keyword overrides.
    env: environment variables to set before torch.distributed / CUDA initialise.
    capture: layers are captured (CUDA); False on CPU, where ``audit`` replaces capture.
    audit: run the graph-safety audit.
    notes: human-readable decisions, printed by the main job.
    full_iteration: the step is captured whole (``cuda_graphs.scope=full_iteration``; with
        ``capture``), not layer by layer.
    """

    transformer_config: dict
    env: dict
    capture: bool
    audit: bool
    notes: tuple
    full_iteration: bool = False


def plan_graphs_and_fp8(
    graphs: Optional[CudaGraphConfig],
    fp8: Optional[FP8Config],
    device: torch.device,
    *,
    dropout: float = 0.0,
    lora_dropout: float = 0.0,
    lora: bool = False,
    megatron_cpu_offloading: bool = False,
    linear_impl: str = "local",
    offload: bool = False,
    attention_backend: str = "auto",
) -> GraphPlan:
    """Validate the combination and return the TransformerConfig fields and env to use.
    ``graphs`` / ``fp8`` None: that feature is off.

    ``lora``: the model trains LoRA adapters (decides ``graphs.warmup_steps`` when it is None).

    Raises ValueError / MissingDependencyError for combinations that cannot work, naming what
    to use instead -- before any model is built or step runs. The rules a run shares with the
    framework hooks (FP8 attention on packed sequences, dropless EP and LoRA warm-up under
    graphs, ...) are :mod:`megatron_fastpath.rules`', checked by the caller first.
    """
    tc: dict = {}
    env: dict = {}
    notes: list = []
    cuda = device.type == "cuda"
    if fp8 is not None:
        fp8_fields, fp8_note = plan_fp8(fp8, linear_impl)
        tc.update(fp8_fields)
        notes.append(fp8_note)
    full = graphs is not None and graphs.scope == "full_iteration"
    if graphs is not None:
        graphs = graphs.resolved(lora=lora)
        _check_graphs(graphs, dropout, lora_dropout, megatron_cpu_offloading)
        if full and not cuda:
            raise ValueError(
                "cuda_graphs.scope=full_iteration captures the whole step on a GPU: it needs "
                "training.device=cuda (on a CPU there is nothing to capture; "
                "cuda_graphs.scope=layers runs the graph-safety audit of the layers instead)")
        if cuda:
            _check_capture(graphs, offload, attention_backend)
            (_plan_full_iteration if full else _plan_capture)(graphs, tc, env, notes)
        else:
            notes.append(
                "CUDA graphs requested on CPU: nothing to capture; the graph-safety audit runs "
                f"over {graphs.audit_steps} steps in its place"
            )
    return GraphPlan(
        transformer_config=tc,
        env=env,
        capture=graphs is not None and cuda,
        audit=graphs is not None and not cuda,
        notes=tuple(notes),
        full_iteration=full and cuda,
    )


def _check_graphs(graphs: CudaGraphConfig, dropout: float, lora_dropout: float,
                  megatron_cpu_offloading: bool) -> None:
    if megatron_cpu_offloading:
        raise ValueError(
            "Megatron-Core 0.16.1 refuses cpu_offloading with CUDA graphs, and activation "
            "offload cannot run inside captured layer graphs either: keep offload off with "
            "fastpath.cuda_graphs=true"
        )
    needs_rng = dropout > 0 or lora_dropout > 0
    if needs_rng and not graphs.use_te_rng_tracker:
        raise ValueError(
            f"CUDA graphs with dropout (hidden/attention {dropout}, LoRA {lora_dropout}) need a "
            "graph-safe RNG tracker: set cuda_graphs.use_te_rng_tracker=true (Transformer "
            "Engine) or set the dropouts to 0"
        )


def _check_capture(graphs: CudaGraphConfig, offload: bool, attention_backend: str) -> None:
    """Combinations that only fail at capture on a GPU (a CPU has nothing to capture)."""
    if attention_backend == "te" and not graphs.use_te_rng_tracker and graphs.scope == "layers":
        # TE's DotProductAttention.forward asserts, while TE's own capture flag is set
        # (transformer_engine.pytorch.graph.is_graph_capturing()), that its RNG tracker is TE's
        # CudaRNGStatesTracker ("Unsupported RNG states tracker.", TE 2.10
        # attention/dot_product_attention/dot_product_attention.py:1010-1013); Megatron hands it
        # its own tracker unless use_te_rng_tracker is set. Megatron sets that flag around a
        # per-layer capture only (megatron-core 0.16.1 transformer/cuda_graphs.py:396-398, 0.19.0
        # :587-589, te_set_capture_start for layers with TE modules); FullCudaGraphWrapper
        # (0.16.1 full_cuda_graph.py:160-182) captures the step without it, so TE never asserts
        # there and full-iteration graphs run with Megatron's graph-safe tracker.
        raise ValueError(
            "the te attention backend with CUDA graphs needs cuda_graphs.use_te_rng_tracker=true: "
            "Transformer Engine's attention asserts during capture that the RNG tracker is its "
            "own; set it, or use another attention backend")
    if attention_backend == "flex" and graphs.scope == "full_iteration":
        # the cache builds flex's BlockMask with create_block_mask, whose block counting ends in
        # data-dependent ops; a full-iteration graph builds the derived tensors inside itself
        raise ValueError(
            "the flex attention backend with cuda_graphs.scope=full_iteration: its BlockMask is "
            "built with torch's create_block_mask (data-dependent ops), which cannot run inside "
            "the captured step; use the sdpa, flash or te backend, or cuda_graphs.scope=layers")
    if offload:
        raise ValueError(
            "activation offload cannot run inside captured layer graphs (its copy streams and "
            "per-step buffer choice are host decisions a replay would freeze); use "
            "fastpath.offload=false with fastpath.cuda_graphs=true, or turn graphs off"
        )


def _plan_capture(graphs: CudaGraphConfig, tc: dict, env: dict, notes: list) -> None:
    from megatron_fastpath._optional import require

    if graphs.use_te_rng_tracker:
        require("transformer_engine.pytorch", "cuda_graphs.use_te_rng_tracker",
                "cuda_graphs.use_te_rng_tracker=false with all dropouts 0")
    tc.update(
        cuda_graph_impl="local",
        cuda_graph_warmup_steps=graphs.warmup_steps,
        use_te_rng_tracker=graphs.use_te_rng_tracker,
        cuda_graph_scope=[],
    )
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    env["NCCL_GRAPH_REGISTER"] = "0"  # with expandable segments, graphs + NCCL UB clash
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if TORCH_RELEASE < (2, 8):
        env["TORCH_NCCL_AVOID_RECORD_STREAMS"] = "1"
    notes.append(
        f"per-layer CUDA graphs: cuda_graph_impl=local, captured at the end of step 1 after "
        f"{graphs.warmup_steps} zero-input warm-up passes per layer, TE RNG "
        f"tracker={graphs.use_te_rng_tracker}"
    )


def _plan_full_iteration(graphs: CudaGraphConfig, tc: dict, env: dict, notes: list) -> None:
    """No per-layer graphs (a layer capture cannot nest in the step's); the graph-safe RNG
    tracker and the allocator settings as for layers."""
    from megatron_fastpath._optional import require

    if graphs.use_te_rng_tracker:
        require("transformer_engine.pytorch", "cuda_graphs.use_te_rng_tracker",
                "cuda_graphs.use_te_rng_tracker=false with all dropouts 0")
    tc.update(use_te_rng_tracker=graphs.use_te_rng_tracker)
    env["NCCL_GRAPH_REGISTER"] = "0"
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    notes.append(
        "full-iteration CUDA graphs: step 1 eager, step 2 captures the forward+backward of every "
        "microbatch (Megatron's FullCudaGraphWrapper) and the optimizer step + LR schedule as a "
        f"second graph; later steps replay both (TE RNG tracker={graphs.use_te_rng_tracker})")


def apply_env(env: dict) -> dict:
    """Set ``env`` where the user has not set the variable; return what was set."""
    applied = {}
    for k, v in env.items():
        if k not in os.environ:
            os.environ[k] = v
            applied[k] = v
    return applied
