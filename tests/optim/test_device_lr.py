"""The LR schedule on the device (``DeviceLRSchedule``) against Megatron's host
``OptimizerParamScheduler``: the same per-group LRs step by step (warmup + cosine as the main job
builds it, linear, constant, per-group max_lr/min_lr overrides), ``load_from`` after a resume, 0
host syncs per ``step()``; and the sync-free optimizer reading those device LRs gives the
parameters of the host-float path bit for bit."""

import math
import types

import pytest
import torch

from megatron_fastpath.optim import DeviceLRSchedule, SyncFreeOptimizer
from megatron_fastpath.sync import SyncSentinel
from megatron_fastpath.train.config import TrainingConfig
from megatron_fastpath.train.step import build_scheduler, megatron_ddp_and_optimizer
from tests.support.cuda_as_cpu import cuda_as_cpu
from tests.support.tiny_gpt import build_tiny_gpt

# the main job's build_scheduler: init_lr 0, warmup 3, cosine to min_lr over 12 steps
MAIN_JOB = TrainingConfig(steps=12, warmup_steps=3, lr=1e-3, min_lr=1e-4, weight_decay=0.01,
                          optimizer_step="sync_free")


def _groups():
    """Param groups as get_megatron_optimizer makes them (max_lr / min_lr / lr_mult keys), one
    with its own max_lr and min_lr, one with lr_mult (which 0.16.1's scheduler does not read)."""
    return [
        {"params": [], "max_lr": 1e-3, "min_lr": 1e-4, "lr_mult": 1.0},
        {"params": [], "max_lr": 3e-3, "min_lr": 2e-5, "lr_mult": 1.0},
        {"params": [], "lr_mult": 0.5},  # no overrides: the scheduler's own max_lr / min_lr
    ]


def _scheduler(style="cosine", warmup=3, steps=12, wd_style="constant", **kw):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = types.SimpleNamespace(param_groups=_groups())
    args = dict(init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=warmup,
                lr_decay_steps=steps, lr_decay_style=style, start_wd=0.01, end_wd=0.01,
                wd_incr_steps=steps, wd_incr_style=wd_style)
    args.update(kw)
    return OptimizerParamScheduler(opt, **args)


def _ulps(a: float, b: float) -> int:
    return abs(int(torch.tensor(a, dtype=torch.float64).view(torch.int64))
               - int(torch.tensor(b, dtype=torch.float64).view(torch.int64)))


CASES = {
    "cosine_warmup": dict(style="cosine", warmup=3, init_lr=0.0),
    "cosine_no_warmup": dict(style="cosine", warmup=0),
    "linear_warmup": dict(style="linear", warmup=4, init_lr=1e-5),
    "constant_warmup": dict(style="constant", warmup=2),
    "constant": dict(style="constant", warmup=0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_device_lrs_equal_megatron_scheduler(case):
    """k = 0..16 steps (past the decay's end): each group's device LR is the scheduler's
    ``group['lr']`` after k ``step(1)`` calls, bit for bit. On CPU torch.cos and math.cos both
    call the C library's cos, so the observed bound is 0 ulp (on CUDA, libdevice's double cos
    is documented within 2 ulp of the true value; not testable here)."""
    ref = _scheduler(**CASES[case])
    dev = DeviceLRSchedule.from_scheduler(_scheduler(**CASES[case]), "cpu")
    assert all(lr.dtype == torch.float64 and lr.dim() == 0 for lr in dev.lrs)
    assert dev.step_0.dtype == torch.float64 and dev.step_0.dim() == 0
    held = [lr.data_ptr() for lr in dev.lrs] + [dev.step_0.data_ptr()]
    seen = set()
    for k in range(17):
        if k:
            ref.step(increment=1)
            dev.step()
        assert float(dev.step_0) == ref.num_steps == k
        for i, (group, lr_0) in enumerate(zip(ref.optimizer.param_groups, dev.lrs)):
            assert _ulps(float(lr_0), group["lr"]) == 0, (case, k, i, float(lr_0), group["lr"])
            seen.add(group["lr"])
    assert [lr.data_ptr() for lr in dev.lrs] + [dev.step_0.data_ptr()] == held  # in place
    assert len(seen) >= {"constant": 2, "constant_warmup": 4}.get(case, 20)  # the LRs did move


def test_lr_mult_not_applied_as_in_megatron():
    """0.16.1's get_lr reads max_lr / min_lr only: a group's lr_mult changes nothing, on the
    host and on the device."""
    ref = _scheduler()
    dev = DeviceLRSchedule.from_scheduler(_scheduler(), "cpu")
    for _ in range(6):
        ref.step(increment=1)
        dev.step()
    no_override, with_mult = ref.optimizer.param_groups[0], ref.optimizer.param_groups[2]
    assert with_mult["lr"] == no_override["lr"] == float(dev.lrs[2]) == float(dev.lrs[0])


def test_load_from_reproduces_advanced_scheduler():
    host = _scheduler()
    dev = DeviceLRSchedule.from_scheduler(host, "cpu")
    for _ in range(5):
        host.step(increment=1)
    dev.load_from(host)
    assert float(dev.step_0) == 5
    assert [float(lr) for lr in dev.lrs] == [g["lr"] for g in host.optimizer.param_groups]
    for _ in range(9):  # and continues as the host does
        host.step(increment=1)
        dev.step()
        assert [float(lr) for lr in dev.lrs] == [g["lr"] for g in host.optimizer.param_groups]


def test_load_from_a_different_schedule_refused():
    dev = DeviceLRSchedule.from_scheduler(_scheduler(), "cpu")
    with pytest.raises(ValueError, match="build a new DeviceLRSchedule.from_scheduler"):
        dev.load_from(_scheduler(steps=20))


def test_step_has_no_host_sync():
    dev = DeviceLRSchedule.from_scheduler(_scheduler(), "cpu")
    for _ in range(3):
        with SyncSentinel(name="device LR step") as s:
            dev.step()
        assert s.num_syncs == 0, s.by_location()
        assert s.aten_ops > 0  # the sentinel did see the step's ops


def test_unsupported_decay_style_refused():
    with pytest.raises(ValueError, match="'inverse-square-root' is not supported.*cosine, linear, constant"):
        DeviceLRSchedule.from_scheduler(_scheduler(style="inverse-square-root"), "cpu")
    with pytest.raises(ValueError, match="'WSD' is not supported"):
        DeviceLRSchedule.from_scheduler(
            _scheduler(style="WSD", wsd_decay_steps=4, lr_wsd_decay_style="linear"), "cpu")


def test_non_constant_weight_decay_refused():
    with pytest.raises(ValueError, match="wd_incr_style 'linear'.*only 'constant' is supported"):
        DeviceLRSchedule.from_scheduler(_scheduler(wd_style="linear", end_wd=0.1), "cpu")


# -- the sync-free optimizer reading the device LRs -----------------------------------------
def _job_optimizer(train_cfg):
    """The main job's Megatron DDP + sync-free optimizer over the tiny GPT, and its scheduler
    (build_scheduler), with the no-weight-decay group given its own max_lr / min_lr."""
    model, _ = build_tiny_gpt()
    ddp, opt = megatron_ddp_and_optimizer(model, model.config, train_cfg)
    assert isinstance(opt, SyncFreeOptimizer)
    assert len(opt.param_groups) == 2  # weights (wd) and biases / norms (no wd)
    opt.param_groups[1].update(max_lr=2e-3, min_lr=3e-5)
    return ddp, opt, build_scheduler(opt, train_cfg)


def _set_grads(ddp, k):
    g = torch.Generator().manual_seed(100 + k)
    for p in ddp.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=g) * (0.5 + k))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sync_free_step_with_device_lr_bit_identical(mcore_parallel, dtype):
    """14 steps (warmup, cosine, past the decay): host-float LRs (the scheduler stepping on
    the host) vs the device schedule stepping after each optimizer step (the host scheduler
    never again, and the groups' host lr poisoned with NaN): the same parameters, bit for bit,
    and 0 host syncs in the optimizer step + device schedule step."""
    import dataclasses

    train_cfg = dataclasses.replace(MAIN_JOB, dtype=dtype)
    with cuda_as_cpu():
        ref_ddp, ref_opt, ref_sched = _job_optimizer(train_cfg)
        our_ddp, our_opt, our_sched = _job_optimizer(train_cfg)
        schedule = DeviceLRSchedule.from_scheduler(our_sched, our_opt.device)
        our_opt.use_device_lr(schedule)
        assert [lr for lrs in our_opt.device_lrs.values() for lr in lrs] == schedule.lrs
        for g in our_opt.param_groups:
            g["lr"] = math.nan  # must not be read any more
        lrs_used = []
        for k in range(14):
            _set_grads(ref_ddp, k)
            _set_grads(our_ddp, k)
            ref_opt.step()
            ref_sched.step(increment=1)
            lrs_used.append(float(schedule.lrs[0]))
            with SyncSentinel(name="sync-free step + device LR") as s:
                our_opt.step()
                schedule.step()
            assert s.num_syncs == 0, s.by_location()
            for a, b in zip(ref_ddp.parameters(), our_ddp.parameters()):
                assert torch.equal(a, b), (k, (a.float() - b.float()).abs().max())
            assert [float(lr) for lr in schedule.lrs] == [g["lr"] for g in ref_opt.param_groups]
    assert lrs_used[0] == 0.0 and max(lrs_used) == MAIN_JOB.lr and lrs_used[-1] == MAIN_JOB.min_lr


def test_fused_kernel_reads_device_lr(mcore_parallel):
    """kernel="fused" (torch's fused AdamW; CPU here) given the device LR as float32: close to
    the host-float path (float32 vs float64 lr inside the kernel: last-ulp differences)."""
    with cuda_as_cpu():
        ref_ddp, ref_opt, ref_sched = _job_optimizer(MAIN_JOB)
        our_ddp, our_opt, our_sched = _job_optimizer(MAIN_JOB)
        ref_opt.kernel = our_opt.kernel = "fused"
        schedule = DeviceLRSchedule.from_scheduler(our_sched, our_opt.device)
        our_opt.use_device_lr(schedule)
        start = [p.detach().clone() for p in our_ddp.parameters()]
        for k in range(6):
            _set_grads(ref_ddp, k)
            _set_grads(our_ddp, k)
            ref_opt.step()
            ref_sched.step(increment=1)
            with SyncSentinel(name="fused step + device LR") as s:
                our_opt.step()
                schedule.step()
            assert s.num_syncs == 0, s.by_location()
    for a, b in zip(ref_ddp.parameters(), our_ddp.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert not any(torch.equal(a, b) for a, b in zip(start, our_ddp.parameters()))  # it trained


def test_use_device_lr_of_another_optimizer_refused(mcore_parallel):
    with cuda_as_cpu():
        _, opt, _ = _job_optimizer(MAIN_JOB)
        _, _, other_sched = _job_optimizer(MAIN_JOB)
    with pytest.raises(ValueError, match="not this optimizer's 2"):
        opt.use_device_lr(DeviceLRSchedule.from_scheduler(other_sched, opt.device))
    with pytest.raises(ValueError, match="not this optimizer's"):
        opt.use_device_lr(DeviceLRSchedule.from_scheduler(_scheduler(), opt.device))
