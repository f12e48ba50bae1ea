"""An in-process run gives the caller's SIGTERM / SIGINT handlers back, whether it returns or
raises (a library caller's handlers are not the job's to keep)."""

import fcntl
import os
import signal

import pytest

from tests.support.hydra_compose import compose_job

FAST = ["training.steps=2", "data.num_samples=64", "model.num_layers=1", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "data.max_tokens=128", "data.max_len=48",
        "metrics.tensorboard=false", "metrics.wandb=off", "metrics.plot=false"]


def _mine(signum, frame):  # the caller's handler
    pass


@pytest.fixture
def callers_handlers():
    before = {s: signal.signal(s, _mine) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in before.items():
        signal.signal(s, h)


def handlers():
    return {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}


def test_handlers_are_given_back_after_a_run_with_checkpoints(mcore_parallel, callers_handlers, tmp_path):
    from megatron_fastpath.train import run

    before = handlers()
    summary = run(compose_job([*FAST, f"checkpoint.dir={tmp_path / 'ckpt'}"]), announce=False)
    assert summary.steps == 2
    assert handlers() == before and before[signal.SIGINT] is _mine


def test_handlers_are_given_back_when_the_run_raises(mcore_parallel, callers_handlers, tmp_path):
    from megatron_fastpath.checkpoint import CheckpointError
    from megatron_fastpath.train import run

    d = tmp_path / "ckpt"
    d.mkdir()
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another job holds the directory
    before = handlers()
    try:
        with pytest.raises(CheckpointError, match="is in use by"):
            run(compose_job([*FAST, f"checkpoint.dir={d}"]), announce=False)
    finally:
        os.close(fd)
    assert handlers() == before
