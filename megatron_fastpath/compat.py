"""The one place that knows which Megatron-Core version is installed.

Tested against megatron-core 0.16.1 (the newest release for Python 3.11). Every import of a
Megatron-Core symbol whose location or behaviour differs between releases goes through here.
"""

from __future__ import annotations

import importlib.metadata
from typing import Optional

from packaging.version import Version

MIN_MCORE = Version("0.16.1")


def mcore_version() -> Version:
    try:
        return Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError as exc:  # pragma: no cover - install error
        raise ImportError(
            "megatron_fastpath needs megatron-core>=0.16.1 (`pip install megatron-core`)"
        ) from exc


MCORE_VERSION = mcore_version()
if MCORE_VERSION < MIN_MCORE:  # pragma: no cover - guarded by install_requires
    raise ImportError(f"megatron-core {MCORE_VERSION} is too old; need >= {MIN_MCORE}")


def cudagraph_arg_tools():
    """``(reference(args, kwargs), mismatch_errors(ref, args, kwargs))`` from Megatron's own
    CudaGraphManager code, so the graph-safety audit applies exactly Megatron's matching rules:
    ``reference`` records the ``ArgMetadata`` of a call's arguments, ``mismatch_errors`` lists
    how a later call's arguments differ from such a reference (empty: the graph may replay).

    0.16.x keeps them on the private ``_CudaGraphRunner`` (an instance method reading
    ``fwd_graph_input_arg_metas``/``fwd_graph_input_kwarg_metas``); we call it unbound on a
    namespace holding those two attributes instead of building a runner (which needs CUDA).
    """
    import types

    from megatron.core.transformer.cuda_graphs import ArgMetadata, _CudaGraphRunner

    if not hasattr(_CudaGraphRunner, "get_mismatch_errors"):  # pragma: no cover - other versions
        raise ImportError(
            f"megatron-core {MCORE_VERSION} has no _CudaGraphRunner.get_mismatch_errors; the "
            "graph-safety audit's argument check supports the 0.16 line"
        )

    def reference(args, kwargs):
        return types.SimpleNamespace(
            fwd_graph_input_arg_metas=[ArgMetadata(a) for a in args],
            fwd_graph_input_kwarg_metas={k: ArgMetadata(v) for k, v in kwargs.items()},
        )

    def mismatch_errors(ref, args, kwargs):
        return _CudaGraphRunner.get_mismatch_errors(ref, args, kwargs)

    return reference, mismatch_errors


# =============================================================================================
# The one version gate. Every shim below touches megatron-core internals that were read in the
# 0.16.x sources; each calls ``_require_checked_mcore`` (directly, or with its own exception
# type), so widening support to a new line means re-reading what each shim says and adding the
# line here -- in one place.
# =============================================================================================
CHECKED_MCORE_LINES = ((0, 16),)  # (major, minor) release lines every shim was checked against


def _require_checked_mcore(shim: str, reason: str, exc: type = ImportError,
                           version: Optional["Version"] = None) -> None:
    """Raise ``exc`` on a megatron-core outside :data:`CHECKED_MCORE_LINES`, saying what the
    shim relies on (``reason``) and so what to re-read before widening the gate."""
    version = version or MCORE_VERSION
    if (version.major, version.minor) not in CHECKED_MCORE_LINES:
        lines = ", ".join("%d.%d.x" % v for v in CHECKED_MCORE_LINES)
        raise exc(
            f"megatron_fastpath.compat.{shim} was checked against megatron-core {lines} only and "
            f"megatron-core {version} is installed: {reason}. Check that against "
            "the installed release and widen CHECKED_MCORE_LINES in megatron_fastpath/compat.py"
        )


# =============================================================================================
# Tensor-parallel gradient bookkeeping (hf/model.py, train/step.py).
#
# megatron-core 0.16.x marks a TP-sharded weight (``tensor_model_parallel``, ``partition_dim``,
# ``partition_stride``) only inside ``_initialize_affine_weight_cpu/gpu``
# (tensor_parallel/layers.py), which run only when ``config.perform_initialization``. A model
# built to be overwritten by a checkpoint (perform_initialization=False) has no marks, and the
# gradient norm (``param_is_not_tensor_parallel_duplicate``) then counts every sharded weight on
# TP rank 0 only: clipping at TP > 1 used a norm that missed the other ranks' shards.
# ``_allreduce_non_tensor_model_parallel_grads`` (distributed/finalize_model_grads.py) is
# Megatron's rule for TP-replicated weights whose gradient each rank computes in part (qk
# layernorm, sequence-parallel weights); finalize_model_grads calls it on the GPU path, the CPU
# path calls it here (it reads ``model_chunk.ddp_config`` and ``main_grad`` or ``grad``).
# =============================================================================================
_TP_MARKS_REASON = ("Megatron's local TP layers set their weights' tensor_model_parallel marks "
                    "only when perform_initialization (tensor_parallel/layers.py)")
_TP_REDUCE_REASON = ("distributed/finalize_model_grads.py _allreduce_non_tensor_model_parallel_grads"
                     "(model_chunks, config, tp_group) reads model_chunk.ddp_config")


def mark_tensor_parallel_weights(model) -> int:
    """Give the weights of Megatron's local TP layers (vocab embedding and column linears:
    dim 0, row linears: dim 1) the marks Megatron sets when it initialises them, where they are
    missing; returns how many were marked."""
    _require_checked_mcore("mark_tensor_parallel_weights", _TP_MARKS_REASON)
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    dims = ((VocabParallelEmbedding, 0), (ColumnParallelLinear, 0), (RowParallelLinear, 1))
    marked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        dim = next((d for cls, d in dims if isinstance(module, cls)), None)
        if dim is not None and weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)
            marked += 1
    return marked


class _GradChunk:
    """A model as the model chunk Megatron's reduction reads (``ddp_config`` + ``.module``)."""

    def __init__(self, module):
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module = module
        self.ddp_config = DistributedDataParallelConfig()


def allreduce_tp_partial_grads(model, config) -> None:
    """Megatron's own reduction of the gradients of TP-replicated weights that each TP rank
    computes only in part (qk layernorm with ``config.qk_layernorm``, weights marked
    ``sequence_parallel`` with ``config.sequence_parallel``), on a model without DDP."""
    _require_checked_mcore("allreduce_tp_partial_grads", _TP_REDUCE_REASON)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    _allreduce_non_tensor_model_parallel_grads(
        [_GradChunk(model)], config, ps.get_tensor_model_parallel_group())


# =============================================================================================
# Activation offload shims (megatron_fastpath/offload/layer.py).
# =============================================================================================


def all_rng_state_tools():
    """(get_all(), set_all(*states)) over every RNG a recomputed layer must replay on CUDA: the
    CPU and CUDA default generators and Megatron's CUDA RNG tracker states.

    0.16.x keeps them private (``megatron.core.tensor_parallel.random._get_all_rng_states`` /
    ``_set_all_rng_states``, what Megatron's own ``CheckpointFunction`` uses); set_all takes
    the tuple get_all returned, unpacked."""
    _require_checked_mcore(
        "all_rng_state_tools",
        "tensor_parallel.random._get_all_rng_states / _set_all_rng_states are private and their "
        "return tuple is unpacked into _set_all_rng_states",
    )
    from megatron.core.tensor_parallel import random as mcore_random

    get_all = getattr(mcore_random, "_get_all_rng_states", None)
    set_all = getattr(mcore_random, "_set_all_rng_states", None)
    if get_all is None or set_all is None:  # pragma: no cover - other versions
        raise ImportError(f"megatron-core {MCORE_VERSION} has no _get_all_rng_states / "
                          "_set_all_rng_states in tensor_parallel.random")
    return get_all, set_all


def transformer_layer_forward_params() -> tuple:
    """``inspect.Parameter`` s of ``TransformerLayer.forward``'s arguments (without ``self``).

    0.16.x declares ``forward(self, *args, **kwargs)`` and forwards everything to the private
    ``_forward_attention``, whose signature is the real one (hidden_states, attention_mask,
    context, ..., packed_seq_params, sequence_len_offset, ...). The offload layer binds
    positional arguments by these names."""
    _require_checked_mcore(
        "transformer_layer_forward_params",
        "TransformerLayer.forward(*args, **kwargs) forwards to the private _forward_attention, "
        "whose signature is read as the layer's",
    )
    import inspect

    from megatron.core.transformer.transformer_layer import TransformerLayer

    params = [p for p in inspect.signature(TransformerLayer._forward_attention).parameters.values()
              if p.name != "self"]
    if not params or params[0].name != "hidden_states":  # pragma: no cover - other versions
        raise ImportError(f"megatron-core {MCORE_VERSION}: TransformerLayer._forward_attention "
                          "does not start with hidden_states")
    return tuple(params)


# ---------------------------------------------------------------------------------------------
# MoE: MoELayer / TopKRouter state without their CUDA-only constructors
#
# megatron-core 0.16.x's ``TopKRouter.__init__`` allocates its expert-bias / global-aux buffers
# on ``torch.cuda.current_device()`` (transformer/moe/router.py, TopKRouter.__init__), and
# ``MoELayer.__init__`` always builds one of Megatron's token dispatchers from
# ``moe_token_dispatcher_type``; the "alltoall" one makes a ``torch.cuda.Stream`` (and would be
# thrown away). Neither runs on a CPU. The fastpath router / layer therefore run the CUDA-free
# base constructors (``Router.__init__``, ``BaseMoELayer.__init__``) and set, by hand, the other
# attributes the 0.16.x constructors set, which Megatron's inherited methods read. The two
# functions below are that hand copy; ``tests/moe/test_moe_compat.py`` builds Megatron's real
# TopKRouter / MoELayer (CUDA-as-CPU test mode) and checks the attribute sets are equal, and
# each function refuses a megatron-core outside 0.16.x (the offload section's gate).
# ---------------------------------------------------------------------------------------------

MOE_INIT_SITES = (
    "transformer/moe/router.py: TopKRouter.__init__",
    "transformer/moe/moe_layer.py: MoELayer.__init__",
)


def init_topk_router_state(router, config, pg_collection, topk: int, score_function: str) -> None:
    """``TopKRouter.__init__`` (0.16.x) with its buffers on the gate weight's device.

    Runs ``Router.__init__`` (gate weight, Megatron's init, process groups) and sets the
    attributes ``TopKRouter.__init__`` sets. Refuses what it does not copy: the global aux loss
    (its step-count buffers) and router replay."""
    import torch

    from megatron.core.transformer.moe.router import Router

    _require_checked_mcore(
        "init_topk_router_state",
        f"it sets by hand the attributes of {MOE_INIT_SITES[0]}",
    )
    Router.__init__(router, config=config, pg_collection=pg_collection)
    router.topk = topk
    router.routing_type = config.moe_router_load_balancing_type
    if router.get_aux_loss_coeff("global_aux_loss") > 0:
        raise ValueError("the fastpath router does not support 'global_aux_loss'; use 'aux_loss'")
    router.score_function = score_function
    router.input_jitter = None
    router.router_replay = None
    router.global_tokens_per_expert = None
    router.ga_steps = None
    router.enable_expert_bias = config.moe_router_enable_expert_bias
    if router.enable_expert_bias:
        zeros = lambda: torch.zeros(  # noqa: E731
            router.num_experts, dtype=torch.float32, device=router.weight.device
        )
        router.register_buffer("local_tokens_per_expert", zeros(), persistent=False)
        router.register_buffer("expert_bias", zeros())
    else:
        router.local_tokens_per_expert = None
        router.expert_bias = None


def init_moe_layer_state(layer, config, submodules, layer_number, pg_collection) -> None:
    """``MoELayer.__init__`` (0.16.x) up to, not including, router / dispatcher / experts /
    shared experts, which the caller builds; plus the CUDA-graph resume state it sets last."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer
    from megatron.core.transformer.moe.moe_utils import MoECudaGraphTensorStore

    _require_checked_mcore(
        "init_moe_layer_state",
        f"it sets by hand the attributes of {MOE_INIT_SITES[1]}",
    )
    BaseMoELayer.__init__(
        layer, config=config, layer_number=layer_number, pg_collection=pg_collection
    )
    layer.submodules = submodules
    layer.moe_layer_recompute = (
        config.recompute_granularity == "selective"
        and "moe" in config.recompute_modules
        and config.cuda_graph_impl != "local"
    )
    layer.shared_experts_recompute = (
        config.recompute_granularity == "selective"
        and "shared_experts" in config.recompute_modules
    )
    layer.tp_group = pg_collection.tp
    layer.cudagraph_tensor_store = MoECudaGraphTensorStore()
    layer.fwd_execution_map = ["route", "expert_compute", "postprocess"]


# =============================================================================================
# CUDA graphs: keep forward-graph input buffers out of Megatron's TensorReusePool (0.16.x)
# =============================================================================================
#
# Why: megatron-core 0.16.x ``_CudaGraphRunner.create_fwd_graph`` ends with
#
#     # if an input buffer requires a copy, and does not have metadata attached to it at this
#     # point, it will not be reused after this forward pass, so return it to the pool
#     ... _CudagraphGlobalRecord.tensor_reuse_pool.insert(buf)
#
# but that buffer is the forward graph's static input, which its backward graph still reads
# (e.g. the first layer's input, saved by its input layernorm). A later backward capture takes
# it from the pool as its incoming-gradient buffer (``create_bwd_graph``:
# ``tensor_reuse_pool.get(o)``), so every backward replay overwrites the first layer's input
# before the first layer's backward runs: the embedding and first-layernorm gradients come out
# wrong while the loss is right. Reproduced on CPU with Megatron's own CudaGraphManager over a
# stock local-spec GPTModel (tests/graphs/test_megatron_cuda_graphs.py). Upstream deleted that
# block ("buffers being reused too early and affecting the correctness of the backward pass",
# NVIDIA/Megatron-LM#4433) and later made saved activations explicit (NVIDIA/Megatron-LM#5975).
#
# The shim swaps the one pool instance for a subclass whose ``insert`` drops forward-graph input
# buffers -- in 0.16.x the only tensors carrying ``can_skip_replay_copy``
# (transformer/cuda_graphs.py:876) -- and forwards everything else (the backward graphs'
# grad-output buffers, whose recycling is sound). Cost: one input-sized buffer per graphed
# layer stays allocated, as on upstream main.

class CudaGraphShimError(RuntimeError):
    """A CUDA-graph shim met a megatron-core whose code it was not checked against."""


def _check_fwd_input_recycling_source(cg) -> None:
    import inspect

    fwd = inspect.getsource(cg._CudaGraphRunner.create_fwd_graph)
    expected = ("_CudagraphGlobalRecord.tensor_reuse_pool.insert(buf)",
                "buf.can_skip_replay_copy = can_skip_replay_copy")
    missing = [e for e in expected if e not in fwd]
    if missing:
        raise CudaGraphShimError(
            f"megatron-core {MCORE_VERSION}: _CudaGraphRunner.create_fwd_graph no longer contains "
            f"{missing}; re-check whether forward-graph input buffers are still returned to the "
            "TensorReusePool (NVIDIA/Megatron-LM#4433, #5975) before using per-layer CUDA graphs"
        )


def keep_cudagraph_input_buffers(version: Optional["Version"] = None) -> bool:
    """Stop Megatron 0.16.x from recycling forward-graph input buffers (see the block comment).

    Idempotent; call before the first training step with ``cuda_graph_impl="local"``. Returns
    True when the shim is (already) installed. Raises :class:`CudaGraphShimError` on a
    megatron-core line it was not checked against, saying what to check.
    """
    _require_checked_mcore(
        "keep_cudagraph_input_buffers",
        "transformer/cuda_graphs.py _CudaGraphRunner.create_fwd_graph returning forward-graph input "
        "buffers to tensor_reuse_pool (if it no longer does -- fixed upstream by "
        "NVIDIA/Megatron-LM#4433 / #5975 -- gate the shim off for that line)",
        exc=CudaGraphShimError, version=version)
    from megatron.core.transformer import cuda_graphs as cg

    record = cg._CudagraphGlobalRecord
    if isinstance(record.tensor_reuse_pool, _keep_input_pool_class(cg)):
        return True
    _check_fwd_input_recycling_source(cg)
    record.tensor_reuse_pool = _keep_input_pool_class(cg)()
    return True


_POOL_CLASS = None


def _keep_input_pool_class(cg):
    global _POOL_CLASS
    if _POOL_CLASS is None:

        class KeepFwdInputsPool(cg.TensorReusePool):
            """TensorReusePool that never takes back a forward graph's input buffer."""

            dropped = 0

            def insert(self, tensor):
                if hasattr(tensor, "can_skip_replay_copy"):
                    type(self).dropped += 1
                    return
                super().insert(tensor)

        _POOL_CLASS = KeepFwdInputsPool
    return _POOL_CLASS


def restore_cudagraph_input_recycling() -> None:
    """Undo :func:`keep_cudagraph_input_buffers` (tests show the 0.16.1 bug with it off)."""
    from megatron.core.transformer import cuda_graphs as cg

    cg._CudagraphGlobalRecord.tensor_reuse_pool = cg.TensorReusePool()


# =============================================================================================
# LoRA on Transformer Engine's fused LayerNorm + column-parallel linear (lora/adapter.py).
#
# The adapter of a ``TELayerNormColumnParallelLinear`` (linear_qkv / linear_fc1 of the TE spec)
# must see the *normalised* input, which only TE's LayerNormLinear has. megatron-core 0.16.x
# builds it with ``return_layernorm_output=False`` (extensions/transformer_engine.py,
# TELayerNormColumnParallelLinear.__init__) and TE reads the attribute at every forward, so we
# flip it after construction (as NeMo's LoRA does). The wrapper's forward then returns
# ``((out, ln_out), None)``, or TE's ``(out, bias, ln_out)`` when it returns the bias itself
# (``te_return_bias``, i.e. skip_bias_add with a bias). Gated by ``_require_checked_mcore``.
# =============================================================================================
_LAYERNORM_LINEAR_REASON = (
    "TELayerNormColumnParallelLinear (extensions/transformer_engine.py) is built with "
    "return_layernorm_output=False and its forward returns TE's output, or (output, None)"
)


def return_layernorm_output(linear) -> None:
    """Make a TE fused LayerNorm+linear also return its normalised input (see the section
    comment); split its outputs with :func:`split_layernorm_linear_output`."""
    _require_checked_mcore("return_layernorm_output", _LAYERNORM_LINEAR_REASON)
    if not hasattr(linear, "return_layernorm_output"):
        raise TypeError(
            f"{type(linear).__name__} has no return_layernorm_output: not a Transformer Engine "
            "LayerNormLinear"
        )
    linear.return_layernorm_output = True
    if hasattr(linear, "return_layernorm_output_gathered"):
        # Under sequence parallelism the adapter takes this rank's shard [S/tp, ...] and gathers
        # its own rank-r output (lora/adapter.py); TE's default, pinned here.
        linear.return_layernorm_output_gathered = False


def split_layernorm_linear_output(out) -> tuple:
    """``(output, bias, ln_out)`` from the forward of a linear changed by
    :func:`return_layernorm_output`: ``((out, ln_out), None)`` or ``(out, bias, ln_out)``."""
    _require_checked_mcore("split_layernorm_linear_output", _LAYERNORM_LINEAR_REASON)
    if len(out) == 3:
        return tuple(out)
    (output, ln_out), bias = out
    return output, bias, ln_out

# ---------------------------------------------------------------------------------------------
# dist_checkpointing on a CPU
#
# megatron-core 0.16.x's torch_dist save path is written for GPUs: after staging tensors to the
# host it calls ``torch.cuda.synchronize()`` (strategies/filesystem_async.py:230,
# ``FileSystemWriterAsync.preload_tensors``) and it broadcasts its failure flag in a tensor made
# on ``torch.cuda.current_device()`` (strategies/state_dict_saver.py:252,
# ``save_state_dict_async_finalize``). On a machine without CUDA both raise "Torch not compiled
# with CUDA enabled", so the CPU main job could not checkpoint at all. While CUDA is unavailable,
# and only inside the block, ``dist_checkpointing_on_cpu`` makes the synchronize a no-op (the
# staged copies are plain CPU copies, already complete) and points ``current_device`` at the CPU
# (the flag is broadcast over gloo). With CUDA present it does nothing.
# ---------------------------------------------------------------------------------------------

DIST_CKPT_CPU_SITES = (
    ("dist_checkpointing/strategies/filesystem_async.py", "torch.cuda.synchronize()"),
    ("dist_checkpointing/strategies/state_dict_saver.py", "device=torch.cuda.current_device()"),
)


def dist_checkpointing_on_cpu():
    """Context manager around ``dist_checkpointing.save`` / ``load`` (see the section above)."""
    import contextlib
    from unittest import mock

    import torch

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    _require_checked_mcore(
        "dist_checkpointing_on_cpu",
        f"the torch.cuda calls of {', '.join(f for f, _ in DIST_CKPT_CPU_SITES)}")
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda device=None: None))
    stack.enter_context(
        mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu"))
    )
    return stack


# =====================================================================================
# Sync-free optimizer step: Megatron optimizer internals (megatron_fastpath.optim)
# =====================================================================================
# megatron_fastpath.optim.SyncFreeOptimizer drives Megatron's own optimizer objects
# (FP32Optimizer, Float16OptimizerWithFloat16Params, ChainedOptimizer of those) but replaces
# the three host reads in their step (clip_grads.py ``total_norm.item()``, optimizer.py
# ``found_inf.item()``, DynamicGradScaler's host-side trackers) with device-side code. It needs
# the optimizers' private group lists and copy helpers, which are not public API: checked here
# for the 0.16 line only.

def optimizer_leaves(optimizer) -> list:
    """The FP32Optimizer / Float16OptimizerWithFloat16Params objects inside ``optimizer`` (a
    ChainedOptimizer is flattened); anything else is refused with what to use instead."""
    _require_checked_mcore(
        "optimizer_leaves",
        "the sync-free optimizer step reads private fields of Megatron's FP32Optimizer / "
        "Float16OptimizerWithFloat16Params / DynamicGradScaler; use Megatron's own step "
        "(training.optimizer_step=megatron) until they are re-checked",
    )
    from megatron.core.optimizer.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
        FP32Optimizer,
    )

    leaves = list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [
        optimizer]
    for leaf in leaves:
        if type(leaf) not in (FP32Optimizer, Float16OptimizerWithFloat16Params):
            raise TypeError(
                f"the sync-free optimizer step supports Megatron's FP32Optimizer and "
                f"Float16OptimizerWithFloat16Params (use_distributed_optimizer=False); got "
                f"{type(leaf).__name__}: use its own step() instead"
            )
        cfg = leaf.config
        if cfg.log_num_zeros_in_grad or cfg.use_precision_aware_optimizer or getattr(
                cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
            raise ValueError(
                "the sync-free optimizer step does not support log_num_zeros_in_grad, "
                "use_precision_aware_optimizer or reuse_grad_buf_for_mxfp8_param_ag (each reads "
                "values back or keeps state elsewhere); turn them off in OptimizerConfig"
            )
    return leaves


def leaf_is_mixed_precision(leaf) -> bool:
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    return isinstance(leaf, Float16OptimizerWithFloat16Params)


def leaf_copy_model_grads_to_main(leaf) -> None:
    """Megatron's own (sync-free) first half of ``prepare_grads``: model grads -> main grads.
    FP32Optimizer.prepare_grads only points ``param.grad`` at ``main_grad``; the mixed-precision
    optimizer's ``_copy_model_grads_to_main_grads`` casts them into the fp32 main params."""
    if leaf.is_stub_optimizer:
        return
    if leaf_is_mixed_precision(leaf):
        leaf._copy_model_grads_to_main_grads()
    else:
        leaf.prepare_grads()


def leaf_main_grads_for_unscaling(leaf) -> list:
    return [] if leaf.is_stub_optimizer else leaf._collect_main_grad_data_for_unscaling()


def leaf_copy_main_params_to_model(leaf) -> None:
    if leaf_is_mixed_precision(leaf) and not leaf.is_stub_optimizer:
        leaf._copy_main_params_to_model_params()


def dynamic_scaler_fields(scaler):
    """(kind, fields) of a Megatron grad scaler: kind "dynamic" with its factors / intervals /
    host-side trackers, "constant", or None for no scaler (bf16 without loss scaling)."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    if scaler is None:
        return None, {}
    if isinstance(scaler, ConstantGradScaler):
        return "constant", {}
    if type(scaler) is not DynamicGradScaler:
        raise TypeError(f"unsupported grad scaler {type(scaler).__name__}")
    return "dynamic", dict(
        min_scale=scaler.min_scale, growth_factor=scaler.growth_factor,
        backoff_factor=scaler.backoff_factor, growth_interval=scaler.growth_interval,
        hysteresis=scaler.hysteresis, growth_tracker=scaler._growth_tracker,
        hysteresis_tracker=scaler._hysteresis_tracker,
    )


def set_dynamic_scaler_trackers(scaler, growth_tracker: int, hysteresis_tracker: int) -> None:
    """Write the device-side trackers back to Megatron's host fields (checkpoint time)."""
    scaler._growth_tracker = int(growth_tracker)
    scaler._hysteresis_tracker = int(hysteresis_tracker)


_FUSED_ADAM_CLASSES = (
    ("transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam"),
    ("apex.optimizers.fused_adam", "FusedAdam"),
)


def torch_adam_in_place_of_fused_adam(leaf) -> bool:
    """Swap a leaf's Transformer Engine / Apex ``FusedAdam`` (Megatron's choice when either is
    installed) for torch's Adam/AdamW over the *same* param-group dicts, before its first step.

    Their ``step()`` keeps the step count in ``group['step']`` on the host and skips nothing on
    the device; the sync-free step runs torch's Adam math (one fused kernel per group on CUDA)
    on torch-layout state instead -- what Megatron itself builds without TE/Apex, so its
    checkpoint code (per-parameter ``step``) applies unchanged. Only the plain configuration is
    taken over (fp32 states, no master weights, no decoupled grads, bias correction on);
    anything else raises TypeError (``optimizer_step=auto`` then keeps Megatron's step).
    Returns True when swapped."""
    import torch

    opt = getattr(leaf, "optimizer", None)
    kind = (type(opt).__module__, type(opt).__name__)
    if opt is None or kind not in _FUSED_ADAM_CLASSES:
        return False
    plain = (
        not getattr(opt, "capturable", False) and not getattr(opt, "master_weights", False)
        and not getattr(opt, "use_decoupled_grad", False)
        and not getattr(opt, "store_param_remainders", False)
        and getattr(opt, "exp_avg_dtype", torch.float32) == torch.float32
        and getattr(opt, "exp_avg_sq_dtype", torch.float32) == torch.float32
        and all(g.get("bias_correction", True) for g in opt.param_groups)
    )
    if not plain or len(opt.state) != 0:
        raise TypeError(
            f"{kind[0]}.FusedAdam with master weights / low-precision states / capturable / "
            "decoupled grads, or after its first step, is not taken over by the sync-free step"
        )
    cls = torch.optim.AdamW if opt.adam_w_mode else torch.optim.Adam
    d = opt.defaults
    leaf.optimizer = cls(opt.param_groups, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                         weight_decay=d["weight_decay"])
    return True


# =============================================================================================
# Transformer Engine FP8 delayed-scaling state, without pickle (checkpoint/fp8.py).
#
# TE keeps a delayed-scaling module's scales and amax histories in ``fp8_meta["scaling_fwd"]`` /
# ``["scaling_bwd"]`` (``DelayedScalingRecipeState``: ``.scale`` [3 * num_gemms] and
# ``.amax_history`` [amax_history_len, 3 * num_gemms] forward; 2 * num_gemms backward) and
# checkpoints them only inside ``get_extra_state``: a *pickled* dict in a uint8 tensor
# (transformer_engine/pytorch/module/base.py, get_extra_state / set_extra_state), which Megatron
# stores as a ShardedObject. Loading it means unpickling checkpoint bytes -- TE itself now
# refuses that unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 (pytorch/_extra_state.py) -- so
# our checkpoints drop ``_extra_state`` and carry these four tensors instead, as safetensors.
# Restoring goes through TE's own methods: ``init_fp8_meta_tensors(recipe)`` (allocates the
# recipe state; a later forward's ``set_meta_tensor`` keeps an initialised delayed-scaling state,
# only adjusting the history length) and ``reset_fp8_meta_tensors(fp8_meta_tensors)`` (copies
# ``{"scaling_fwd": [scale, amax_history], "scaling_bwd": [...]}`` in place, so the global amax
# buffers keep viewing the same tensors). Checked against TE 2.x sources (release_v2.x and main,
# Nov 2026); the keyword the restore needs is checked on the module at run time.
# Stateless recipes (current / MXFP8 / block scaling) have no amax history: nothing is saved.
# =============================================================================================
TE_FP8_STATE_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")


def te_fp8_delayed_scaling_state(module) -> Optional[dict]:
    """A TE module's delayed-scaling tensors (the live device tensors, detached: copy them)
    keyed like TE's extra state, or None for a module that is not TE, not initialised for FP8,
    or on a stateless recipe."""
    # the module's own attribute: wrappers that forward attribute reads to a wrapped TE module
    # (LoRALinear.__getattr__) must not be taken for a second TE module
    meta = vars(module).get("fp8_meta")
    if not isinstance(meta, dict) or not getattr(module, "fp8_meta_tensors_initialized", False):
        return None
    fwd, bwd = meta.get("scaling_fwd"), meta.get("scaling_bwd")
    if not all(hasattr(s, "scale") and hasattr(s, "amax_history") for s in (fwd, bwd)):
        return None
    return {f"{name}_{d}": getattr(s, name).detach()
            for d, s in (("fwd", fwd), ("bwd", bwd)) for name in ("scale", "amax_history")}


def te_restore_fp8_delayed_scaling_state(module, state: dict, recipe) -> None:
    """Put :func:`te_fp8_delayed_scaling_state`'s tensors back into ``module`` through TE's own
    ``init_fp8_meta_tensors`` / ``reset_fp8_meta_tensors``. ``recipe``: the run's TE recipe
    (``megatron.core.fp8_utils.get_fp8_recipe(config)``, what its fp8 autocast will use), so the
    quantizers TE makes here are the ones the first forward keeps."""
    import inspect

    missing = [k for k in TE_FP8_STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"FP8 state of {type(module).__name__} lacks {missing}")
    if recipe is None or not recipe.delayed():
        raise ValueError(f"the checkpoint holds FP8 delayed-scaling state, this run's recipe is "
                         f"{type(recipe).__name__}: resume with fp8.recipe=delayed")
    reset = getattr(module, "reset_fp8_meta_tensors", None)
    init = getattr(module, "init_fp8_meta_tensors", None)
    if (reset is None or "fp8_meta_tensors" not in inspect.signature(reset).parameters
            or init is None or "recipe" not in inspect.signature(init).parameters):
        raise RuntimeError(
            f"{type(module).__name__} lacks reset_fp8_meta_tensors(fp8_meta_tensors=...) / "
            "init_fp8_meta_tensors(recipe): "
            "this Transformer Engine predates 2.0, whose FP8 state the checkpoint restores; "
            "upgrade Transformer Engine or resume with fastpath.fp8=false")
    meta = module.fp8_meta
    if not getattr(module, "fp8_meta_tensors_initialized", False):
        meta["recipe"] = recipe
        meta["num_gemms"] = state["scale_fwd"].numel() // 3
        module.init_fp8_meta_tensors(recipe)
    dev = meta["scaling_fwd"].scale.device
    reset({f"scaling_{d}": [state[f"scale_{d}"].to(dev), state[f"amax_history_{d}"].to(dev)]
           for d in ("fwd", "bwd")})
