"""What a resume compares: the settings that change the trained weights. Those in
settings.NOT_WEIGHT_SETTINGS (held-out evaluation, logging, where the job runs) leave the checkpoint
fingerprint, and an older checkpoint whose fingerprint holds them still resumes."""

import pytest

from tests.support.hydra_compose import compose_job


def fingerprint(*overrides):
    from megatron_fastpath.train import parse_job_config
    from megatron_fastpath.train.checkpointing import fingerprint_config

    # data=jsonl parses without reading its files (the tokenizer is read when the data is built)
    return fingerprint_config(parse_job_config(compose_job(
        ["training.steps=4", "data=jsonl", "data.path=chat.jsonl", "data.tokenizer_path=tok",
         *overrides])), dp_world=1)


def test_settings_that_do_not_change_the_weights_leave_the_fingerprint():
    base = fingerprint()
    assert fingerprint("data.eval_every=3", "data.eval_samples=2", "data.eval_max_new_tokens=8",
                       "data.cache=false", "training.log_all_ranks=true", "training.sync_check=off",
                       "training.skip_memory_check=true", "training.stop_at_step=2") == base
    assert "eval_every" not in base["data"] and "sync_check" not in base["training"]


@pytest.mark.parametrize("setting", ["data.eval_fraction=0.2", "training.lr=1e-3", "data.seed=7",
                                     "training.steps=5", "data.columns.text=body", "data.overlong=truncate",
                                     "data.eval_path=held.jsonl", "data.pad_multiple=16"])
def test_settings_that_change_the_weights_stay_in_it(setting):
    assert fingerprint(setting) != fingerprint()


def test_data_keys_left_unset_fingerprint_as_before_they_existed():
    """data.columns / data.overlong unset, and data.eval_path / data.cache_dir (not weights),
    leave the fingerprint: a checkpoint written before these keys existed still resumes."""
    base = fingerprint()
    assert not {"columns", "overlong", "eval_path", "cache_dir"} & set(base["data"])
    assert fingerprint("data.cache_dir=/tmp/elsewhere") == base
    assert fingerprint("data.columns.text=body")["data"]["columns"] == {"text": "body"}


def test_an_older_fingerprint_holding_them_is_no_mismatch():
    from megatron_fastpath.checkpoint.train_state import config_diff as _config_diff
    from megatron_fastpath.train.checkpointing import may_differ

    now = fingerprint()
    saved = {**now, "data": {**now["data"], "eval_every": 10, "eval_samples": 0},
             "training": {**now["training"], "skip_memory_check": False}}
    state = {"step": 2, "config": saved}
    assert _config_diff(saved, now, ignore=may_differ(4)(state)) == []
    # the schedule may differ only when the checkpoint ended its run and this one goes further
    longer = {**now, "training": {**now["training"], "steps": 6}}
    assert _config_diff(saved, longer, ignore=may_differ(6)(state)) == [
        "  config training.steps: saved 4, now 6"]
    assert _config_diff(saved, longer, ignore=may_differ(6)({"step": 4, "config": saved})) == []


def test_the_context_parallel_size_leaves_the_fingerprint():
    """CP is a layout (the packing is data.pad_multiple's at every CP size whose 2 x CP divides
    it): a checkpoint resumes at another CP size (tests/train/test_context_parallel_torchrun.py)."""
    assert fingerprint("parallel.context_parallel_size=2") == fingerprint()
    assert fingerprint()["data"]["pad_multiple"] == 8


def test_a_fingerprint_without_pad_multiple_resumes_at_2cp_only():
    """A checkpoint whose fingerprint lacks data.pad_multiple packed every sample padded to 2 x
    its CP size: it resumes with data.pad_multiple=2 x CP (``pad_is_2cp``); at any other pad
    the mismatch names the fix."""
    from megatron_fastpath.checkpoint.train_state import config_diff
    from megatron_fastpath.train.checkpointing import PAD_MULTIPLE_HINTS, may_differ

    at2 = fingerprint("data.pad_multiple=2")
    saved = {**at2, "data": {k: v for k, v in at2["data"].items() if k != "pad_multiple"}}
    state = {"step": 2, "config": saved}
    assert config_diff(saved, at2, ignore=may_differ(4, pad_is_2cp=True)(state),
                       hints=PAD_MULTIPLE_HINTS) == []
    now = fingerprint()
    assert config_diff(saved, now, ignore=may_differ(4, pad_is_2cp=False)(state), hints=PAD_MULTIPLE_HINTS) == [
        "  config data.pad_multiple: saved '<absent>', now 8",
        "  data.pad_multiple: a checkpoint without data.pad_multiple packed each sample padded to 2 x "
        "its parallel.context_parallel_size: resume it at that CP size with data.pad_multiple=2 x CP "
        "(2 at CP 1, 4 at CP 2)"]
    # a checkpoint that holds it compares it as any setting
    assert config_diff(now, at2, ignore=may_differ(4, pad_is_2cp=True)({"step": 2, "config": now}),
                       hints=PAD_MULTIPLE_HINTS) == ["  config data.pad_multiple: saved 8, now 2"]
