"""The one place that knows which Megatron-Core (and Transformer Engine) internals we touch.

Checked against megatron-core 0.16.1 (the newest release for Python 3.11) and 0.19.2 (Python
3.12); the 0.17 and 0.18 lines were not read and are refused. Every use of a
Megatron-Core or Transformer Engine symbol whose location or behaviour differs between releases
goes through this package, one module per subsystem, each shim gated by the one version gate
below (:func:`_require_checked_mcore`); ``tests/test_layering.py`` fails when a private
``megatron.core`` / ``transformer_engine`` name is imported anywhere else.

* :mod:`.graphs` -- CudaGraphManager's argument rules; the 0.16.x input-buffer shim (0.19
  allocates and keeps forward-graph input buffers itself); on 0.19 the packed cache's record fields
  as separate graph inputs (0.19 gives all views of one base one capture buffer)
* :mod:`.tensor_parallel` -- TP marks and partial-gradient all-reduce
* :mod:`.offload` -- RNG-state tools and TransformerLayer.forward's parameters
* :mod:`.moe` -- MoELayer / TopKRouter state without their CUDA-only constructors
* :mod:`.te` -- TE LayerNormLinear for LoRA; FP8 delayed-scaling state without pickle
* :mod:`.te_quantized` -- TE quantized tensors and do-not-offload marks (activation offload)
* :mod:`.dist_ckpt` -- Megatron's dist_checkpointing on a CPU; its loads without torch's
  ShardedTensor deprecation warnings
* :mod:`.optim` -- Megatron optimizer internals for the sync-free step
* :mod:`.dist_optim_ckpt` -- the DistributedOptimizer's checkpoint format, and its load with torch's Adam
* :mod:`.spec` -- the dense-MLP entry of a TransformerLayer spec (ModuleSpec / 0.19's builder)
* :mod:`.gpt_output` -- GPTModel.forward with an output processor (0.19's ``output_processor=``;
  the same steps run on 0.16.x): the chunked linear cross-entropy in place of the logits

The torch release is read here too (:data:`TORCH_RELEASE`): code that depends on a behaviour
that differs between torch releases -- the package's own, or a test stand-in's -- branches on
it, citing each release's source line.
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


# =============================================================================================
# The one version gate. Every shim below touches megatron-core internals that were read in the
# 0.16.x and 0.19.x sources (0.16.1 and 0.19.2; 0.17 / 0.18 were not read); each calls
# ``_require_checked_mcore`` (directly, or with its own exception type), which returns the
# release line a shim branches on where the two lines differ, so widening support to a new line
# means re-reading what each shim says and adding the line here -- in one place.
# =============================================================================================
CHECKED_MCORE_LINES = ((0, 16), (0, 19))  # (major, minor) lines every shim was checked against
MCORE_0_16, MCORE_0_19 = CHECKED_MCORE_LINES


def mcore_line(version: Optional["Version"] = None) -> tuple:
    """``(major, minor)`` of ``version`` (default: the installed megatron-core)."""
    version = version or MCORE_VERSION
    return (version.major, version.minor)


def _require_checked_mcore(shim: str, reason: str, exc: type = ImportError,
                           version: Optional["Version"] = None) -> tuple:
    """Raise ``exc`` on a megatron-core outside :data:`CHECKED_MCORE_LINES`, saying what the
    shim relies on (``reason``) and so what to re-read before widening the gate; returns the
    checked ``(major, minor)`` line for shims that branch on it."""
    version = version or MCORE_VERSION
    line = mcore_line(version)
    if line not in CHECKED_MCORE_LINES:
        lines = ", ".join("%d.%d.x" % v for v in CHECKED_MCORE_LINES)
        raise exc(
            f"megatron_fastpath.compat.{shim} was checked against megatron-core {lines} only and "
            f"megatron-core {version} is installed: {reason}. Check that against "
            "the installed release and widen CHECKED_MCORE_LINES in megatron_fastpath/compat/__init__.py"
        )
    return line


# =============================================================================================
# The torch release. Two are read and tested: 2.13 (the CPU machines' default, Python 3.11) and
# 2.11 (the GPU machines' CUDA 13 build, Python 3.12; CI runs the unit tier on it too). Where
# they differ, the branch compares TORCH_RELEASE with the release whose source it cites, and cites
# the other one's line as well.
# =============================================================================================
def torch_release(version: Optional[str] = None) -> tuple:
    """``(major, minor)`` of ``version``, by default the installed torch's (``"2.11.0+cu130"``
    -> ``(2, 11)``), read from its metadata so that importing this module imports no torch."""
    try:
        parsed = Version(version if version is not None else importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError as exc:  # pragma: no cover - install error
        raise ImportError("megatron_fastpath needs torch (`pip install torch`)") from exc
    return (parsed.major, parsed.minor)


TORCH_RELEASE = torch_release()
