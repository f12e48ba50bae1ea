"""TE FP8 delayed-scaling state in checkpoints: saved per rank as safetensors (not TE's pickled
``_extra_state``) and restored through TE's own ``init_fp8_meta_tensors`` /
``reset_fp8_meta_tensors``. Transformer Engine does not run here: ``StandInTEModule`` follows
TE 2.x's contract for what the checkpoint touches (transformer_engine/pytorch/module/base.py:
``fp8_meta["scaling_fwd" / "scaling_bwd"]`` recipe states with ``scale`` [3 * num_gemms] /
``amax_history`` [len, 3 * num_gemms] (2 * num_gemms backward), ``set_meta_tensor`` keeping an
initialised delayed-scaling state, ``reset_fp8_meta_tensors`` copying in place)."""

import os
import types

import pytest
import torch

from tests.checkpoint.ckpt_harness import Run
from megatron_fastpath.fp8 import collect_fp8_state, restore_fp8_state


class DelayedRecipe:
    def __init__(self, amax_history_len=16):
        self.amax_history_len = amax_history_len

    def delayed(self):
        return True


class CurrentScalingRecipe:
    def delayed(self):
        return False


class StandInTEModule(torch.nn.Module):
    def __init__(self, num_gemms=1, legacy_reset=False):
        super().__init__()
        self.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}
        self.fp8_meta_tensors_initialized = False
        self._num_gemms = num_gemms
        self.init_calls = []
        if legacy_reset:  # TE 1.x: reset_fp8_meta_tensors(self) without the tensors argument
            self.reset_fp8_meta_tensors = lambda: None

    def set_meta_tensor(self, fwd, recipe):
        key = "scaling_fwd" if fwd else "scaling_bwd"
        if self.fp8_meta_tensors_initialized and recipe.delayed():
            return  # TE: an initialised delayed-scaling state is kept
        n = self.fp8_meta["num_gemms"] * (3 if fwd else 2)
        self.fp8_meta[key] = types.SimpleNamespace(
            scale=torch.ones(n), amax_history=torch.zeros(recipe.amax_history_len, n))

    def init_fp8_meta_tensors(self, recipe):
        self.init_calls.append((recipe, self.fp8_meta.get("num_gemms")))
        self.set_meta_tensor(True, recipe)
        self.set_meta_tensor(False, recipe)
        self.fp8_meta_tensors_initialized = True

    def reset_fp8_meta_tensors(self, fp8_meta_tensors=None):
        for key in ("scaling_fwd", "scaling_bwd"):
            if key in self.fp8_meta:
                self.fp8_meta[key].scale.copy_(fp8_meta_tensors[key][0])
                self.fp8_meta[key].amax_history.copy_(fp8_meta_tensors[key][1])

    def after_steps(self, seed):
        """What some FP8 training steps leave: a run's own scales and amax history."""
        self.fp8_meta["num_gemms"] = self._num_gemms
        self.init_fp8_meta_tensors(DelayedRecipe())
        g = torch.Generator().manual_seed(seed)
        for s in (self.fp8_meta["scaling_fwd"], self.fp8_meta["scaling_bwd"]):
            s.scale.copy_(torch.rand(s.scale.shape, generator=g) * 100)
            s.amax_history.copy_(torch.rand(s.amax_history.shape, generator=g))
        return self


class _Forwarding(torch.nn.Module):
    """Forwards unknown attribute reads to the wrapped module, as LoRALinear does."""

    def __init__(self, base):
        super().__init__()
        self.base = base

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)


def _state(m):
    return [getattr(m.fp8_meta[k], f).clone() for k in ("scaling_fwd", "scaling_bwd")
            for f in ("scale", "amax_history")]


def _with_te(run, modules):
    for name, m in modules.items():
        run.model.add_module(name, m)
    return run


def test_collect_takes_delayed_scaling_modules_only():
    model = torch.nn.Module()
    model.add_module("a", StandInTEModule(num_gemms=2).after_steps(0))
    model.add_module("fresh", StandInTEModule())  # no FP8 forward yet: nothing to save
    stateless = StandInTEModule()
    stateless.fp8_meta.update(scaling_fwd=types.SimpleNamespace(scale=None), scaling_bwd=None)
    stateless.fp8_meta_tensors_initialized = True  # e.g. MXFP8: no amax history
    model.add_module("stateless", stateless)
    model.add_module("wrapper", _Forwarding(StandInTEModule().after_steps(1)))  # as LoRALinear
    state = collect_fp8_state(model)
    assert sorted(state) == ["a.amax_history_bwd", "a.amax_history_fwd", "a.scale_bwd", "a.scale_fwd",
                             "wrapper.base.amax_history_bwd", "wrapper.base.amax_history_fwd",
                             "wrapper.base.scale_bwd", "wrapper.base.scale_fwd"]
    assert state["a.scale_fwd"].shape == (6,) and state["a.amax_history_bwd"].shape == (16, 4)


def test_round_trip_through_the_checkpoint(mcore_parallel, tmp_path):
    saved = _with_te(Run().train(1), {"te_a": StandInTEModule(2).after_steps(1),
                                     "te_b": StandInTEModule(1).after_steps(2)})
    mgr, parts = saved.manager(tmp_path)
    mgr.save(1, parts, fp8_state=collect_fp8_state(saved.model))
    step_dir = os.path.join(tmp_path, "step_00000001")
    assert os.listdir(os.path.join(step_dir, "fp8")) == ["rank_00000.safetensors"]
    with open(os.path.join(step_dir, "manifest.json")) as f:
        assert "fp8/rank_00000.safetensors" in f.read()  # CRC-checked like every file

    fresh = _with_te(Run(seed=3), {"te_a": StandInTEModule(), "te_b": StandInTEModule()})
    recipe = DelayedRecipe()
    mgr, parts = fresh.manager(tmp_path)
    resumed = mgr.load(parts, lambda t: restore_fp8_state(fresh.model, t, recipe))
    assert "FP8 scaling history restored for 2 Transformer Engine modules" in resumed.notes
    for name in ("te_a", "te_b"):
        a, b = getattr(saved.model, name), getattr(fresh.model, name)
        assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))
        assert b.init_calls == [(recipe, a._num_gemms)]  # TE allocated it for the run's recipe
        b.init_fp8_meta_tensors(recipe)  # the first FP8 forward keeps what was loaded
        assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))


def test_other_layout_is_not_restored_and_says_so(mcore_parallel, tmp_path, monkeypatch):
    import megatron_fastpath.fp8.state as fp8_state

    saved = _with_te(Run().train(1), {"te": StandInTEModule().after_steps(1)})
    mgr, parts = saved.manager(tmp_path)
    mgr.save(1, parts, fp8_state=collect_fp8_state(saved.model))
    monkeypatch.setattr(fp8_state, "layout", lambda: "world=2 tp=1 pp=1 ep=2")
    fresh = _with_te(Run(), {"te": StandInTEModule()})
    mgr, parts = fresh.manager(tmp_path)
    resumed = mgr.load(parts, lambda t: restore_fp8_state(fresh.model, t, DelayedRecipe()))
    assert any(n.startswith("FP8 scaling history not restored: saved at world=1") for n in resumed.notes)
    assert not fresh.model.te.fp8_meta_tensors_initialized


def test_restore_refuses_old_te_stateless_recipe_and_unknown_modules():
    state = collect_fp8_state(_holder(StandInTEModule().after_steps(0)))
    with pytest.raises(RuntimeError, match="predates 2.0"):
        restore_fp8_state(_holder(StandInTEModule(legacy_reset=True)), state, DelayedRecipe())
    with pytest.raises(ValueError, match="resume with fp8.recipe=delayed"):
        restore_fp8_state(_holder(StandInTEModule()), state, CurrentScalingRecipe())
    with pytest.raises(ValueError, match="modules this model lacks"):
        restore_fp8_state(torch.nn.Module(), state, DelayedRecipe())


def _holder(module):
    m = torch.nn.Module()
    m.add_module("te", module)
    return m


@pytest.mark.gpu
def test_real_te_linear_round_trip_and_first_forward_keeps_it():
    """The same contract on Transformer Engine itself: collect after FP8 steps, restore into a
    fresh te.Linear (before its first forward), and the first forward under fp8_autocast keeps
    the restored scales / history (it updates them from there, as the original would)."""
    te = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common.recipe import DelayedScaling, Format

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    torch.manual_seed(0)
    a = te.Linear(64, 64, params_dtype=torch.bfloat16).cuda()
    b = te.Linear(64, 64, params_dtype=torch.bfloat16).cuda()
    b.load_state_dict({k: v for k, v in a.state_dict().items() if not k.endswith("_extra_state")},
                      strict=False)
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            a(x).float().sum().backward()
    saved = collect_fp8_state(_holder(a))
    assert sorted(k.split(".")[-1] for k in saved) == sorted(
        ["scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"])
    assert restore_fp8_state(_holder(b), saved, recipe) == 1
    now = collect_fp8_state(_holder(b))
    assert all(torch.equal(saved[k], now[k]) for k in saved)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe):  # one more step on both
        ya, yb = a(x), b(x)
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
