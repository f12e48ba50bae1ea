"""Checkpoints of the main job: resume, periodic / final / stop saves, preemption signals.

* :meth:`JobCheckpointer.resume` loads the latest complete checkpoint of ``checkpoint.dir``
  and returns the first step to run; the caller prints its line first. A checkpoint holds the
  job's parts (:mod:`megatron_fastpath.checkpoint.parts`), each under its own name: ``model``
  (tensors), ``optimizer`` (tensors, step, hyper-parameters), ``scheduler`` (the LR schedule) --
  :func:`~megatron_fastpath.checkpoint.training.training_parts` -- ``data``
  (:class:`DataPosition`) and ``history`` (the logger's
  :class:`~megatron_fastpath.train.history.RunHistory`); besides them the step and the RNGs.
* :meth:`JobCheckpointer.after_step` saves when due (every ``checkpoint.interval`` steps, at the
  last step, at ``training.stop_at_step``, after a SIGTERM / SIGUSR1) and says whether to stop.
* :class:`PreemptionSignals`: SIGTERM / SIGUSR1 only set a flag; the job finishes the current
  step, saves and exits with :data:`PREEMPTED_EXIT_CODE` (all ranks agree on the step). Ctrl-C
  (SIGINT) does the same, prints how to resume and exits with :data:`INTERRUPTED_EXIT_CODE`; a
  second Ctrl-C stops at once (Python's KeyboardInterrupt), without saving.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
from typing import Optional

import torch

__all__ = ["INTERRUPTED_EXIT_CODE", "PREEMPTED_EXIT_CODE", "PreemptionSignals", "JobCheckpointer",
           "DataPosition", "fingerprint_config"]

# Exit code of a job stopped by SIGTERM/SIGUSR1 after saving: "requeue me" (EX_TEMPFAIL).
PREEMPTED_EXIT_CODE = 75
# Exit code of a job stopped by Ctrl-C (SIGINT), saved or not: the shell's 128 + SIGINT.
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT


def _weights_only(group: str, settings: dict) -> dict:
    """``settings`` of ``group`` less those that do not change the trained weights
    (:data:`megatron_fastpath.settings.NOT_WEIGHT_SETTINGS`)."""
    from megatron_fastpath.settings import NOT_WEIGHT_SETTINGS

    return {k: v for k, v in settings.items() if f"{group}.{k}" not in NOT_WEIGHT_SETTINGS}


def fingerprint_config(cfg, dp_world: int) -> dict:
    """Settings a resumed run must share with the saved one: what changes the trained weights
    in the model, data, training and LoRA groups (not ``settings.NOT_WEIGHT_SETTINGS``). Not the
    layout (``parallel``, the data-parallel size: resharding keeps the global batch
    ``micro_batches * dp_world``), logging, offload or graphs (same math)."""
    training = _weights_only("training", dataclasses.asdict(cfg.training))
    if training["epochs"] is None:  # a run without epochs fingerprints as before they existed
        del training["epochs"]
    if training["lr_schedule"] == "cosine":  # checkpoints written without the key match
        del training["lr_schedule"]
    for key in ("batch_sequences", "batch_tokens"):  # resolved into micro_batches (data.resolve_batch)
        del training[key]
    training["global_micro_batches"] = training.pop("micro_batches") * dp_world
    data = _weights_only("data", dataclasses.asdict(cfg.data))
    for key, unset in (("columns", {}), ("overlong", None)):  # unset: as before these keys existed
        if key in data and data[key] == unset:
            del data[key]
    out = {
        "model": dataclasses.asdict(cfg.model), "data": data,
        "training": training, "moe_capacity_factor": cfg.fastpath.moe_capacity_factor,
        "lora": dataclasses.asdict(cfg.lora) if cfg.lora is not None else None,
    }
    return json.loads(json.dumps(out))  # tuples -> lists, as read back from JSON


# A fingerprint without data.pad_multiple is a checkpoint whose packing padded each sample to
# 2 x its parallel.context_parallel_size: it resumes at that CP size with that pad
# (may_differ), and the refusal of any other says so (CheckpointManager's hints).
PAD_MULTIPLE_HINTS = {"data.pad_multiple": (
    "a checkpoint without data.pad_multiple packed each sample padded to 2 x its "
    "parallel.context_parallel_size: resume it at that CP size with data.pad_multiple=2 x CP "
    "(2 at CP 1, 4 at CP 2)")}


def may_differ(steps: int, pad_is_2cp: bool = False):
    """``CheckpointManager``'s ``may_differ`` for a run of ``steps`` steps: the settings that do
    not change the weights (an older checkpoint's fingerprint may still hold them), the
    schedule (``settings.SCHEDULE_SETTINGS``) when the checkpoint is the end of its run and this
    run goes further (a finished run extended: the LR schedule is recomputed for the new total,
    the steps continue from the saved one; ``step.build_scheduler``), and ``data.pad_multiple``
    when the checkpoint's fingerprint lacks it and this run pads to 2 x its CP size
    (``pad_is_2cp``: :data:`PAD_MULTIPLE_HINTS`)."""
    from megatron_fastpath.settings import NOT_WEIGHT_SETTINGS, SCHEDULE_SETTINGS

    def keys(state: dict) -> set:
        saved_steps = ((state.get("config") or {}).get("training") or {}).get("steps")
        finished = saved_steps is not None and state.get("step") == saved_steps
        packed_by_cp = pad_is_2cp and "pad_multiple" not in ((state.get("config") or {}).get("data") or {})
        return (set(NOT_WEIGHT_SETTINGS) | (set(SCHEDULE_SETTINGS) if finished and steps > saved_steps else set())
                | ({"data.pad_multiple"} if packed_by_cp else set()))
    return keys


def announce_resume(cfg) -> Optional[str]:
    """Print (rank 0) and return the job's first line when ``checkpoint.dir`` is set: which
    checkpoint it resumes from. Reads only the raw config and the directory, so it runs before
    the config is parsed or anything is built (a bad config is still reported by the parser)."""
    import os

    from megatron_fastpath.checkpoint import CheckpointConfig, CheckpointManager

    directory = (cfg.get("checkpoint") or {}).get("dir")
    if directory is None:
        return None
    training = cfg.get("training") or {}
    from megatron_fastpath.train.config import planned_steps

    epochs = training.get("epochs")
    steps = planned_steps(training.get("steps"), epochs)
    latest = CheckpointManager(CheckpointConfig(dir=str(directory)), {}, log=lambda s: None)
    try:
        path = latest.latest()
        line = f"checkpoint: no checkpoint in {latest.root}, starting at step 1"
        if path is not None:
            with open(os.path.join(path, "train_state.json")) as f:
                state = json.load(f)
            done = state["step"]
            saved = (state.get("config") or {}).get("training") or {}
            line = (f"resuming from {path}: {done} of {steps} steps done, continuing at step {done + 1}"
                    if steps is None or done < steps else
                    f"resuming from {path}: all {steps} steps already done (nothing to train)")
            if steps is not None and done == saved.get("steps") and done < steps:
                line = (f"resuming from {path}: its run of {done} steps finished; training.steps="
                        f"{steps} extends it (the LR schedule recomputed for {steps} steps), "
                        f"continuing at step {done + 1}")
            if steps is None:  # training.epochs: the steps are known once the data is packed
                from megatron_fastpath.checkpoint.train_state import upgrade_train_state

                data = upgrade_train_state(state, path)["parts"].get("data") or {}
                line = (f"resuming from {path}: {done} steps of {epochs} epochs done, continuing at "
                        f"step {done + 1} (epoch {(data.get('epoch') or 0) + 1})"
                        if data.get("next_first_microbatch") is not None else
                        f"resuming from {path}: its run of {done} steps ({saved.get('epochs')} "
                        f"epochs) finished; training.epochs={epochs} extends it (the LR schedule "
                        f"recomputed for the new total), continuing at step {done + 1} (epoch "
                        f"{saved.get('epochs') + 1})"
                        if isinstance(saved.get("epochs"), int) and epochs > saved["epochs"] else
                        f"resuming from {path}: all {done} steps of {epochs} epochs already done "
                        "(nothing to train)")
    except (OSError, ValueError, KeyError, RuntimeError) as exc:  # RuntimeError: its format
        line = f"resuming from {latest.root}: its latest checkpoint is unreadable ({exc}); see below"
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(line, flush=True)
    return line


class Preempted(Exception):
    """A preemption signal arrived before the first step: nothing to save, requeue the job."""


class EarlySignals:
    """The main job's first act: SIGTERM / SIGUSR1 recorded from start-up on (instead of their
    default action, which kills the job with 143 / 138 and no requeue). The run's
    :class:`PreemptionSignals` takes a signal recorded before it existed; one recorded after the
    training loop is harmless (the work is saved)."""

    received: Optional[str] = None
    installed = False

    @classmethod
    def install(cls) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in PreemptionSignals.SIGNALS:
            signal.signal(sig, cls._handle)
        cls.installed, cls.received = True, None

    @classmethod
    def _handle(cls, signum, frame) -> None:
        cls.received = signal.Signals(signum).name

    @classmethod
    def release(cls) -> Optional[str]:
        """Back to the default actions (a run without checkpoints); the signal recorded so far."""
        if cls.installed and threading.current_thread() is threading.main_thread():
            for sig in PreemptionSignals.SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            cls.installed = False
        return cls.take()

    @classmethod
    def take(cls) -> Optional[str]:
        received, cls.received = cls.received, None
        return received


class PreemptionSignals:
    """SIGTERM / SIGUSR1 / SIGINT -> a flag (handlers restored by :meth:`close`); a signal the
    main job recorded before (:class:`EarlySignals`) counts as received. The first SIGINT gives
    SIGINT back to Python's KeyboardInterrupt: a second Ctrl-C stops at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
    STOPPING = (*SIGNALS, signal.SIGINT)  # what stops the run after a save

    def __init__(self):
        self.received: Optional[str] = EarlySignals.take()
        self._previous = {}
        self._group = None
        if threading.current_thread() is threading.main_thread():
            for sig in self.STOPPING:
                self._previous[sig] = signal.signal(sig, self._handle)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            gloo = torch.distributed.get_backend() == "gloo"
            self._group = None if gloo else torch.distributed.new_group(backend="gloo")
            self._multi = True
        else:
            self._multi = False

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name
        if signum == signal.SIGINT:  # the second Ctrl-C: KeyboardInterrupt, at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if _rank0():
                print("\ninterrupted (Ctrl-C): finishing this step and saving a checkpoint; "
                      "Ctrl-C again stops at once without saving", flush=True)

    def agreed(self) -> Optional[str]:
        """The signal any rank received (a CPU all-reduce over gloo: no device sync)."""
        if not self._multi:
            return self.received
        codes = [s.name for s in self.STOPPING]
        flag = torch.tensor([codes.index(self.received) + 1 if self.received else 0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return codes[int(flag) - 1] if int(flag) else None

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _rank0() -> bool:
    import os

    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


class DataPosition:
    """The ``data`` part of a checkpoint: where the data stands after ``step`` (microbatches and
    samples consumed; the next step's first microbatch: ``epoch`` -- 0-based, None without
    ``training.epochs`` -- and its index in that epoch's order, ``next_first_microbatch``).
    Loading it checks that this run's data continues there (with the same microbatches per
    step). A data part without ``epoch`` (written before epochs existed) is a run without them."""

    def __init__(self, data, steps: int):
        self.data, self.steps = data, steps  # the job's StepData, training.steps
        self.step = 0  # the last step done

    def _next(self, step: int) -> tuple:
        """(epoch, first microbatch) of the step after ``step``; (None, None) when done."""
        return self.data.position(step + 1) if step < self.steps else (None, None)

    def state_dict(self) -> dict:
        data, step = self.data, self.step
        epoch, nxt = self._next(step)
        return {"next_step": step + 1, "per_step": data.per_step, "consumed_microbatches":
                step * data.per_step, "consumed_samples": data.consumed_samples(step),
                "next_first_microbatch": nxt, "epoch": epoch}

    def load_state_dict(self, state: dict) -> None:
        step = state["next_step"] - 1
        epoch, expected = self._next(step)
        saved = (state.get("epoch"), state["next_first_microbatch"])
        if saved == (None, None):  # saved at the end of its run, which this run extends
            saved = (epoch, expected)
        if state["per_step"] == self.data.per_step and saved != (epoch, expected):
            from megatron_fastpath.checkpoint import CheckpointMismatchError

            raise CheckpointMismatchError(f"data position {state} does not match this run's "
                                          f"(epoch {epoch}, microbatch {expected})")
        self.step = step


class JobCheckpointer:
    """Checkpoints of one job (``job.cfg.checkpoint.dir`` set)."""

    def __init__(self, job, logger):
        from megatron_fastpath.checkpoint import CheckpointManager, training_parts

        self.job, self.logger, self.cfg = job, logger, job.cfg.checkpoint
        pad_is_2cp = job.cfg.data.pad_multiple == 2 * job.cfg.parallel.context_parallel_size
        self.manager = CheckpointManager(self.cfg, fingerprint_config(job.cfg, job.dp_world), log=logger.print,
                                         may_differ=may_differ(job.cfg.training.steps, pad_is_2cp),
                                         hints=PAD_MULTIPLE_HINTS)
        # every part, by the name it is saved under, in the order it loads
        self.data_position = DataPosition(job.data, job.cfg.training.steps)
        self.parts = {**training_parts(job.model, job.step.optimizer, job.step.scheduler, self.cfg.adapters_only,
                                       self.cfg.optimizer_format),
                      "data": self.data_position, "history": logger.history}
        self.signals = PreemptionSignals()
        self.resumed = None
        try:
            self.manager.lock()  # one writer per directory, before anything is read or written
            self.manager.check_free_space(self._checkpoint_bytes())
        except BaseException:
            self.close()
            raise

    def _checkpoint_bytes(self) -> int:
        """About how many bytes one checkpoint of this run takes: the newest one's, or this
        replica's saved parameters plus Adam's two fp32 moments (and an fp32 master copy when
        the parameters are not fp32) for the trainable ones."""
        from megatron_fastpath.checkpoint.files import _dir_bytes

        done = self.manager.complete_checkpoints()
        if done:
            return _dir_bytes(done[0])
        saved = trainable = 0
        for p in self.job.model.parameters():
            if p.requires_grad or not self.cfg.adapters_only:
                saved += p.numel() * p.element_size()
            if p.requires_grad:
                trainable += p.numel() * (8 + (4 if p.dtype != torch.float32 else 0))
        replicas = max(self.job.dp_world, 1)
        return (saved + trainable) * self.job.world // replicas

    def close(self) -> None:
        """Give the directory and the signal handlers back (also on error)."""
        self.signals.close()
        self.manager.unlock()

    # ------------------------------------------------------------------ start
    def load_base(self) -> Optional[str]:
        """Base weights (every non-adapter tensor) from ``checkpoint.base_dir``."""
        if self.cfg.base_dir is None:
            return None
        from megatron_fastpath.checkpoint import check_safe_to_load, is_adapter_key
        from megatron_fastpath.checkpoint.manager import _drop_objects
        from megatron_fastpath.checkpoint.storage import check_storage_files
        from megatron_fastpath.compat.dist_ckpt import dist_checkpointing_load

        check_storage_files(self.cfg.base_dir)  # no file outside it, no FIFO
        check_safe_to_load(self.cfg.base_dir)
        wanted = _drop_objects({k: v for k, v in self.job.model.sharded_state_dict().items()
                                if not is_adapter_key(k)})
        loaded = dist_checkpointing_load(wanted, self.cfg.base_dir)
        result = self.job.model.load_state_dict(loaded, strict=False)
        missing = [k for k in result.missing_keys if not (k.endswith("_extra_state") or is_adapter_key(k))]
        if missing:
            raise RuntimeError(f"checkpoint.base_dir lacks {missing[:10]}")
        return f"base weights from {self.cfg.base_dir}"

    def resume(self) -> int:
        """Load the latest complete checkpoint; returns the first step to run (1: fresh)."""
        base = self.load_base()
        resumed = self.manager.load(self.parts, self._restore_fp8())
        total = self.job.cfg.training.steps
        if base:
            self.logger.print(f"checkpoint: {base}")
        if resumed is None:
            return 1
        self.resumed = resumed
        data = resumed.parts["data"]
        epoch = "" if data.get("epoch") is None else f" of epoch {data['epoch'] + 1}"
        self.logger.print(
            f"  loaded {resumed.path}: {resumed.step} of {total} steps done, "
            f"{data['consumed_samples']} samples consumed, next microbatch "
            f"{data['next_first_microbatch']}{epoch}"
        )
        for note in resumed.notes:
            self.logger.print(f"  checkpoint: {note}")
        return resumed.step + 1

    def _restore_fp8(self):
        """Where the checkpoint's TE FP8 delayed-scaling state goes (None: no FP8 in this run)."""
        if not getattr(self.job.tcfg, "fp8", None):
            return None
        from megatron.core.fp8_utils import get_fp8_recipe

        from megatron_fastpath.fp8 import restore_fp8_state

        recipe = get_fp8_recipe(self.job.tcfg)
        return lambda tensors: restore_fp8_state(self.job.model, tensors, recipe)

    # ------------------------------------------------------------------ steps
    def after_step(self, step: int) -> Optional[str]:
        """Save if due; returns why to stop now (None: go on)."""
        for r in self.manager.poll(blocking=False):
            self._report(r, published=True)
        t = self.job.cfg.training
        sig = self.signals.agreed()
        if step == t.steps:  # the run is complete: a late signal changes nothing
            stop = None
        else:
            stop = f"signal {sig}" if sig else "stop_at_step" if step == t.stop_at_step else None
        due = stop or step == t.steps or (self.cfg.interval and step % self.cfg.interval == 0)
        if due:
            self.save(step)
        if stop == "signal SIGINT":
            self.logger.print(f"interrupted: step {step} saved in checkpoint.dir={self.cfg.dir}; "
                              f"rerun the same command to resume at step {step + 1}")
        return stop

    def save(self, step: int) -> None:
        self.logger.flush()  # the step's record (read one step late) goes into the checkpoint
        for r in self.manager.poll(blocking=True):  # one save in flight: wait for the previous
            self._report(r, published=True)
        self.data_position.step = step
        from megatron_fastpath.fp8 import collect_fp8_state

        fp8 = collect_fp8_state(self.job.model)
        with self.job.step.params_current():  # the step's parameters gathered (overlapped gather)
            self._report(self.manager.save(step, self.parts, fp8_state=fp8), published=False)

    def _report(self, r, published: bool) -> None:
        if r.is_async and not published:
            self.logger.print(f"checkpoint step {r.step}: async save blocked the step "
                              f"{r.blocking_s * 1e3:.1f} ms (staging), written in the background")
        elif r.is_async:
            self.logger.print(f"checkpoint step {r.step} -> {r.path}: {r.bytes:,} B published "
                              f"(async: step blocked {r.blocking_s * 1e3:.1f} ms, waits for the "
                              f"writer {r.wait_s * 1e3:.1f} ms)")
        else:
            self.logger.print(f"checkpoint step {r.step} -> {r.path}: {r.bytes:,} B, blocked "
                              f"the step {r.blocking_s * 1e3:.1f} ms (sync)")

    def finish(self, stopped: Optional[str] = None):
        """Wait for async saves; the checkpoints' report for the summary
        (:class:`~megatron_fastpath.checkpoint.report.CheckpointReport`). ``stopped``: why the
        run stopped before ``training.steps`` (None: it did not)."""
        from megatron_fastpath.checkpoint.report import CheckpointReport

        for r in self.manager.poll(blocking=True):
            self._report(r, published=True)
        self.close()
        return CheckpointReport.of(self.manager, stopped)
