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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama checkpoint (examples/make_tiny_hf_llama.py, tokenizer trained on
    ``hf_reference.DATA``), written once per module."""
    import make_tiny_hf_llama

    from tests.hf.hf_reference import DATA

    path = str(tmp_path_factory.mktemp("tiny") / "ckpt")
    make_tiny_hf_llama.main(path, DATA)
    return path
