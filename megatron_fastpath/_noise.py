"""Log noise of the main job (``python -m megatron_fastpath.train``), filtered there only.

On a machine without Transformer Engine / Apex, Megatron-Core warns once per module that falls
back to torch (about 7 lines per process), torch warns that ``pynvml`` is deprecated when it is
imported, and Megatron logs "Unknown MLP type" for every fastpath MoE layer (our layer is
built from its own ModuleSpec, which megatron-core 0.16's ``TransformerLayer`` does not list; it
then passes the default keyword arguments, which is what ours takes). megatron-core 0.19 logs
"GPTModel IS DEPRECATED" (models/gpt/gpt_model.py:118-124, pointing at ``HybridModel``) once
per model built: the main job builds Megatron's ``GPTModel`` on purpose (every supported line
has it; docs/architecture.md). A 4-rank job printed about 52 such lines. The main job instead prints one line naming the absent optional packages and
filters exactly these messages -- inside :func:`main_job_filters` (warnings and logging state
restored on exit) and, for the warnings emitted while the package's modules are imported, when
the package is run as a program (``python -m megatron_fastpath.<module>``, see
:func:`filter_import_warnings`). Importing megatron_fastpath as a library changes no filter.

Imports nothing heavy: ``megatron_fastpath/__init__`` calls it before torch is imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import warnings

__all__ = ["OPTIONAL_PACKAGES", "absent_packages_line", "filter_import_warnings", "main_job_filters"]

# Importable name -> what Megatron / megatron_fastpath use it for.
OPTIONAL_PACKAGES = {
    "transformer_engine": "TE linears, attention, FP8",
    "apex": "fused norms and optimizers",
    "flash_attn": "flash attention backend",
}

PYNVML_WARNING = "The pynvml package is deprecated"  # torch/cuda/__init__.py at import
FALLBACK_WARNINGS = (  # megatron-core 0.16.x, one per module that falls back
    r"Transformer Engine and Apex are not installed\. Falling back",
    r"Apex is not installed\. Falling back",
)
# INFO lines about which optional packages Megatron found (Hydra logs INFO): WARNING and up only.
# matplotlib.font_manager: "generated new fontManager" (INFO) on the first plot of a fresh install;
# megatron.core.optimizer_param_scheduler: "> learning rate decay style: cosine" (INFO) at build
PACKAGE_INFO_LOGGERS = ("megatron.core.msc_utils", "megatron.core.distributed.fsdp", "matplotlib.font_manager",
                        "megatron.core.optimizer_param_scheduler")
UNKNOWN_MLP_LOGGER = "megatron.core.transformer.transformer_layer"
UNKNOWN_MLP_MESSAGE = "Unknown MLP type"
# logger -> the start of the one message the main job drops from it
DROPPED_LOG_MESSAGES = {
    UNKNOWN_MLP_LOGGER: UNKNOWN_MLP_MESSAGE,
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",  # megatron-core 0.19
}


def filter_import_warnings() -> None:
    """Hide the import-time warnings (torch's ``pynvml`` FutureWarning, Megatron's fallback
    warnings: importing the package's modules imports Megatron-Core) when megatron_fastpath is
    run as a program. Python sets ``sys.argv[0]`` to "-m" while it imports the packages of a
    ``-m`` module, so a library import (argv[0] is the program's path) changes nothing."""
    if sys.argv[:1] == ["-m"]:
        _add_filters()


def _add_filters() -> None:
    for message in FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    warnings.filterwarnings("ignore", message=PYNVML_WARNING, category=FutureWarning)


def absent_packages_line() -> str:
    """One line naming the optional packages that are not installed ('' when none is absent)."""
    absent = [f"{name} ({use})" for name, use in OPTIONAL_PACKAGES.items()
              if importlib.util.find_spec(name) is None]
    if not absent:
        return ""
    return ("megatron_fastpath: optional packages absent: " + ", ".join(absent)
            + "; Megatron-Core falls back to torch implementations (its per-module fallback "
            "warnings are not repeated)")


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def main_job_filters(rank0: bool = None):
    """The main job's filters (warnings state and the logging filter restored on exit); prints
    :func:`absent_packages_line` once (rank 0, from the launcher's RANK / SLURM_PROCID)."""
    if rank0 is None:
        rank0 = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    line = absent_packages_line()
    if rank0 and line:
        print(line, flush=True)
    drops = [(logging.getLogger(name), _DropMessage(prefix)) for name, prefix in DROPPED_LOG_MESSAGES.items()]
    with warnings.catch_warnings():
        _add_filters()
        for logger, drop in drops:
            logger.addFilter(drop)
        quiet = [logging.getLogger(name) for name in PACKAGE_INFO_LOGGERS]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(max(q.level, logging.WARNING))
        try:
            yield
        finally:
            for logger, drop in drops:
                logger.removeFilter(drop)
            for q, level in zip(quiet, levels):
                q.setLevel(level)
