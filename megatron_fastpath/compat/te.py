"""Transformer Engine: LoRA on TE's fused LayerNorm+linear (lora/adapter.py) and FP8
delayed-scaling state without pickle (fp8/state.py)."""

from __future__ import annotations

from typing import Optional

from megatron_fastpath.compat import _require_checked_mcore


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
# Unchanged in 0.19.x (0.19.2 extensions/transformer_engine.py:1281
# ``return_layernorm_output=False``; forward :1328-1345 returns ``out`` or ``(out, None)``).
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

# =============================================================================================
# Transformer Engine FP8 delayed-scaling state, without pickle (fp8/state.py).
#
# TE keeps a delayed-scaling module's scales and amax histories in ``fp8_meta["scaling_fwd"]`` /
# ``["scaling_bwd"]`` (``DelayedScalingRecipeState``: ``.scale`` [3 * num_gemms] and
# ``.amax_history`` [amax_history_len, 3 * num_gemms] forward; 2 * num_gemms backward) and
# checkpoints them only inside ``get_extra_state``: a *pickled* dict in a uint8 tensor
# (transformer_engine/pytorch/module/base.py, get_extra_state / set_extra_state), which Megatron
# stores as a ShardedObject. Loading it means unpickling checkpoint bytes -- TE itself
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
