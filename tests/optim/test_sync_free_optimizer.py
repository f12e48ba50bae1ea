"""The sync-free optimizer step against Megatron's own ``optimizer.step()`` (the reference),
both running Megatron's real DDP / optimizer classes on CPU under the test-only CUDA-as-CPU
mode: 0 host syncs per step, bit-identical parameters over several steps (FP32, bf16, fp16 with
a dynamic grad scaler), a step with an inf gradient skipped and the loss scale updated as
Megatron's DynamicGradScaler updates it."""

import copy

import pytest
import torch

from tests.support.cuda_as_cpu import cuda_as_cpu
from megatron_fastpath.optim import SyncFreeOptimizer
from megatron_fastpath.sync import SyncSentinel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _randn(*shape, dtype=torch.float32):
    """Drawn in float32 and cast: from one seed, torch 2.11 and 2.13 draw different float16 /
    bfloat16 values on the CPU (their reduced-precision CPU sampling kernels differ, aten/src/
    ATen/native/cpu/DistributionTemplates.h) and the same float32 ones, so each test's data --
    and whether a step of it overflows fp16 -- are the same on both releases."""
    return torch.randn(*shape).to(dtype)


def _tiny(cfg):
    from megatron.core.transformer.module import MegatronModule

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(cfg)
            # initialised in float32 and cast, as _randn draws (the same on every release)
            self.a = torch.nn.Linear(8, 16).to(cfg.params_dtype)
            self.b = torch.nn.Linear(16, 4, bias=False).to(cfg.params_dtype)

        def forward(self, x):
            return self.b(torch.nn.functional.silu(self.a(x)))

    return Tiny()


def _build(mode, seed=0, distributed=False, **opt_kw):
    """(ddp, Megatron optimizer) of a tiny model; same seed -> same parameters.
    ``distributed``: Megatron's DistributedOptimizer (ZeRO-1; one shard at world 1)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    dt = DTYPES[mode]
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, params_dtype=dt,
                            bf16=mode == "bf16", fp16=mode == "fp16", use_cpu_initialization=True)
    torch.manual_seed(seed)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), _tiny(cfg))
    kw = dict(optimizer="adam", lr=2e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
              clip_grad=0.05, bf16=mode == "bf16", fp16=mode == "fp16",
              use_distributed_optimizer=distributed)
    kw.update(opt_kw)
    return ddp, get_megatron_optimizer(OptimizerConfig(**kw), [ddp])


def _backward(ddp, opt, x, inf=False):
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(x).float().pow(2).sum()
    opt.scale_loss(loss).backward()
    ddp.finish_grad_sync()
    if inf:
        next(ddp.parameters()).main_grad.view(-1)[3] = float("inf")


def _params(ddp):
    return [p.detach().clone() for p in ddp.parameters()]


def _run_pair(mode, steps, inf_steps=(), kernel="auto", **opt_kw):
    """Train two identical copies, Megatron's step vs ours; yield per-step results."""
    ref_ddp, ref_opt = _build(mode, **opt_kw)
    our_ddp, megatron_opt = _build(mode, **opt_kw)
    ours = SyncFreeOptimizer(megatron_opt, kernel=kernel)
    torch.manual_seed(1)
    out = []
    for step in range(steps):
        x = _randn(5, 8, dtype=DTYPES[mode]) * (1 + step)
        _backward(ref_ddp, ref_opt, x, inf=step in inf_steps)
        ref = ref_opt.step()
        _backward(our_ddp, ours, x, inf=step in inf_steps)
        with SyncSentinel(name="sync-free step") as s:
            applied_1, norm_1, _ = ours.step()
        out.append(dict(ref=ref, applied=bool(applied_1), norm=float(norm_1), syncs=s.num_syncs,
                        sites=s.by_location(), ref_params=_params(ref_ddp),
                        our_params=_params(our_ddp), ref_scale=ref_opt.get_loss_scale().clone(),
                        our_scale=ours.get_loss_scale().clone()))
    return out, ref_opt, ours


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_zero_syncs_and_bit_identical_parameters(mcore_parallel, mode, distributed):
    with cuda_as_cpu():
        kw = dict(initial_loss_scale=2.0 ** 10, loss_scale_window=3) if mode == "fp16" else {}
        steps, _, ours = _run_pair(mode, 6, distributed=distributed, **kw)
    assert [type(leaf).__name__ for leaf in ours.leaves] == (
        ["DistributedOptimizer"] if distributed else
        ["FP32Optimizer" if mode == "fp32" else "Float16OptimizerWithFloat16Params"])
    for i, s in enumerate(steps):
        assert s["syncs"] == 0, s["sites"]
        success, ref_norm, _ = s["ref"]
        assert success and s["applied"]
        assert s["norm"] == ref_norm, (i, s["norm"], ref_norm)  # float64, same bits
        for a, b in zip(s["ref_params"], s["our_params"]):
            assert torch.equal(a, b), (mode, i, (a.float() - b.float()).abs().max())
        assert torch.equal(s["ref_scale"], s["our_scale"])
    # clipping was active (max_norm 0.05), so the clip path is what is being compared
    assert max(s["norm"] for s in steps) > 0.05


def test_megatron_step_syncs_counted(mcore_parallel):
    """The baseline the wrapper removes: Megatron's step reads the device back."""
    with cuda_as_cpu():
        ddp, opt = _build("fp32")
        _backward(ddp, opt, torch.randn(5, 8))
        with SyncSentinel() as s:
            opt.step()
    sites = " ".join(s.by_location())
    assert "clip_grads.py" in sites and s.num_syncs >= 2


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_inf_gradient_step_skipped_and_loss_scale_updated(mcore_parallel, distributed):
    """fp16 + DynamicGradScaler (hysteresis 2, window 2): inf steps 1, 2 (backoff at the
    second), clean steps 3, 4 (growth at the second), inf step 6: the same skips, parameters,
    scales and trackers as Megatron's step (its DistributedOptimizer's too)."""
    kw = dict(initial_loss_scale=2.0 ** 8, loss_scale_window=2, hysteresis=2, distributed=distributed)
    with cuda_as_cpu():
        steps, ref_opt, ours = _run_pair("fp16", 7, inf_steps=(1, 2, 6), **kw)
        sd = ours.state_dict()  # writes the device trackers back into Megatron's scaler
    scales = []
    for i, s in enumerate(steps):
        assert s["syncs"] == 0, s["sites"]
        assert s["ref"][0] == s["applied"], i
        assert s["applied"] == (i not in (1, 2, 6))
        for a, b in zip(s["ref_params"], s["our_params"]):
            assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max())
        if not s["applied"]:  # skipped: parameters are those of the step before
            prev = steps[i - 1]["our_params"]
            assert all(torch.equal(a, b) for a, b in zip(prev, s["our_params"]))
        assert torch.equal(s["ref_scale"], s["our_scale"]), (i, s["ref_scale"], s["our_scale"])
        scales.append(float(s["our_scale"]))
    assert scales[1] == 256.0 and scales[2] == 128.0 and scales[4] == 256.0, scales
    ref_scaler = ref_opt.chained_optimizers[0].grad_scaler
    our_scaler = ours.leaves[0].grad_scaler
    assert (our_scaler._growth_tracker, our_scaler._hysteresis_tracker) == (
        ref_scaler._growth_tracker, ref_scaler._hysteresis_tracker)
    assert "grad_scaler" in sd


def test_first_step_skipped_keeps_zero_state(mcore_parallel):
    """An inf on the very first step: nothing moves (no 0/0 from the bias correction)."""
    kw = dict(initial_loss_scale=2.0 ** 8, loss_scale_window=2, hysteresis=1)
    with cuda_as_cpu():
        steps, _, _ = _run_pair("fp16", 3, inf_steps=(0,), **kw)
    assert [s["applied"] for s in steps] == [False, True, True]
    for s in steps:
        for a, b in zip(s["ref_params"], s["our_params"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_fused_kernel_close_to_megatron_and_skips(mcore_parallel, mode):
    """torch's fused AdamW kernel (the CUDA default): last-ulp differences, same skips."""
    kw = dict(initial_loss_scale=2.0 ** 8, loss_scale_window=2) if mode == "fp16" else {}
    inf = (2,) if mode == "fp16" else ()
    with cuda_as_cpu():
        steps, _, _ = _run_pair(mode, 5, inf_steps=inf, kernel="fused", **kw)
    for i, s in enumerate(steps):
        assert s["syncs"] == 0, s["sites"]
        assert s["applied"] == (i not in inf) == bool(s["ref"][0])
        for a, b in zip(s["ref_params"], s["our_params"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_unsupported_optimizers_refused(mcore_parallel):
    with cuda_as_cpu():
        _, opt = _build("fp32", log_num_zeros_in_grad=True)
        with pytest.raises(ValueError, match="log_num_zeros_in_grad"):
            SyncFreeOptimizer(opt)
        _, opt = _build("fp32", optimizer="sgd")
        with pytest.raises(TypeError, match="SGD"):
            SyncFreeOptimizer(opt)
        _, opt = _build("fp32")
        with pytest.raises(ValueError, match="kernel"):
            SyncFreeOptimizer(opt, kernel="triton")


def test_unchecked_megatron_version_fails_loudly(monkeypatch, mcore_parallel):
    from packaging.version import Version

    from megatron_fastpath import compat

    with cuda_as_cpu():
        _, opt = _build("fp32")
    monkeypatch.setattr(compat, "MCORE_VERSION", Version("0.17.0"))
    with pytest.raises(ImportError, match="optimizer_leaves was checked against megatron-core 0.16.x, 0.19.x only"):
        SyncFreeOptimizer(opt)


@pytest.mark.skipif(__import__("megatron_fastpath.compat").compat.mcore_line() != (0, 19),
                    reason="separate grad-norm groups exist from megatron-core 0.19 "
                    "(megatron/core/optimizer/optimizer.py:150-152 GRAD_NORM_GROUP_ATTR)")
def test_separate_grad_norm_group_refused_on_0_19(mcore_parallel):
    """0.19's clip_grad_norm leaves parameters of a separate grad-norm group (MTP) out of the
    main norm and clips them by their own; the sync-free step computes one norm: refused."""
    with cuda_as_cpu():
        ddp, opt = _build("fp32")
    SyncFreeOptimizer(opt)
    next(ddp.parameters()).grad_norm_group = "mtp"  # what Megatron tags MTP parameters with
    with pytest.raises(ValueError, match="1 parameters carry a separate 'grad_norm_group'.*"
                       "training.optimizer_step=megatron"):
        SyncFreeOptimizer(opt)


def test_main_job_choice_of_step(mcore_parallel):
    """training.optimizer_step: auto falls back to Megatron's step where the wrapper does not
    apply (here SGD); sync_free refuses; megatron never wraps."""
    from megatron_fastpath.train.step import _optimizer_step

    with cuda_as_cpu():
        _, sgd = _build("fp32", optimizer="sgd")
        _, adam = _build("fp32")
    assert _optimizer_step(sgd, "auto") is sgd
    with pytest.raises(TypeError, match="SGD"):
        _optimizer_step(sgd, "sync_free")
    assert isinstance(_optimizer_step(adam, "auto"), SyncFreeOptimizer)
    assert _optimizer_step(adam, "megatron") is adam


def test_optimizer_step_setting_validated():
    from tests.support.hydra_compose import compose_job

    from megatron_fastpath.train import parse_job_config

    cfg = compose_job(["training.optimizer_step=fast"])
    with pytest.raises(ValueError, match="optimizer_step must be auto, sync_free or megatron"):
        parse_job_config(cfg)


class _TEFusedAdamStandIn(torch.optim.Optimizer):
    """Stand-in for transformer_engine.pytorch.optimizers.FusedAdam (TE needs CUDA): its
    constructor signature, defaults and attributes; its step must never run."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, bias_correction=True, adam_w_mode=True, capturable=False,
                 master_weights=False, master_weight_dtype=torch.float32,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False, set_grad_none=None):
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable, self.master_weights = capturable, master_weights
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = store_param_remainders

    def step(self, closure=None):
        raise AssertionError("the sync-free step must not call FusedAdam.step")


_TEFusedAdamStandIn.__module__ = "transformer_engine.pytorch.optimizers.fused_adam"
_TEFusedAdamStandIn.__name__ = _TEFusedAdamStandIn.__qualname__ = "FusedAdam"


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_te_fused_adam_taken_over(mcore_parallel, monkeypatch, mode):
    """Megatron builds TE's FusedAdam when TE is installed: the wrapper swaps it for torch's
    AdamW over the same param groups before the first step, and the parameters are those of
    Megatron's step with its TE-less torch AdamW, bit for bit."""
    import megatron.core.optimizer as mopt

    with cuda_as_cpu():
        ref_ddp, ref_opt = _build(mode)
        monkeypatch.setattr(mopt, "Adam", _TEFusedAdamStandIn)
        monkeypatch.setattr(mopt, "USING_PYTORCH_OPTIMIZER", False)
        our_ddp, te_opt = _build(mode)
        assert type(te_opt.chained_optimizers[0].optimizer).__name__ == "FusedAdam"
        ours = SyncFreeOptimizer(te_opt)
        inner = ours.leaves[0].optimizer
        assert type(inner) is torch.optim.AdamW
        assert inner.param_groups[0]["params"] is te_opt.param_groups[0]["params"]
        torch.manual_seed(1)
        for step in range(4):
            x = _randn(5, 8, dtype=DTYPES[mode])
            _backward(ref_ddp, ref_opt, x)
            ref_opt.step()
            _backward(our_ddp, ours, x)
            with SyncSentinel() as s:
                ours.step()
            assert s.num_syncs == 0
            for a, b in zip(ref_ddp.parameters(), our_ddp.parameters()):
                assert torch.equal(a, b), step


def test_te_fused_adam_with_master_weights_not_taken_over(mcore_parallel, monkeypatch):
    import megatron.core.optimizer as mopt

    from megatron_fastpath.train.step import _optimizer_step

    class MasterWeights(_TEFusedAdamStandIn):
        def __init__(self, *a, **k):
            super().__init__(*a, **k, master_weights=True)

    MasterWeights.__module__, MasterWeights.__name__ = _TEFusedAdamStandIn.__module__, "FusedAdam"
    with cuda_as_cpu():
        monkeypatch.setattr(mopt, "Adam", MasterWeights)
        monkeypatch.setattr(mopt, "USING_PYTORCH_OPTIMIZER", False)
        _, opt = _build("fp32")
    with pytest.raises(TypeError, match="master weights"):
        SyncFreeOptimizer(opt)
    assert _optimizer_step(opt, "auto") is opt  # auto keeps Megatron's step


def test_state_dict_round_trip_continues_identically(mcore_parallel):
    """fp16 + dynamic scaler: stop after 3 steps (one skipped), take Megatron's state dict through
    the wrapper (device trackers written back), load it into a fresh optimizer + wrapper, and the
    next 3 steps equal an uninterrupted run's bit for bit (parameters, loss scale, skips)."""
    kw = dict(initial_loss_scale=2.0 ** 8, loss_scale_window=2, hysteresis=2)
    torch.manual_seed(3)
    xs = [_randn(5, 8, dtype=torch.float16) for _ in range(6)]
    inf_steps = (1, 4)

    def run(ddp, opt, steps):
        for i in steps:
            _backward(ddp, opt, xs[i], inf=i in inf_steps)
            with SyncSentinel() as s:
                opt.step()
            assert s.num_syncs == 0

    with cuda_as_cpu():
        ref_ddp, ref = _build("fp16", **kw)
        ref = SyncFreeOptimizer(ref)
        run(ref_ddp, ref, range(6))
        first_ddp, first = _build("fp16", **kw)
        first = SyncFreeOptimizer(first)
        run(first_ddp, first, range(3))
        sd = copy.deepcopy(first.state_dict())
        params = [p.detach().clone() for p in first_ddp.parameters()]
        resumed_ddp, resumed = _build("fp16", seed=7, **kw)
        resumed = SyncFreeOptimizer(resumed)
        with torch.no_grad():
            for p, q in zip(resumed_ddp.parameters(), params):
                p.copy_(q)
        resumed.load_state_dict(sd)
        run(resumed_ddp, resumed, range(3, 6))
    for a, b in zip(ref_ddp.parameters(), resumed_ddp.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(ref.get_loss_scale(), resumed.get_loss_scale())
    ref_sd, res_sd = ref.state_dict()["grad_scaler"], resumed.state_dict()["grad_scaler"]
    assert (ref_sd["growth_tracker"], ref_sd["hysteresis_tracker"]) == (
        res_sd["growth_tracker"], res_sd["hysteresis_tracker"])


def test_resume_of_an_optimizer_that_never_stepped(mcore_parallel):
    """A checkpoint saved before the first optimizer step: Megatron's loading path
    (sharded_state_dict(is_loading=True) -> init_state_fn) leaves Adam states with exp_avg /
    exp_avg_sq and no 'step'; the wrapper's step must start from step 0 as a fresh optimizer,
    giving the same parameters as an optimizer that was never checkpointed."""
    torch.manual_seed(5)
    x = torch.randn(5, 8)
    with cuda_as_cpu():
        ref_ddp, ref = _build("fp32")
        ref = SyncFreeOptimizer(ref)
        new_ddp, new = _build("fp32")
        leaves = getattr(new, "chained_optimizers", [new])
        for leaf in leaves:  # what a load of a never-stepped state does
            leaf.init_state_fn(leaf.optimizer, leaf.config)
        states = [st for leaf in leaves for st in leaf.optimizer.state.values()]
        assert states and all("step" not in st and "exp_avg" in st for st in states)
        new = SyncFreeOptimizer(new)
        for ddp, opt in ((ref_ddp, ref), (new_ddp, new)):
            _backward(ddp, opt, x)
            opt.step()
    for a, b in zip(ref_ddp.parameters(), new_ddp.parameters()):
        assert torch.equal(a, b)
