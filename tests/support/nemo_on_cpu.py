"""Test-only: run NeMo 2.7's ``llm.import_ckpt`` and ``llm.finetune`` (Lightning Trainer +
``nemo.lightning.MegatronStrategy``) on a CPU, built on :func:`tests.support.cuda_as_cpu`.

Never imported by the package. Use::

    with nemo_on_cpu():
        llm.import_ckpt(...)          # or: fdl.build(recipe)()  (recipe.trainer.accelerator = "cpu")

The recipe itself runs with ``trainer.accelerator = "cpu"`` (a public Trainer field; NeMo's own
HF importer builds its MegatronStrategy trainer that way, ``nemo/lightning/io/connector.py``
``nemo_setup``), fp32 (``trainer.plugins = None``, ``optim.config.bf16 = False``) and
``strategy.ckpt_async_save = False``. What this block stands in for while it is active:

CUDA pieces (from :func:`cuda_as_cpu`; each keeps the CPU-visible contract of its CUDA call):

* ``torch.cuda.current_device`` -> 0, ``Tensor.cuda`` / ``.to(0)`` / ``device='cuda'`` kept on
  the CPU: ``megatron_parallel.py:142`` (``move_data_to_device(batch,
  torch.cuda.current_device())``), ``:348`` / ``:1847`` / ``:1857`` (loss tensors on
  ``current_device()``), ``:577`` (``model_module.cuda(torch.cuda.current_device())``),
  ``megatron_strategy.py:801`` / ``:850`` / ``:881`` (logged scalars made with ``pin_memory=True``
  then ``.to("cuda")``),
  ``plugins/data_sampler.py:192`` / ``:212``;
* ``torch.cuda.Stream`` / ``torch.cuda.stream``: ``megatron_parallel.py:617`` (the DDP wrap on a
  side stream): CPU work is already ordered;
* ``torch.cuda.synchronize``: megatron-core ``dist_checkpointing/strategies/
  filesystem_async.py:230`` (the importer's checkpoint save): counted, nothing to wait for;
* the CUDA RNG (``torch.cuda.manual_seed`` / ``get_rng_state``, Megatron's tracker): the CPU
  generator.

plus one CUDA query this block adds:

* ``torch.cuda.is_initialized`` -> True: ``nemo/lightning/io/pl.py:495`` (``_fix_tensors_device``,
  the checkpoint restore) asserts it, then moves only tensors that are on CUDA -- none here,
  so the restore loads what it read.

Version / optional-package gaps (NeMo 2.7 against megatron-core 0.16.1 without Transformer
Engine) -- not CUDA, but each stops the run before its first step:

* ``get_megatron_optimizer``: NeMo's ``_strategy_lib.py:712`` passes ``no_weight_decay_cond``,
  ``scale_lr_cond`` and ``lr_mult``, which megatron-core 0.16.1 removed (its ``config_overrides``
  default is the same rule: no decay for biases and 1-dim parameters). The stand-in forwards the
  call when those three are at their defaults (None, None, 1.0) and refuses anything else.
* ``nemo.collections.llm.peft.utils.HAVE_TE`` -> False: megatron-core 0.16.1 without TE exports
  non-class placeholders for ``TEColumnParallelLinear`` and friends, so NeMo's check is True and
  its ``isinstance(m, <placeholder>)`` (``peft/utils.py:77``) raises. TE is absent: False is the fact.
* ``nemo.collections.llm.peft.lora.te``: without TE it is NeMo's ``UnavailableMeta`` placeholder
  and ``m.__class__ == te.Linear`` (``peft/lora.py:703``) raises on the attribute. The stand-in's
  ``Linear`` / ``LayerNormLinear`` are classes no module is an instance of (TE is absent).
* the importer (``HFLlamaImporter.config``, ``gpt/model/llama.py:692``) builds a LlamaConfig with
  the TE-only fusions on (``apply_rope_fusion`` ...), which megatron-core refuses without TE:
  :func:`import_hf_llama` builds it with them off (the same values NeMo uses with TE absent
  everywhere else) and saves synchronously (``ckpt_async_save=False``: NeMo's async writer,
  ``utils/callbacks/dist_ckpt_io.py:39``, imports megatron-core's ``strategies.tensorstore``,
  which 0.16.1 no longer has).
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Iterator
from unittest import mock

from tests.support.cuda_as_cpu import cuda_as_cpu

# (file under site-packages, line, text expected on that line): the sites the module docstring
# names, checked by tests/integrations/test_nemo_finetune_cpu.py so an upgrade shows what moved
NEMO_SITES = (
    ("nemo/lightning/megatron_parallel.py", 142, "torch.cuda.current_device()"),
    ("nemo/lightning/megatron_parallel.py", 577, "model_module.cuda(torch.cuda.current_device())"),
    ("nemo/lightning/megatron_parallel.py", 617, "torch.cuda.stream(torch.cuda.Stream())"),
    ("nemo/lightning/io/pl.py", 495, "assert torch.cuda.is_initialized()"),
    ("nemo/lightning/_strategy_lib.py", 715, "no_weight_decay_cond=no_weight_decay_cond"),
    ("nemo/collections/llm/peft/utils.py", 77, "isinstance(m, te_column_parallel)"),
    ("nemo/collections/llm/peft/lora.py", 703, "m.__class__ == te.Linear"),
    ("nemo/utils/callbacks/dist_ckpt_io.py", 39, "import tensorstore"),
    ("megatron/core/dist_checkpointing/strategies/filesystem_async.py", 230, "torch.cuda.synchronize()"),
)

# the TE-only fusions megatron-core refuses without Transformer Engine
NO_TE_FUSIONS = dict(
    apply_rope_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
    gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
    cross_entropy_loss_fusion=False,
)


def moved_sites(sites=NEMO_SITES) -> list:
    """The sites whose line no longer holds the text in the installed packages."""
    import os

    import nemo

    from tests.support.site_lines import moved_sites as moved

    return moved(os.path.dirname(os.path.dirname(nemo.__file__)), sites)


def _optimizer_without_removed_kwargs(real):
    @functools.wraps(real)
    def get_megatron_optimizer(config, model_chunks, no_weight_decay_cond=None, scale_lr_cond=None,
                               lr_mult=1.0, **kwargs):
        if no_weight_decay_cond is not None or scale_lr_cond is not None or lr_mult != 1.0:
            raise NotImplementedError(
                "megatron-core 0.16.1's get_megatron_optimizer has no no_weight_decay_cond / "
                "scale_lr_cond / lr_mult (NeMo 2.7 passes them): only their defaults are served")
        return real(config, model_chunks, **kwargs)

    return get_megatron_optimizer


class _NoTE:
    """``transformer_engine.pytorch`` as NeMo's LoRA reads it when TE is absent."""

    class Linear:  # no module is one
        pass

    class LayerNormLinear:
        pass


@contextlib.contextmanager
def nemo_on_cpu() -> Iterator[None]:
    """The stand-ins of the module docstring, for the block's duration."""
    import megatron.core.optimizer as mcore_optimizer

    patches = [
        mock.patch("torch.cuda.is_initialized", lambda: True),
        mock.patch("megatron.core.optimizer.get_megatron_optimizer",
                   _optimizer_without_removed_kwargs(mcore_optimizer.get_megatron_optimizer)),
        mock.patch("nemo.collections.llm.peft.utils.HAVE_TE", False),
        mock.patch("nemo.collections.llm.peft.lora.te", types.SimpleNamespace(
            Linear=_NoTE.Linear, LayerNormLinear=_NoTE.LayerNormLinear)),
    ]
    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_as_cpu())
        for p in patches:
            stack.enter_context(p)
        yield


def import_hf_llama(hf_dir: str, output_path: str, **config) -> str:
    """``llm.import_ckpt`` of a Llama HF checkpoint into a NeMo 2 checkpoint, on the CPU (see the
    module docstring: TE-only fusions off, synchronous save). ``config``: the LlamaConfig the
    caller's recipe uses (import_ckpt only reads its class)."""
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model import llama as llama_mod
    from nemo.lightning.pytorch.strategies.megatron_strategy import MegatronStrategy

    real_config = llama_mod.HFLlamaImporter.config
    real_init = MegatronStrategy.__init__

    def config_without_te_fusions(self):
        # the module's LlamaConfig only while the importer builds its config, so the saved
        # context still names nemo's own class
        with mock.patch.object(llama_mod, "LlamaConfig", functools.partial(llm.LlamaConfig, **NO_TE_FUSIONS)):
            return real_config.fget(self)

    @functools.wraps(real_init)  # fiddle caches the class's signature: keep the real one
    def strategy_init(self, *args, **kwargs):
        kwargs["ckpt_async_save"] = False
        real_init(self, *args, **kwargs)

    with nemo_on_cpu(), \
            mock.patch.object(llama_mod.HFLlamaImporter, "config", property(config_without_te_fusions)), \
            mock.patch.object(MegatronStrategy, "__init__", strategy_init):
        return str(llm.import_ckpt(model=llm.LlamaModel(llm.LlamaConfig(**config, **NO_TE_FUSIONS)),
                                   source=f"hf://{hf_dir}", output_path=output_path))
