"""A sync-free step for Megatron's optimizer: :class:`SyncFreeOptimizer`.

Megatron-Core 0.16.1's ``optimizer.step()`` reads the device back three times per step: the
gradient norm (``clip_grads.py``: ``total_norm.item()``, and ``float()`` in the local l2-norm
fallback), ``found_inf`` with a grad scaler (``optimizer.py``: ``self.found_inf.item()``) and,
without Transformer Engine or Apex, torch AdamW's per-parameter step count (``.item()`` each).
The wrapper keeps all of it on the device:

* clipping: the norm is computed as Megatron computes it (per-tensor l2 norms, the norm of
  those, squared, all-reduced over the grad-stats group, square root in float64) and the clip
  coefficient ``min(1, max_norm / (norm + 1e-6))`` multiplies the gradients as a device tensor
  (multiplying by exactly 1 when Megatron would not clip);
* ``found_inf``: Megatron's own ``_amp_foreach_non_finite_check_and_unscale_`` + MAX all-reduce,
  never read back; the update is then skipped by a device-side select, as MLPerf's sync-free
  Adam does: every state change is either multiplied by 1 / weighted by 0 or selected with
  ``torch.where`` on the skip flag, and the step count advances by ``1 - skip``;
* the dynamic loss scale: ``DynamicGradScaler.update`` as ``torch.where`` on device trackers
  (written back to Megatron's host fields only when a state dict is taken);
* Megatron's ``DistributedOptimizer`` (ZeRO-1): the same step on this rank's shard -- the
  shard's main gradients, the norm and found-inf all-reduced over the optimizer's grad-stats
  group (the whole world: squared partial norms summed), Adam on the shard, the shard copied
  into DDP's parameter buffer, then the parameter all-gather exactly as its
  ``step_with_ready_grads`` runs it (or, with ``overlap_param_gather``, left to DDP's forward
  pre-hooks) -- ``compat/optim.py`` ``leaf_param_all_gather``.

``step()`` returns ``(applied_1, grad_norm_1, None)`` with device tensors in place of Megatron's
``(bool, float, None)``; read them one step late with the loss (``LaggedReadback``).

Adam kernels (``kernel=``): "exact" mirrors torch's single-tensor AdamW (what Megatron uses
without TE/Apex) op for op with device scalars, so parameters are bit-identical to Megatron's
step; "fused" is torch's fused AdamW kernel with its ``found_inf`` skip (one kernel per group;
last-ulp differences); "auto" picks fused on CUDA, exact elsewhere.

Learning rates: each group's ``lr`` host float (what Megatron's scheduler writes), or, after
``use_device_lr(schedule)``, the float64 0-dim tensors of a
:class:`~megatron_fastpath.optim.device_lr.DeviceLRSchedule` (advanced on the device, so a
captured step reads the current LR); "exact" gives the same bits from either.

Shape key: ``_1`` a one-element tensor ([1] as Megatron keeps it), ``_0`` a 0-dim tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_fastpath.compat import optim as optim_compat

__all__ = ["SyncFreeOptimizer", "SyncFreeStepResult"]

_KERNELS = ("auto", "exact", "fused")


@dataclasses.dataclass(frozen=True)
class SyncFreeStepResult:
    """Device tensors of one step: applied (bool [1]), grad norm (float64 [1]), loss scale."""

    applied_1: torch.Tensor
    grad_norm_1: torch.Tensor
    loss_scale_1: torch.Tensor


class _DeviceScaler:
    """Megatron's ``DynamicGradScaler.update`` on device trackers (same fp32 scale math)."""

    def __init__(self, scaler, fields: dict, device):
        self.scaler = scaler
        self.f = fields
        self.growth_1 = torch.full((1,), fields["growth_tracker"], dtype=torch.int64, device=device)
        self.hyst_1 = torch.full((1,), fields["hysteresis_tracker"], dtype=torch.int64, device=device)

    def update(self, found_inf_1: torch.Tensor) -> None:
        f, inf_1 = self.f, found_inf_1 > 0
        scale_1 = self.scaler._scale
        growth_1 = torch.where(inf_1, 0, self.growth_1 + 1)
        hyst_1 = torch.where(inf_1, self.hyst_1 - 1, self.hyst_1)
        back_off_1 = inf_1 & (hyst_1 <= 0)
        grow_1 = ~inf_1 & (growth_1 == f["growth_interval"])
        self.growth_1.copy_(torch.where(grow_1, 0, growth_1))
        self.hyst_1.copy_(torch.where(grow_1, f["hysteresis"], hyst_1))
        down_1 = torch.max(scale_1 * f["backoff_factor"], f["min_scale"])
        scale_1.copy_(torch.where(back_off_1, down_1, torch.where(grow_1, scale_1 * f["growth_factor"], scale_1)))

    def write_back(self) -> None:
        """Host sync (checkpoint time only): Megatron's host trackers <- device trackers."""
        optim_compat.set_dynamic_scaler_trackers(self.scaler, self.growth_1.item(), self.hyst_1.item())

    def reload(self) -> None:
        _, fields = optim_compat.dynamic_scaler_fields(self.scaler)
        self.growth_1.fill_(fields["growth_tracker"])
        self.hyst_1.fill_(fields["hysteresis_tracker"])


def _check_inner(leaf) -> None:
    opt = leaf.optimizer
    if opt is None:
        return
    if not isinstance(opt, torch.optim.Adam):  # AdamW subclasses Adam in torch >= 2.6
        raise TypeError(
            f"the sync-free step runs torch Adam/AdamW's update; Megatron built "
            f"{type(opt).__name__}: not supported, use Megatron's own step()"
        )
    for g in opt.param_groups:
        if g.get("amsgrad") or g.get("maximize") or g.get("differentiable") or torch.is_tensor(g["lr"]):
            raise ValueError("the sync-free Adam step supports amsgrad=maximize=False and a float lr")


class SyncFreeOptimizer:
    """Wrap a Megatron optimizer (``get_megatron_optimizer``'s result) for a sync-free step.

    Everything but ``step`` (``zero_grad``, ``scale_loss``, ``param_groups`` for the LR
    scheduler, ...) is Megatron's. Differences from Megatron's step: the LR scheduler is not
    told about skipped steps (the host does not know them); ``state_dict`` writes the device-side
    loss-scale trackers back first (one host read, at checkpoint time)."""

    def __init__(self, optimizer, kernel: str = "auto"):
        if kernel not in _KERNELS:
            raise ValueError(f"kernel must be one of {_KERNELS}; got {kernel!r}")
        self.optimizer = optimizer
        self.leaves = optim_compat.optimizer_leaves(optimizer)
        for leaf in self.leaves:
            optim_compat.torch_adam_in_place_of_fused_adam(leaf)  # TE / Apex FusedAdam -> torch's
            _check_inner(leaf)
        self.kernel = kernel
        self.device = optimizer.get_loss_scale().device
        self.scalers = {}
        for i, leaf in enumerate(self.leaves):
            if optim_compat.leaf_is_mixed_precision(leaf):
                kind, fields = optim_compat.dynamic_scaler_fields(leaf.grad_scaler)
                if kind == "dynamic":
                    self.scalers[i] = _DeviceScaler(leaf.grad_scaler, fields, self.device)
        self.last: Optional[SyncFreeStepResult] = None
        self.device_lrs: Optional[dict] = None  # leaf index -> [lr_0 per inner param group]

    def use_device_lr(self, schedule) -> None:
        """Read each param group's LR from ``schedule.lrs`` (a ``DeviceLRSchedule``) instead
        of ``group["lr"]`` from now on.

        The mapping: the scheduler's groups are ``optimizer.param_groups`` -- for a
        ChainedOptimizer the concatenation, leaf by leaf, of each leaf's inner torch
        optimizer's ``param_groups`` (a stub leaf contributes none) -- so flat index ``k``
        is inner group ``j`` of leaf ``i`` in that order; each is checked to be the very
        dict the schedule was built over."""
        flat = list(self.optimizer.param_groups)
        if len(flat) != len(schedule.groups) or any(a is not b for a, b in zip(flat, schedule.groups)):
            raise ValueError(
                f"use_device_lr: the schedule was built over {len(schedule.groups)} param groups "
                f"that are not this optimizer's {len(flat)}; build it with "
                f"DeviceLRSchedule.from_scheduler(scheduler) of a scheduler over this optimizer")
        if schedule.device != self.device:
            raise ValueError(
                f"use_device_lr: the schedule's LRs are on {schedule.device}, the optimizer's "
                f"state on {self.device}; build the schedule with device={self.device}")
        device_lrs, k = {}, 0
        for i, leaf in enumerate(self.leaves):
            groups = [] if leaf.is_stub_optimizer or leaf.optimizer is None else (
                leaf.optimizer.param_groups)
            for g in groups:
                if g is not flat[k]:
                    raise AssertionError(f"param group {k} is not leaf {i}'s inner group")
                k += 1
            device_lrs[i] = schedule.lrs[k - len(groups):k]
        if k != len(flat):
            raise AssertionError(f"{len(flat)} param groups, {k} in the leaves' optimizers")
        self.device_lrs = device_lrs

    def __getattr__(self, name):
        return getattr(self.__dict__["optimizer"], name)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    # -- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self):
        skip_1 = torch.zeros(1, dtype=torch.bool, device=self.device)
        for i, leaf in enumerate(self.leaves):
            optim_compat.leaf_copy_model_grads_to_main(leaf)
            if optim_compat.leaf_is_mixed_precision(leaf) and leaf.grad_scaler is not None:
                found_inf_1 = self._unscale_and_check(leaf)
                if i in self.scalers:
                    self.scalers[i].update(found_inf_1)
                skip_1 = skip_1 | (found_inf_1 > 0)
        grad_norm_1 = self._grad_norm()
        clip = self.leaves[0].config.clip_grad if self.leaves else 0.0
        if clip > 0.0:
            coeff_0 = (clip / (grad_norm_1 + 1.0e-6)).clamp(max=1.0).float().reshape(())
            grads = [p.grad for leaf in self.leaves for p in leaf.get_parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coeff_0)
        for i, leaf in enumerate(self.leaves):
            if leaf.optimizer is not None and not leaf.is_stub_optimizer:
                lrs = None if self.device_lrs is None else self.device_lrs[i]
                self._adam_step(leaf.optimizer, skip_1, lrs)
            optim_compat.leaf_copy_main_params_to_model(leaf)
            # DistributedOptimizer: every rank's updated shard to every rank, as its
            # step_with_ready_grads after each leaf's update (a skipped step gathers the
            # unchanged shards: the same parameters)
            optim_compat.leaf_param_all_gather(leaf)
        applied_1 = ~skip_1
        self.last = SyncFreeStepResult(applied_1, grad_norm_1, self.optimizer.get_loss_scale())
        return applied_1, grad_norm_1, None

    def _unscale_and_check(self, leaf) -> torch.Tensor:
        """Megatron's ``_unscale_main_grads_and_check_for_nan`` without its ``.item()``."""
        leaf.found_inf.fill_(0.0)
        grads = optim_compat.leaf_main_grads_for_unscaling(leaf)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, leaf.found_inf, leaf.grad_scaler.inv_scale)
        torch.distributed.all_reduce(
            leaf.found_inf, op=torch.distributed.ReduceOp.MAX,
            group=leaf.get_grad_stats_parallel_group())
        return leaf.found_inf

    def _leaf_norm_sq(self, grads, group) -> torch.Tensor:
        """Megatron's ``get_grad_norm_fp32`` (norm 2) up to its ``.item()``: norm of the
        per-tensor norms (fp32), squared, summed over ``group``."""
        if grads:
            norms = torch._foreach_norm(grads)
            norm_1 = torch.linalg.vector_norm(torch.stack(norms)).float().reshape(1)
        else:
            norm_1 = torch.zeros(1, dtype=torch.float, device=self.device)
        norm_sq_1 = norm_1 ** 2.0
        torch.distributed.all_reduce(norm_sq_1, op=torch.distributed.ReduceOp.SUM, group=group)
        return norm_sq_1

    def _grad_norm(self) -> torch.Tensor:
        """As ChainedOptimizer.get_grad_norm: one norm over all leaves when they share the
        grad-stats group, else the root of the sum of the squared leaf norms (in float64)."""
        groups = [leaf.get_grad_stats_parallel_group() for leaf in self.leaves]
        if len(self.leaves) == 1 or all(g == groups[0] for g in groups):
            grads = [g for leaf in self.leaves for g in optim_compat.leaf_grads_for_grad_norm(leaf)]
            return self._leaf_norm_sq(grads, groups[0] if groups else None).double().sqrt()
        sq = [self._leaf_norm_sq(optim_compat.leaf_grads_for_grad_norm(leaf), g).double().sqrt() ** 2
              for leaf, g in zip(self.leaves, groups)]
        return torch.stack(sq).sum(0).sqrt()

    # -- Adam ----------------------------------------------------------------------------
    def _adam_step(self, opt: torch.optim.Adam, skip_1: torch.Tensor, lrs=None) -> None:
        """``lrs``: the device LRs of ``opt``'s groups (``use_device_lr``), else None."""
        for j, group in enumerate(opt.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(opt, p, group) for p in params]
            fused = self.kernel == "fused" or (self.kernel == "auto" and params[0].is_cuda)
            lr = group["lr"] if lrs is None else lrs[j]
            (_fused_adam if fused else _exact_adam)(group, params, states, skip_1, lr)

    @staticmethod
    def _state(opt, p, group) -> dict:
        st = opt.state[p]
        # torch's lazy init, with the step count on the parameter's device. A state can also be
        # partial: Megatron's init_state_fn (megatron/core/optimizer/__init__.py, Adam) makes
        # exp_avg / exp_avg_sq only, when a checkpoint of an optimizer that never stepped is
        # loaded (sharded_state_dict(is_loading=True)): its step count is 0.
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        elif st["step"].device != p.device:  # e.g. loaded from a checkpoint: once, no read
            st["step"] = st["step"].to(p.device, torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in st:
                st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    # -- checkpoints -----------------------------------------------------------------------
    def _write_back(self) -> None:
        for s in self.scalers.values():
            s.write_back()

    def state_dict(self, *args, **kwargs):
        self._write_back()
        return self.optimizer.state_dict(*args, **kwargs)

    def sharded_state_dict(self, *args, **kwargs):
        self._write_back()
        return self.optimizer.sharded_state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict):
        out = self.optimizer.load_state_dict(state_dict)
        for s in self.scalers.values():
            s.reload()
        return out


def _exact_adam(group, params, states, skip_1, lr) -> None:
    """torch's ``_single_tensor_adam`` (capturable=False) op for op, with the host scalars it
    computes from ``step.item()`` computed on the device in float64, and the skip as weights of
    0 / factors of 1 / ``where`` (grads of a skipped step are zeroed first: they hold inf/nan).

    ``lr``: the group's host float, or a float64 0-dim device tensor of the same value (the
    same float64 operations, so the same bits: ``1 - lr * wd`` rounded once to float32,
    ``-(lr / bc1)`` in float64)."""
    (beta1, beta2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
    decoupled = group.get("decoupled_weight_decay", False)
    dev = params[0].device
    skip_0 = skip_1.reshape(())
    ok_0 = (~skip_0).float()
    one_0 = torch.ones((), device=dev)
    if torch.is_tensor(lr):
        keep_0 = (1 - lr * wd).float()  # float64 math, one rounding: as torch.full's below
    else:
        keep_0 = torch.full((), 1 - lr * wd, device=dev)
    decay_0 = torch.where(skip_0, one_0, keep_0)
    w1_0 = torch.where(skip_0, 0.0, torch.full((), 1 - beta1, device=dev))
    b2_0 = torch.where(skip_0, one_0, torch.full((), beta2, device=dev))
    for p, st in zip(params, states):
        grad = p.grad.masked_fill_(skip_0, 0.0)
        if wd != 0:
            if decoupled:
                p.mul_(decay_0)
            else:
                grad = grad.add(p, alpha=wd)
        st["exp_avg"].lerp_(grad, w1_0)
        st["exp_avg_sq"].mul_(b2_0).addcmul_(grad, grad, value=1 - beta2)
        step_0 = st["step"]
        step_0.add_(ok_0)
        n_0 = step_0.double().clamp(min=1.0)  # a first step that is skipped: no 0-division
        bc1_0 = 1 - beta1 ** n_0
        bc2_sqrt_0 = (1 - beta2 ** n_0).sqrt()
        neg_step_size_0 = torch.where(skip_0, 0.0, -(lr / bc1_0)).float()
        denom = (st["exp_avg_sq"].sqrt() / bc2_sqrt_0.float()).add_(eps)
        p.addcdiv_(st["exp_avg"] * neg_step_size_0, denom)


def _fused_adam(group, params, states, skip_1, lr) -> None:
    """torch's fused Adam(W) kernel; it skips every update itself when ``found_inf`` is set.

    A tensor ``lr`` is passed as float32 on the parameters' device: the CUDA kernel reads it
    through a ``float*`` (``lr.const_data_ptr<float>()``, ATen FusedAdamKernel) in the graph
    instead of baking a host double (torch/optim/adam.py ``_fused_adam`` only moves a CUDA
    tensor lr between devices)."""
    from torch.optim.adam import adam

    if torch.is_tensor(lr):
        lr = lr.to(device=params[0].device, dtype=torch.float32)
    adam(
        params, [p.grad for p in params], [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
        fused=True, found_inf=skip_1.float().reshape(()), grad_scale=None,
        decoupled_weight_decay=group.get("decoupled_weight_decay", False),
        amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=lr,
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
    )
