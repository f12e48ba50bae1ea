"""Metrics of the main job: TensorBoard event files, Weights & Biases when installed (offline
by default),
and a PNG of the loss curves at the end of a run.

:class:`MetricsWriter` receives every finished :class:`~megatron_fastpath.train.logger.StepRecord`
(host values: the logger reads device values back one step late) and every held-out loss.
Scalars per step: ``train/loss``, ``train/lr``, ``train/tokens_per_s``, ``train/grad_norm``,
``train/host_syncs_step``, ``train/host_syncs_fwd_bwd``, ``eval/loss``. Only global rank 0
writes. The greedy completions of held-out prompts (``data.eval_samples``) go to
``eval_samples.jsonl``, one JSON object per sample and evaluation. Every backend is optional: TensorBoard needs ``tensorboard`` (``torch.utils.tensorboard``
writes the files), the plot ``matplotlib``; a missing one is reported once in the notes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megatron_fastpath.settings import setting

__all__ = ["MetricsConfig", "MetricsWriter", "jsonable", "plot_losses"]


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """The ``metrics`` group. The W&B run records the whole job configuration and every step's
    scalars."""

    dir: Optional[str] = setting(
        None, "where event files, the W&B offline run and loss_curves.png go; null: the Hydra run "
        "directory when launched from the command line")
    tensorboard: bool = setting(True, "write TensorBoard event files")
    wandb: str = setting("auto", "Weights & Biases: auto (a run when wandb is installed) | on (wandb required) | off")
    wandb_mode: str = setting(
        "offline", "offline (files under dir, wandb sync later) | online (needs wandb login or WANDB_API_KEY)")
    plot: bool = setting(True, "write loss_curves.png at the end")
    project: str = setting("megatron_fastpath", "the W&B project")

    def __post_init__(self):
        if self.wandb not in ("auto", "on", "off"):
            raise ValueError(f"metrics.wandb must be auto, on or off; got {self.wandb!r}")
        if self.wandb_mode not in ("offline", "online"):
            raise ValueError(f"metrics.wandb_mode must be offline or online; got {self.wandb_mode!r}")


def _hydra_run_dir() -> Optional[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return HydraConfig.get().runtime.output_dir
    except Exception:  # noqa: BLE001 - no Hydra run: nothing to default to
        return None
    return None


class MetricsWriter:
    """Fan-out of step records and eval losses to the enabled backends (rank 0 only)."""

    def __init__(self, cfg: MetricsConfig, rank: int, run_config: Optional[dict] = None):
        self.cfg, self.notes = cfg, []
        self.dir = cfg.dir or _hydra_run_dir()
        self.tb = self.wandb = self.log_file = None
        self.samples_path = None  # eval_samples.jsonl once a sample was written
        self.steps, self.evals = [], []
        if rank != 0 or self.dir is None:
            self.dir = None
            return
        os.makedirs(self.dir, exist_ok=True)
        # the printed lines (header, steps, summary), as the console shows them; beside Hydra's
        # own log records when the directory is the Hydra run directory (both append)
        self.log_file = open(os.path.join(self.dir, "train.log"), "a", encoding="utf-8")
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=os.path.join(self.dir, "tensorboard"))
            except ImportError as exc:
                self.notes.append(f"TensorBoard not written ({exc}); pip install tensorboard")
        if cfg.wandb != "off":
            self._init_wandb(run_config or {})

    def _init_wandb(self, run_config: dict) -> None:
        try:
            import wandb
        except ImportError:
            if self.cfg.wandb == "on":
                raise
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb = wandb.init(project=self.cfg.project, mode=self.cfg.wandb_mode, dir=self.dir,
                                config=run_config, reinit=True)

    def step(self, rec) -> None:
        if self.dir is None:
            return
        grad_norm = getattr(rec, "grad_norm", None)
        scalars = {"train/loss": rec.loss, "train/lr": rec.lr, "train/tokens_per_s": rec.tokens_per_s}
        if rec.syncs_step is not None:  # counted steps only (training.sync_check)
            scalars.update({"train/host_syncs_step": rec.syncs_step,
                            "train/host_syncs_fwd_bwd": rec.syncs_fwd_bwd})
        if grad_norm is not None:
            scalars["train/grad_norm"] = grad_norm
        self.steps.append((rec.step, rec.loss))
        self._write(scalars, rec.step)

    def text(self, text: str) -> None:
        """A printed line (or lines) into ``train.log``."""
        if self.log_file is not None:
            self.log_file.write(text + "\n")
            self.log_file.flush()

    def eval(self, step: int, loss: float, token_accuracy: Optional[float] = None) -> None:
        if self.dir is None:
            return
        from megatron_fastpath.train.evaluate import perplexity

        self.evals.append((step, loss))
        scalars = {"eval/loss": loss, "eval/perplexity": perplexity(loss)}
        if token_accuracy is not None:
            scalars["eval/token_accuracy"] = token_accuracy
        self._write(scalars, step)

    def samples(self, step: int, samples: tuple) -> None:
        """Append the evaluation's :class:`~megatron_fastpath.train.evaluate.EvalSample` s to
        ``eval_samples.jsonl``: step, index, prompt, completion, reference, the token ids and
        why the completion stopped."""
        if self.dir is None:
            return
        import json

        self.samples_path = os.path.join(self.dir, "eval_samples.jsonl")
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for s in samples:
                f.write(json.dumps(dict(step=step, index=s.index, prompt=s.prompt,
                                        completion=s.completion, reference=s.reference,
                                        stop=s.stop, prompt_ids=list(s.prompt_ids),
                                        completion_ids=list(s.completion_ids)),
                                   ensure_ascii=False) + "\n")

    def _write(self, scalars: dict, step: int) -> None:
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        self._wandb_call("log", scalars, step=step)

    def _wandb_call(self, method: str, *args, **kwargs) -> None:
        """A call into the W&B run; when its service process is gone (a preemption signal to
        every process of the job kills it: Slurm signals the whole step), W&B is turned off for
        the rest of the run with a note, and training, the other backends and the checkpoint
        go on (the offline files keep what was logged until then)."""
        if self.wandb is None:
            return
        try:
            getattr(self.wandb, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of the W&B client
            self.wandb = None
            self.notes.append(f"W&B stopped at {method}() ({type(exc).__name__}: {exc}); "
                              "its service process ended, e.g. signalled with the job: "
                              "later steps are in train.log and TensorBoard only")

    def close_log(self) -> None:
        """Close ``train.log`` (after the summary, the last lines printed)."""
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None

    def close(self, steps: Optional[list] = None, evals: Optional[list] = None) -> dict:
        """Flush and close the backends (``train.log`` stays open for the summary: see
        :meth:`close_log`); write the loss-curve PNG of ``steps`` ((step, loss)) and ``evals``
        ((step, held-out loss)) -- the logger passes the whole run's, a resumed run's earlier
        steps included; None: what this writer received. Returns {kind: path} of what was
        written."""
        steps = self.steps if steps is None else steps
        evals = self.evals if evals is None else evals
        out = {}
        if self.dir is None:
            return out
        if self.tb is not None:
            self.tb.close()
            out["tensorboard"] = os.path.join(self.dir, "tensorboard")
        if self.wandb is not None:
            out["wandb"] = self.wandb.dir
            self._wandb_call("finish")
        if self.log_file is not None:
            out["log"] = self.log_file.name
        if self.samples_path is not None:
            out["eval_samples"] = self.samples_path
        if self.cfg.plot and steps:
            path = os.path.join(self.dir, "loss_curves.png")
            try:
                plot_losses(steps, evals, path)
                out["plot"] = path
            except ImportError as exc:
                self.notes.append(f"loss curves not plotted ({exc}); pip install matplotlib")
        return out


def jsonable(obj):
    """A configuration tree (dataclasses, enums, devices, dtypes, tuples) as JSON values, for
    the W&B run's config (without the fields marked ``metadata={"setting": False}``: the
    ``JobConfig.facts`` the rules read)."""
    import enum

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.metadata.get("setting", True)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return jsonable(obj.value)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def plot_losses(steps: list, evals: list, path: str) -> None:
    """Train loss per step and held-out loss per evaluation, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot([s for s, _ in steps], [v for _, v in steps], label="train loss", lw=1)
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="eval loss (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss per loss token")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
