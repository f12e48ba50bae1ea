"""The one place that knows which Megatron-Core version is installed.

Tested against megatron-core 0.16.1 (the newest release for Python 3.11). Every import of a
Megatron-Core symbol whose location or behaviour differs between releases goes through here.
"""

from __future__ import annotations

import importlib.metadata

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
    """(ArgMetadata, mismatch_errors(ref_args, ref_kwargs, args, kwargs)) from Megatron's own
    CudaGraphManager code, so the graph-safety audit applies exactly Megatron's matching rules.

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
# Activation offload shims (megatron_fastpath/offload/layer.py). Checked against 0.16.x only.
# =============================================================================================
def _require_checked_mcore(shim: str, reason: str) -> None:
    """The 0.16.x gate of the offload shims: raise on any megatron-core outside that line."""
    if not (Version("0.16.0") <= MCORE_VERSION < Version("0.17.0")):
        raise ImportError(
            f"megatron_fastpath.compat.{shim} was checked against megatron-core 0.16.x only and "
            f"megatron-core {MCORE_VERSION} is installed: {reason}. Check that against the "
            "installed release and widen the gate in megatron_fastpath/compat.py"
        )


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
