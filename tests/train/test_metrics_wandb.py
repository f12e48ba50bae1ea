"""W&B: the run records the whole job configuration and every step's scalars, in the mode the
config asks (offline by default, online allowed). wandb's offline files are read only by its
Go core, so a stand-in module records the calls the writer makes (``wandb.init`` with
project/mode/dir/config/reinit, ``run.log(scalars, step=)``, ``run.dir``, ``run.finish()``:
the wandb 0.19-0.31 API)."""

import sys
import types

import pytest
from tests.support.hydra_compose import compose_job

from megatron_fastpath.train import run


class _Run:
    def __init__(self, **kw):
        self.kw, self.logged, self.finished, self.dir = kw, [], False, kw["dir"]

    def log(self, scalars, step):
        self.logged.append((step, dict(scalars)))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    runs = []
    mod = types.ModuleType("wandb")
    mod.init = lambda **kw: runs.append(_Run(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return runs


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_wandb_run_has_config_and_every_step(mcore_parallel, tmp_path, fake_wandb, mode):
    cfg = compose_job([
        "training.steps=3", "data.num_samples=64", "model.num_layers=1", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "data.max_tokens=128", "training.lr=0.002",
        f"metrics.dir={tmp_path}", "metrics.wandb=on", f"metrics.wandb_mode={mode}",
        "metrics.tensorboard=false", "metrics.plot=false"])
    summary = run(cfg)
    (wb,) = fake_wandb
    assert wb.kw["mode"] == mode and wb.kw["dir"] == str(tmp_path) and wb.finished
    conf = wb.kw["config"]
    assert conf["training"]["lr"] == 0.002 and conf["training"]["steps"] == 3
    assert conf["model"]["hidden_size"] == 32 and conf["metrics"]["wandb_mode"] == mode
    steps = [(s, v) for s, v in wb.logged if "train/loss" in v]
    assert [s for s, _ in steps] == [1, 2, 3]
    assert [v["train/loss"] for _, v in steps] == [r.loss for r in summary.records]
    assert summary.artifacts["wandb"] == str(tmp_path)


def test_wandb_mode_is_checked_at_parse():
    from megatron_fastpath.train.metrics import MetricsConfig

    with pytest.raises(ValueError, match="metrics.wandb_mode must be offline or online; got 'cloud'"):
        MetricsConfig(wandb_mode="cloud")


def test_a_dead_wandb_service_turns_wandb_off_and_training_goes_on(mcore_parallel, tmp_path,
                                                                  monkeypatch, capsys):
    """Slurm's preemption signal reaches every process of the job step, W&B's service too; the
    next ``run.log`` then raises (wandb 0.31: ``ConnectionResetError: Connection lost`` from
    service_client.py). Seen on the local Slurm cluster: the job exited 1 instead of saving."""
    class _Dying(_Run):
        def log(self, scalars, step):
            if step >= 2:
                raise ConnectionResetError("Connection lost")
            super().log(scalars, step)

        def finish(self):
            raise AssertionError("finish() called on a run whose service is gone")

    runs = []
    mod = types.ModuleType("wandb")
    mod.init = lambda **kw: runs.append(_Dying(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", mod)
    cfg = compose_job([
        "training.steps=4", "data.num_samples=64", "model.num_layers=1", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "data.max_tokens=128", f"metrics.dir={tmp_path}",
        "metrics.wandb=on", "metrics.plot=false"])
    summary = run(cfg)
    assert [r.step for r in summary.records] == [1, 2, 3, 4]
    assert [s for s, v in runs[0].logged if "train/loss" in v] == [1]
    out = capsys.readouterr().out
    assert out.count("W&B stopped at log() (ConnectionResetError: Connection lost)") == 1
    assert "step    4/4" in (tmp_path / "train.log").read_text()
