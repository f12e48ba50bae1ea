"""With CUDA graphs the RNG tracker is graph-safe (Megatron's ``CudaRNGStatesTracker(
use_cudagraphable_rng=True)`` or TE's): its states are ``torch.Generator`` objects, which a
captured graph registered. A checkpoint save called ``.cpu()`` on them (AttributeError at the
first save) and a restore handed byte tensors to a tracker whose ``fork()`` passes them to
``graphsafe_set_state``. The stand-in keeps that contract on CPU generators: its ``fork``
accepts Generators only (megatron/core/tensor_parallel/random.py ``_set_cuda_rng_state`` with
``graph_safe=True`` calls ``default_generator.graphsafe_set_state(new_state)``)."""

import json

import pytest
import torch

from megatron_fastpath.checkpoint.rng import capture_rng, restore_rng


class GraphSafeTrackerStandIn:
    """The parts of a graph-safe tracker capture/restore touch, with its contract."""

    def __init__(self):
        self.states_ = {"model-parallel-rng": torch.Generator().manual_seed(7),
                        "expert-parallel-rng": torch.Generator().manual_seed(8)}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        for name, state in states.items():
            if not isinstance(state, torch.Generator):
                raise TypeError(f"graphsafe_set_state takes a Generator, got {type(state).__name__} for {name}")
        self.states_ = states

    def draw(self, name):
        return torch.rand(4, generator=self.states_[name])


@pytest.fixture
def tracker(monkeypatch):
    from megatron.core.tensor_parallel import random as mrandom

    t = GraphSafeTrackerStandIn()
    monkeypatch.setattr(mrandom, "get_cuda_rng_tracker", lambda: t)
    return t


def test_graph_safe_tracker_states_round_trip_in_place(tracker):
    objects = dict(tracker.states_)
    saved = json.loads(json.dumps(capture_rng()))  # what the checkpoint holds
    expected = {name: tracker.draw(name) for name in objects}  # the draws after the save
    for name in objects:  # the run goes on: the generators advance
        tracker.draw(name)
    restore_rng(saved)
    for name, gen in objects.items():
        assert tracker.states_[name] is gen  # the very object a captured graph registered
        assert torch.equal(tracker.draw(name), expected[name])
