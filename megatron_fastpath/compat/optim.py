"""Sync-free optimizer step: Megatron optimizer internals (optim/sync_free.py)."""

from __future__ import annotations


from megatron_fastpath.compat import MCORE_0_19, _require_checked_mcore, mcore_line


# =====================================================================================
# Sync-free optimizer step: Megatron optimizer internals (megatron_fastpath.optim)
# =====================================================================================
# megatron_fastpath.optim.SyncFreeOptimizer drives Megatron's own optimizer objects
# (FP32Optimizer, Float16OptimizerWithFloat16Params, ChainedOptimizer of those) but replaces
# the three host reads in their step (clip_grads.py ``total_norm.item()``, optimizer.py
# ``found_inf.item()``, DynamicGradScaler's host-side trackers) with device-side code. It needs
# the optimizers' private group lists and copy helpers, which are not public API: checked here
# for the 0.16 and 0.19 lines.
#
# 0.19.x renamed ``get_main_grads_for_grad_norm()`` to ``get_grads_for_grad_norm(grad_norm_group
# =None)`` (0.19.2 optimizer/optimizer.py:280), whose main norm leaves out parameters tagged with
# a separate gradient-norm group (``grad_norm_group`` = "mtp", :150-152) and clips those by their
# own norm (``clip_grad_norm``, :374); the sync-free step computes one norm, so on 0.19 it
# refuses such parameters (:func:`optimizer_leaves`). The copy helpers and the grad scaler's
# trackers are unchanged (:1063 / :1092 / :1112, optimizer/grad_scaler.py:128-150).
#
# Megatron's DistributedOptimizer (ZeRO-1) is a MixedPrecisionOptimizer over the shard of each
# parameter this data-parallel rank owns: ``_copy_model_grads_to_main_grads`` takes the shard of
# each reduce-scattered gradient (0.16.1 optimizer/distrib_optimizer.py:2386, 0.19.2 :2746),
# ``get_parameters`` / the gradient-norm filter read the shard main params (the base class:
# 0.16.1 optimizer/optimizer.py:124-160, 0.19.2 :280), the norm and found-inf are all-reduced
# over ``get_grad_stats_parallel_group`` (0.16.1 distrib_optimizer.py:620-626, 0.19.2 :796-802),
# which ``get_megatron_optimizer`` sets to the distributed-optimizer instance group -- the whole
# world with one instance (0.16.1 optimizer/__init__.py:446-459, 0.19.2 :665-678), for the dense
# and the expert optimizer alike -- and ``_copy_main_params_to_model_params`` writes the updated
# shard into the DDP parameter buffer (0.16.1 :2429, 0.19.2 :2792), which the parameter
# all-gather (:func:`leaf_param_all_gather`) then fills in for every rank.

def optimizer_leaves(optimizer) -> list:
    """The FP32Optimizer / Float16OptimizerWithFloat16Params / DistributedOptimizer objects
    inside ``optimizer`` (a ChainedOptimizer is flattened); anything else is refused with what
    to use instead."""
    line = _require_checked_mcore(
        "optimizer_leaves",
        "the sync-free optimizer step reads private fields of Megatron's FP32Optimizer / "
        "Float16OptimizerWithFloat16Params / DistributedOptimizer / DynamicGradScaler; use "
        "Megatron's own step "
        "(training.optimizer_step=megatron) until they are re-checked",
    )
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
        FP32Optimizer,
    )

    leaves = list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [
        optimizer]
    for leaf in leaves:
        if type(leaf) not in (FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer):
            raise TypeError(
                f"the sync-free optimizer step supports Megatron's FP32Optimizer, "
                f"Float16OptimizerWithFloat16Params and DistributedOptimizer; got "
                f"{type(leaf).__name__}: use its own step() instead"
            )
        if type(leaf) is DistributedOptimizer:
            _check_distributed_leaf(leaf)
        cfg = leaf.config
        if cfg.log_num_zeros_in_grad or cfg.use_precision_aware_optimizer or getattr(
                cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
            raise ValueError(
                "the sync-free optimizer step does not support log_num_zeros_in_grad, "
                "use_precision_aware_optimizer or reuse_grad_buf_for_mxfp8_param_ag (each reads "
                "values back or keeps state elsewhere); turn them off in OptimizerConfig"
            )
        if line == MCORE_0_19:
            from megatron.core.optimizer.optimizer import GRAD_NORM_GROUP_ATTR

            grouped = [p for p in leaf.get_parameters()
                       if getattr(p, GRAD_NORM_GROUP_ATTR, None) is not None]
            if grouped:
                raise ValueError(
                    f"the sync-free optimizer step computes one gradient norm; {len(grouped)} "
                    f"parameters carry a separate '{GRAD_NORM_GROUP_ATTR}' (Megatron clips them "
                    "by their own norm, e.g. MTP layers): use training.optimizer_step=megatron"
                )
    return leaves


def _check_distributed_leaf(leaf) -> None:
    """The DistributedOptimizer configurations whose step the sync-free step reproduces: one
    optimizer instance (its norm group the whole world), Megatron's own DDP buffers (not
    Megatron-FSDP, which steps through its own buffers), no gather deferred to a sibling
    optimizer (0.19.2 ``_defer_param_sync``, distrib_optimizer.py:3165-3167)."""
    ddp = leaf.ddp_config
    if (ddp.use_megatron_fsdp or ddp.num_distributed_optimizer_instances != 1
            or getattr(leaf, "_defer_param_sync", False)):
        raise ValueError(
            "the sync-free step runs Megatron's DistributedOptimizer with one optimizer instance "
            "over Megatron's DDP buffers; Megatron-FSDP, num_distributed_optimizer_instances > 1 "
            "and a deferred parameter gather are not supported: use training.optimizer_step="
            "megatron")


def leaf_is_distributed(leaf) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(leaf, DistributedOptimizer)


def leaf_param_all_gather(leaf, version=None) -> None:
    """The parameter all-gather a DistributedOptimizer's ``step_with_ready_grads`` runs after
    its update, exactly: every rank's updated shard into every rank's parameter buffer --
    synchronous, unless ``overlap_param_gather``, where DDP's forward pre-hooks gather each
    bucket during the next forward (and nothing is done here). 0.16.1: ``start_param_sync()``
    on each model chunk (optimizer/distrib_optimizer.py:2611-2619); 0.19.2: the same buckets
    through ``start_param_sync_for_bucket_group_subset`` (:3165-3185). Other leaves: nothing
    (their update writes the model parameters)."""
    # a stub (no parameters on this rank) gathers too: the others' shards fill its buffers
    if not leaf_is_distributed(leaf) or leaf.ddp_config.overlap_param_gather:
        return
    if mcore_line(version) == MCORE_0_19:
        leaf.start_param_sync_for_bucket_group_subset()
    else:
        for model_chunk in leaf.model_chunks:
            model_chunk.start_param_sync()


def leaf_grads_for_grad_norm(leaf, version=None) -> list:
    """The gradients Megatron's gradient norm covers (shared and TP-duplicate weights left
    out): ``get_main_grads_for_grad_norm()`` on 0.16.x, ``get_grads_for_grad_norm()`` on 0.19.x
    (the same filter; separate grad-norm groups are refused by :func:`optimizer_leaves`)."""
    if mcore_line(version) == MCORE_0_19:
        return leaf.get_grads_for_grad_norm()
    return leaf.get_main_grads_for_grad_norm()


def leaf_is_mixed_precision(leaf) -> bool:
    """A MixedPrecisionOptimizer: Float16OptimizerWithFloat16Params or DistributedOptimizer
    (fp32 main copies or shards, the grad scaler and ``found_inf``)."""
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    return isinstance(leaf, MixedPrecisionOptimizer)


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
