"""dist_checkpointing on a CPU, and its loads without torch's ShardedTensor deprecation warnings
(checkpoint/manager.py, train/checkpointing.py)."""

from __future__ import annotations


from megatron_fastpath.compat import MCORE_0_19, _require_checked_mcore


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
# (the flag is broadcast over gloo). With CUDA present it does nothing. 0.19.x makes the same
# two calls (0.19.2 strategies/filesystem_async.py:248, strategies/state_dict_saver.py:252).
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


# ---------------------------------------------------------------------------------------------
# torch's FutureWarnings inside a torch_dist load
#
# Megatron's torch_dist load (``TorchDistLoadShardedStrategy.load``, 0.16.1
# strategies/torch.py:770, 0.19.2 :924) wraps every tensor in a torch ``ShardedTensor``
# (``mcore_to_pyt_state_dict``, 0.16.1 :796, 0.19.2 :974) and hands them to
# torch.distributed.checkpoint, whose planner reads each one (torch 2.13
# distributed/checkpoint/planner_helpers.py:489 ``getattr(value, "device", None)``,
# default_planner.py:503 ``obj.size()``) through ``ShardedTensor.__torch_function__``, which
# torch deprecates with a FutureWarning at every call (distributed/_shard/sharded_tensor/api.py:
# 1203-1204, "Please use DTensor instead and we are deprecating ShardedTensor."). 0.16.x also
# loads with ``checkpoint.load_state_dict`` (0.16.1 strategies/torch.py:799), deprecated for
# ``load`` (torch distributed/checkpoint/state_dict_loader.py:31-35); 0.19.x calls ``load``
# (0.19.2 :979). No argument of ``dist_checkpointing.load`` chooses a load without ShardedTensor
# or (0.16.x) without ``load_state_dict``, so every resume printed these three warnings to the
# user, who can do nothing about them. ``dist_checkpointing_load`` ignores exactly these
# messages, from these modules, inside the call; every other warning stays.
# ---------------------------------------------------------------------------------------------

TORCH_DIST_LOAD_WARNINGS = (  # (message regex, module regex): FutureWarning only
    (r"Please use DTensor instead and we are deprecating ShardedTensor\.",
     r"torch\.distributed\.checkpoint\.(planner_helpers|default_planner)$"),
    (r"`load_state_dict` is deprecated and will be removed in future versions\.",
     r"megatron\.core\.dist_checkpointing\.strategies\.torch$"),
)


def dist_checkpointing_load(sharded_state_dict, checkpoint_dir: str):
    """``dist_checkpointing.load(sharded_state_dict, checkpoint_dir)`` on a CPU too (see
    :func:`dist_checkpointing_on_cpu`), without torch's deprecation warnings about the
    ShardedTensors Megatron's load makes (see the section above)."""
    import warnings

    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():
        for message, module in TORCH_DIST_LOAD_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)
        with dist_checkpointing_on_cpu():
            return dist_checkpointing.load(sharded_state_dict, checkpoint_dir)


# ---------------------------------------------------------------------------------------------
# Which async writer: Megatron's own
#
# 0.19.x's ``dist_checkpointing.save`` defaults to ``async_strategy="nvrx"`` (0.19.2
# dist_checkpointing/serialization.py:359), whose writer lives in nvidia-resiliency-ext
# (strategies/torch.py:1127 ``get_async_strategy`` imports it, and raises without it). Every
# shim here is for Megatron's own writer (``"mcore"``: strategies/filesystem_async.py,
# state_dict_saver.py), the only one 0.16.x has, so the save names it on 0.19.x (deprecated
# there with a warning, strategies/torch.py:746-751, still Megatron's).
# ---------------------------------------------------------------------------------------------


def dist_checkpointing_save_kwargs(version=None) -> dict:
    """Extra keywords for ``dist_checkpointing.save`` selecting Megatron's own async writer."""
    line = _require_checked_mcore(
        "dist_checkpointing_save_kwargs",
        "dist_checkpointing.save's async writer is Megatron's filesystem_async (0.16.x) or "
        "chosen by async_strategy (0.19.x)", version=version)
    return {"async_strategy": "mcore"} if line == MCORE_0_19 else {}


# ---------------------------------------------------------------------------------------------
# Where the common (non-sharded) state is stored
#
# 0.16.x writes it to ``common.pt``. 0.19.x writes it into the torch_dist files as one byte
# object, ``ShardedObject("common_state", ...)`` (0.19.2 dist_checkpointing/serialization.py:439),
# and ``load_common_state_dict`` reads it back through torch.distributed.checkpoint's default
# planner (:227-239), whose ``load_bytes`` unpickles with ``weights_only=False``. The checkpoint
# safety check (checkpoint/safety.py) lets that one entry through only after loading its exact
# bytes with ``weights_only=True``.
# ---------------------------------------------------------------------------------------------


def megatron_common_state_key(version=None):
    """The torch_dist key of the byte object holding Megatron's common state (0.19.x), or None
    where the common state is ``common.pt`` (0.16.x)."""
    line = _require_checked_mcore(
        "megatron_common_state_key",
        "the common state is common.pt (0.16.x) or the ShardedObject 'common_state' inside the "
        "torch_dist files (0.19.x, dist_checkpointing/serialization.py)", version=version)
    if line != MCORE_0_19:
        return None
    return "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key


# ---------------------------------------------------------------------------------------------
# The checkpoint writer's helper process under preemption
#
# Every torch_dist save (sync or async) hands its write results back through one queue served
# by a ``multiprocessing`` Manager that megatron-core 0.16.x starts on first use:
# ``_get_write_results_queue()`` sets the module global ``_results_queue = ctx.Manager().Queue()``
# with the spawn context (strategies/filesystem_async.py:48-56). That server process is in the
# job's process group with the default signal actions, so the SIGTERM / SIGUSR1 Slurm sends to
# the whole group (preemption, ``scancel --signal``) kills it: the main process, which only
# records the signal to save and exit 75, then fails in the save ("Connection refused" /
# "Broken pipe") and exits 1 with the save lost. And after a SIGKILL of the main process alone
# the server never exits (nothing in it watches its parent). ``preemption_proof_results_queue``
# installs that queue first, served by a Manager that ignores SIGINT / SIGTERM / SIGUSR1 (the
# main process decides what a signal means) and exits when its parent is gone; the resource
# tracker multiprocessing starts with it (which ignores SIGINT / SIGTERM itself) is started with
# SIGUSR1 blocked, which it keeps. Megatron then uses the installed queue as its own. Same in
# 0.19.x (0.19.2 strategies/filesystem_async.py:65), whose getter is public and takes the
# context's name: ``get_write_results_queue(mp_mode='spawn')`` (:53-66; :200 calls it).
# ---------------------------------------------------------------------------------------------

RESULTS_QUEUE_SITE = ("dist_checkpointing/strategies/filesystem_async.py",
                      "_results_queue = ctx.Manager().Queue()")
HELPER_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")


def results_queue_getter_name(version=None) -> str:
    """The name of megatron-core's own getter of that queue in ``strategies/filesystem_async``:
    ``_get_write_results_queue`` on 0.16.x (0.16.1 :51), ``get_write_results_queue`` on 0.19.x
    (0.19.2 :53)."""
    line = _require_checked_mcore(
        "results_queue_getter_name", f"the getter that sets {RESULTS_QUEUE_SITE[1]}", version=version)
    return "get_write_results_queue" if line == MCORE_0_19 else "_get_write_results_queue"
_helper_manager = None  # the Manager serving the installed queue (kept alive with the process)


def _writer_helper_init(parent_pid: int) -> None:
    """Runs first in the Manager's server process: preemption signals ignored, and the process
    ends when the job that started it is gone (its parent changes on a SIGKILL)."""
    import os
    import signal
    import threading
    import time

    for name in HELPER_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def preemption_proof_results_queue():
    """Install megatron-core's write-results queue (see the section above) unless one exists;
    returns the queue. Call before the first ``dist_checkpointing.save``."""
    import multiprocessing as mp
    import os
    import signal
    from multiprocessing import resource_tracker
    from multiprocessing.managers import SyncManager

    global _helper_manager
    _require_checked_mcore(
        "preemption_proof_results_queue",
        f"the module global set by {RESULTS_QUEUE_SITE[0]} ({RESULTS_QUEUE_SITE[1]})")
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return filesystem_async._results_queue
    blocked = {getattr(signal, n) for n in HELPER_SIGNALS}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:  # both children start with these blocked (the mask survives fork and exec)
        resource_tracker.ensure_running()
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=_writer_helper_init, initargs=(os.getpid(),))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    _helper_manager = manager
    filesystem_async._results_queue = manager.Queue()
    return filesystem_async._results_queue


def writer_helper_pid():
    """The pid of the installed queue's server process (None before the first save)."""
    return None if _helper_manager is None else _helper_manager._process.pid


def shutdown_writer_helper() -> None:
    """Stop the installed queue's server (it ignores SIGTERM, so ``terminate()`` would not):
    for a process that leaves with ``os._exit``, which skips the Manager's own finalizer."""
    global _helper_manager
    if _helper_manager is not None:
        _helper_manager.shutdown()
        _helper_manager = None
