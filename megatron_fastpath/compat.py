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
