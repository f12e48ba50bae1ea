"""graphs/resume.py: a resumed run with per-layer graphs and FP8 delayed scaling records and
captures its graphs on a forward/backward of its first batch whose effects are undone, so its
first step replays as the straight run's does (before: eager, and the FP8 amax histories, with
LoRA the adapters, ended different; all 234 such combinations of the feature matrix resumed
bit for bit when this was added; CI trains 78 of them, in 59 runs, tests/train/test_feature_matrix.py).
Here: when it runs, and that what the recording pass
touches comes back -- model buffers in place, every RNG (the graph-safe tracker's generators
the same objects)."""

import types

import pytest
import torch

from megatron_fastpath.graphs.resume import capture_before_resumed_step, capture_needed_on_resume


@pytest.fixture
def tracker(monkeypatch):
    """A graph-safe RNG tracker's states: torch.Generator objects a captured graph registered
    (restore_rng puts states back into them in place)."""
    from megatron.core.tensor_parallel import random as mrandom

    t = types.SimpleNamespace(states_={"model-parallel-rng": torch.Generator().manual_seed(7),
                                       "expert-parallel-rng": torch.Generator().manual_seed(8)})
    t.get_states = lambda: dict(t.states_)

    def set_states(states):  # graphsafe_set_state takes Generators only (tensor_parallel/random.py)
        assert all(isinstance(g, torch.Generator) for g in states.values()), states
        t.states_.update(states)

    t.set_states = set_states
    t.draw = lambda name: torch.rand(4, generator=t.states_[name])
    monkeypatch.setattr(mrandom, "get_cuda_rng_tracker", lambda: t)
    return t


def job_cfg(capture=True, full_iteration=False, recipe="delayed"):
    return types.SimpleNamespace(
        plan=types.SimpleNamespace(capture=capture, full_iteration=full_iteration),
        fp8=None if recipe is None else types.SimpleNamespace(recipe=recipe))


@pytest.mark.parametrize("capture,full,recipe,needed", [
    (True, False, "delayed", True),
    (True, False, "tensorwise", False),  # no amax history: eager and replay update nothing apart
    (True, False, "mxfp8", False),
    (True, False, None, False),
    (True, True, "delayed", False),  # full-iteration graphs: not Megatron's per-layer record
    (False, False, "delayed", False),  # CPU: the audit, no capture
])
def test_needed_only_for_captured_layers_with_delayed_scaling(capture, full, recipe, needed):
    assert capture_needed_on_resume(job_cfg(capture, full, recipe)) is needed


class Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(4))
        self.register_buffer("local_tokens_per_expert", torch.zeros(4), persistent=False)
        self.weight = torch.nn.Parameter(torch.ones(4))


def stand_in_job(record, cfg=None, offload=None):
    model = torch.nn.Sequential(Router())
    return types.SimpleNamespace(cfg=cfg or job_cfg(), model=model, tcfg=None, offload=offload,
                                 step=types.SimpleNamespace(record_graphs=record))


def test_what_the_recording_pass_touches_comes_back(tracker):
    batch = types.SimpleNamespace(microbatches=("mb",), global_loss_tokens=7)
    calls = []

    def record(mbs, tokens):  # what Megatron's schedule does to the state: counts, bias, draws
        calls.append((mbs, tokens))
        router = job.model[0]
        router.local_tokens_per_expert += 3
        router.expert_bias.add_(0.5)
        torch.rand(3)
        for name in tracker.states_:
            tracker.draw(name)

    job = stand_in_job(record)
    router = job.model[0]
    router.expert_bias.fill_(0.25)
    buffers = {n: b for n, b in job.model.named_buffers()}
    generators = dict(tracker.states_)
    expected_cpu = torch.get_rng_state()
    expected_draws = {name: torch.rand(4, generator=torch.Generator().set_state(g.get_state()))
                      for name, g in generators.items()}
    weight = router.weight.detach().clone()

    assert capture_before_resumed_step(job, batch) is True
    assert calls == [(("mb",), 7)]
    assert all(b is buffers[n] for n, b in job.model.named_buffers())  # in place: graphs read them
    assert torch.equal(router.expert_bias, torch.full((4,), 0.25))
    assert torch.equal(router.local_tokens_per_expert, torch.zeros(4))
    assert torch.equal(torch.get_rng_state(), expected_cpu)
    for name, gen in generators.items():
        assert tracker.states_[name] is gen
        assert torch.equal(tracker.draw(name), expected_draws[name])
    assert torch.equal(router.weight, weight)


def test_offload_step_brackets_the_recording_pass_also_when_it_raises():
    events = []
    offload = types.SimpleNamespace(begin_step=lambda: events.append("begin"),
                                    end_step=lambda: events.append("end"))

    def record(mbs, tokens):
        events.append("record")
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        capture_before_resumed_step(stand_in_job(record, offload=offload),
                                    types.SimpleNamespace(microbatches=(), global_loss_tokens=1))
    assert events == ["begin", "record", "end"]


@pytest.mark.parametrize("cfg,record", [(job_cfg(recipe="tensorwise"), lambda *a: pytest.fail("ran")),
                                        (job_cfg(), None)])  # the CPU step path: no schedule
def test_nothing_runs_where_it_is_not_needed(cfg, record):
    job = stand_in_job(record, cfg=cfg)
    assert capture_before_resumed_step(job, types.SimpleNamespace(microbatches=(), global_loss_tokens=1)) is False
