"""Test-only: run Megatron-Bridge 0.6's ``finetune`` (``megatron.bridge.training``: setup, the
train loop, checkpoint load, the PEFT transform) on a CPU, built on
:func:`tests.support.cuda_as_cpu.cuda_as_cpu`, in a process started with the fake Transformer
Engine (``tests.support.fake_te``: Bridge imports TE unconditionally,
``megatron/bridge/peft/lora_layers.py:20``).

Never imported by the package. Use::

    with bridge_on_cpu():
        finetune(cfg, forward_step)   # cfg.dist.distributed_backend = "gloo", fp32, TE fusions off

CUDA pieces (from :func:`cuda_as_cpu`; each keeps the CPU-visible contract of its CUDA call):
``device="cuda"`` tensors (``training/setup.py:281``, the start-time all-reduce; Megatron's
schedules and optimizer, cuda_as_cpu's own list), ``torch.cuda.current_device`` / streams /
``synchronize``, the CUDA RNG (Megatron's tracker, seeded by Bridge's ``_set_random_seed``).

plus what this block stands in for, each stopping the run before its first step otherwise:

* ``initialize.compile_helpers`` (``training/initialize.py:147`` -> megatron-core
  ``datasets/utils.py:25``, ``make -C megatron/core/datasets``): megatron-core's wheel ships
  the dataset helpers prebuilt (``helpers_cpp``) without their Makefile, so ``make`` fails and
  Bridge exits. The stand-in imports the prebuilt extension (what ``make`` would have built).
* ``initialize._warmup_jit_function`` (``training/setup.py:276`` ->
  ``training/initialize.py:311``): warms the ``torch.compile``'d fused bias-SwiGLU /
  bias-dropout-add kernels on "cuda" tensors (``initialize.py:915``), and ``torch.compile``
  asks the CUDA driver for the device's capability (dynamo's ``has_triton``). The recipe runs
  with those fusions off (``bias_activation_fusion`` / ``bias_dropout_fusion`` False, as
  megatron-core requires without TE), so the warmed kernels are never called: a no-op.
* ``TEDotProductAttention`` as Megatron's TE spec provider hands it to every layer
  (megatron-core ``extensions/transformer_engine_spec_provider.py:73``): the fake TE serves
  sbhd / bshd attention only, and Bridge's packed path is THD; the stand-in is
  :class:`tests.support.gpu_standins.TEDotProductAttentionStandIn` (Megatron's
  ``TEDotProductAttention`` contract over per-sequence causal attention), which the package's
  own 'te' backend tests use.
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

from tests.support.cuda_as_cpu import cuda_as_cpu
from tests.support.gpu_standins import TEDotProductAttentionStandIn

# (file under site-packages, line, text expected on that line): the sites the module docstring
# names, checked by tests/integrations/test_bridge_finetune_cpu.py so an upgrade shows what moved
BRIDGE_SITES = (
    ("megatron/bridge/peft/lora_layers.py", 20, "import transformer_engine.pytorch as te"),
    ("megatron/bridge/training/setup.py", 281, 'device="cuda"'),
    ("megatron/bridge/training/initialize.py", 147, "compile_helpers()"),
    ("megatron/core/datasets/utils.py", 25, 'command = ["make", "-C"'),
    ("megatron/bridge/training/setup.py", 276, "set_jit_fusion_options(cfg.model"),
    ("megatron/bridge/training/initialize.py", 311, "_warmup_jit_function("),
    ("megatron/bridge/training/initialize.py", 915, "bias_swiglu(input, bias)"),
    ("megatron/core/extensions/transformer_engine_spec_provider.py", 73, "return TEDotProductAttention"),
)


def moved_sites(sites=BRIDGE_SITES) -> list:
    """The sites whose line no longer holds the text in the installed packages."""
    import importlib.util
    import os

    from tests.support.site_lines import moved_sites as moved

    megatron = os.path.dirname(os.path.dirname(importlib.util.find_spec("megatron.core").origin))
    return moved(os.path.dirname(megatron), sites)  # site-packages


def _prebuilt_dataset_helpers() -> None:
    """``compile_helpers`` where megatron-core's wheel ships the extension prebuilt."""
    import megatron.core.datasets.helpers_cpp  # noqa: F401


@contextlib.contextmanager
def bridge_on_cpu() -> Iterator[None]:
    """The stand-ins of the module docstring, for the block's duration."""
    patches = [
        mock.patch("megatron.bridge.training.initialize.compile_helpers", _prebuilt_dataset_helpers),
        mock.patch("megatron.bridge.training.initialize._warmup_jit_function", lambda *a, **k: None),
        mock.patch("megatron.core.extensions.transformer_engine_spec_provider.TEDotProductAttention",
                   TEDotProductAttentionStandIn),
    ]
    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_as_cpu())
        for p in patches:
            stack.enter_context(p)
        yield
