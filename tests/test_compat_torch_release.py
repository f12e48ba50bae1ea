"""compat.TORCH_RELEASE: the one reading of the torch release that code branching on a torch
difference compares with (local build tags and pre-releases read as their release)."""

import torch

from megatron_fastpath import compat


def test_torch_release_reads_major_and_minor_of_any_build():
    assert compat.torch_release("2.11.0+cu130") == (2, 11)
    assert compat.torch_release("2.13.0+cpu") == (2, 13)
    assert compat.torch_release("2.12.0a0+git5d1c2e4") == (2, 12)
    assert compat.torch_release("2.8.0") < (2, 11) < compat.torch_release("2.13.1")


def test_torch_release_is_the_installed_torchs():
    major, minor = torch.__version__.split(".")[:2]
    assert compat.TORCH_RELEASE == (int(major), int(minor))
