"""A resume prints no FutureWarning: torch deprecates the ShardedTensors Megatron's torch_dist
load hands it (and, on megatron-core 0.16.x, its ``checkpoint.load_state_dict``) at every
tensor; the package's loads (compat.dist_ckpt.dist_checkpointing_load) ignore exactly those
messages from those modules, and every other warning of the load stays."""

import warnings

from tests.support.hydra_compose import compose_job

from megatron_fastpath.train import run

FAST = ["data.num_samples=64", "model.num_layers=1", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "data.max_tokens=128"]


def test_a_resume_warns_nothing_of_the_future(mcore_parallel, tmp_path):
    run(compose_job([*FAST, "training.steps=2", f"checkpoint.dir={tmp_path}"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run(compose_job([*FAST, "training.steps=3", f"checkpoint.dir={tmp_path}"]))
    assert summary.resumed_from.endswith("step_00000002") and summary.steps == 3
    future = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
              if issubclass(w.category, FutureWarning)]
    assert future == []


def test_only_those_warnings_are_ignored(mcore_parallel, monkeypatch):
    """The filter is narrow: the same message from another module, another FutureWarning of the
    same module, and the filters outside the load are untouched."""
    from megatron.core import dist_checkpointing

    from megatron_fastpath.compat.dist_ckpt import dist_checkpointing_load

    def warn_as(module, message):
        warnings.warn_explicit(message, FutureWarning, f"{module}.py", 1, module=module)

    def fake_load(sharded, directory):
        sharded_msg = "Please use DTensor instead and we are deprecating ShardedTensor."
        warn_as("torch.distributed.checkpoint.planner_helpers", sharded_msg)  # ignored
        warn_as("torch.distributed.checkpoint.default_planner", sharded_msg)  # ignored
        warn_as("megatron.core.dist_checkpointing.strategies.torch",  # ignored
                "`load_state_dict` is deprecated and will be removed in future versions. "
                "Please use `load` instead.")
        warn_as("my_code", sharded_msg)  # kept: another module
        warn_as("torch.distributed.checkpoint.planner_helpers", "something else")  # kept
        return {"loaded": directory}

    monkeypatch.setattr(dist_checkpointing, "load", fake_load)
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dist_checkpointing_load({}, "d") == {"loaded": "d"}
    assert [(w.filename, str(w.message)) for w in caught] == [
        ("my_code.py", "Please use DTensor instead and we are deprecating ShardedTensor."),
        ("torch.distributed.checkpoint.planner_helpers.py", "something else")]
    assert warnings.filters == before
