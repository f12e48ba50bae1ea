"""Shared test fixtures: a one-process gloo group + Megatron parallel state on CPU, and the
`gpu` marker (tests that need CUDA are skipped, with the reason, on CPU machines)."""

import os
import sys

import pytest
import torch

# Test-only helpers (CUDA-as-CPU mode, CUDA-graph stand-in) are imported by name from every
# test folder; the package never imports them.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked `gpu`); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mcore_parallel():
    """Initialise torch.distributed (gloo, world 1) and Megatron's model-parallel state once."""
    from megatron_fastpath.distributed import init_distributed

    init_distributed(backend="gloo")
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def _fresh_moe_aux_loss_scale():
    """Megatron keeps the MoE aux-loss backward scale in a class attribute: a backward outside
    its schedules creates it 0-dim, and a later schedule's ``copy_`` of a [1] scale into it
    fails. Every test starts as a fresh process would."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    yield
