"""Fixtures of the Hugging Face tests."""

import pytest


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(family, shard=False) -> (path, transformers model)``: a tiny random
    checkpoint of a ``tests/hf/hf_reference.py`` family (``shard``: in several safetensors
    files), written once per module."""
    from tests.hf.hf_reference import make_checkpoint

    made = {}

    def get(family, shard=False):
        key = (family, shard)
        if key not in made:
            path = str(tmp_path_factory.mktemp(f"{family}{'_sharded' if shard else ''}"))
            made[key] = (path, make_checkpoint(family, path, shard=shard))
        return made[key]

    return get
