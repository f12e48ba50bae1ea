"""Shared test fixtures: a one-process gloo group + Megatron parallel state on CPU, and the
`gpu` marker (tests that need CUDA are skipped, with the reason, on CPU machines)."""

import os

import pytest
import torch


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
