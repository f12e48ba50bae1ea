"""Megatron's LR schedule advanced on the device: :class:`DeviceLRSchedule`.

Megatron's ``OptimizerParamScheduler`` keeps the step count on the host and writes each param
group's ``lr`` as a Python float after every step. Inside a captured CUDA graph a host float is
frozen at its capture value, so for a graphed optimizer step the schedule must advance on the
device: this class holds the step count and one LR per param group as device tensors and
recomputes them with device ops only (``torch.where`` / ``torch.cos`` in float64, results copied
into the held tensors), so ``step()`` can be captured and replayed; the sync-free optimizer
reads them (``SyncFreeOptimizer.use_device_lr``).

It mirrors megatron-core 0.16.1's ``megatron/core/optimizer_param_scheduler.py``:

* ``step(increment)`` (lines 281-294): ``num_steps += increment``, then every param group of
  ``scheduler.optimizer.param_groups`` (empty groups included) gets ``lr = get_lr(group)``;
* ``get_lr(group)`` (lines 215-279): ``max_lr = group.get('max_lr', self.max_lr)``,
  ``min_lr = group.get('min_lr', self.min_lr)`` (lines 223-224; no other group key is read --
  in 0.16.1 ``lr_mult`` is *not* applied by the scheduler, so it is not applied here either);
  linear warmup ``init_lr + (max_lr - init_lr) * n / warmup`` while ``warmup > 0 and n <=
  warmup`` (227-230); "constant": ``max_lr`` (233-234); ``n > decay_steps``: ``min_lr``
  (237-238); else ``ratio = (n - warmup) / (decay_steps - warmup)`` (247-249) and
  ``min_lr + coeff * (max_lr - min_lr)`` (252, 279) with ``coeff = 1 - ratio`` ("linear",
  255-256) or ``0.5 * (cos(pi * ratio) + 1)`` ("cosine", 257-258);
* the weight decay (``get_wd``, lines 181-213) is only supported with ``wd_incr_style ==
  "constant"`` (start_wd == end_wd, asserted at line 198): it never changes, so it stays the
  host float in the param group.

Every device expression evaluates the same IEEE float64 operations in the same order as the
host's Python floats, so the LRs are bit-identical except where ``torch.cos`` and ``math.cos``
differ (on CPU both call the C library's ``cos``; CUDA's double ``cos`` is documented within 2
ulp). "inverse-square-root" and "WSD" (lines 241-245, 259-273) are refused: the main job does
not use them.

Shape key: ``_0`` a 0-dim tensor, ``_1`` a one-element tensor.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List

import torch

__all__ = ["DeviceLRSchedule"]

_STYLES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class _Constants:
    """What the scheduler's ``get_lr`` reads besides ``num_steps``: fixed host numbers that
    ``step()`` bakes into its device ops (a captured graph keeps them)."""

    init_lr: float
    warmup_steps: int
    decay_steps: int
    style: str
    max_lrs: tuple  # per param group: group.get('max_lr', scheduler.max_lr)
    min_lrs: tuple  # per param group: group.get('min_lr', scheduler.min_lr)


def _read_constants(scheduler) -> _Constants:
    style = scheduler.lr_decay_style
    if style not in _STYLES:
        raise ValueError(
            f"DeviceLRSchedule: lr_decay_style {style!r} is not supported on the device (it "
            f"supports {', '.join(_STYLES)}, each with linear warmup); use one of those or keep "
            f"the host scheduler (no graphed optimizer step)")
    if scheduler.wd_incr_style != "constant":
        raise ValueError(
            f"DeviceLRSchedule: wd_incr_style {scheduler.wd_incr_style!r} changes the weight "
            f"decay every step, and the device schedule keeps the weight decay as the host float "
            f"(only 'constant' is supported); use wd_incr_style='constant' (start_wd == end_wd)")
    groups = scheduler.optimizer.param_groups
    return _Constants(
        init_lr=float(scheduler.init_lr), warmup_steps=int(scheduler.lr_warmup_steps),
        decay_steps=int(scheduler.lr_decay_steps), style=style,
        max_lrs=tuple(float(g.get("max_lr", scheduler.max_lr)) for g in groups),
        min_lrs=tuple(float(g.get("min_lr", scheduler.min_lr)) for g in groups),
    )


class DeviceLRSchedule:
    """Megatron's ``OptimizerParamScheduler`` LR schedule with the step count and the per-group
    LRs as float64 0-dim device tensors.

    Attributes:
        step_0: the scheduler's ``num_steps`` (float64, exact up to 2**53).
        lrs: per param group of ``scheduler.optimizer.param_groups`` (same order), the ``lr``
            the scheduler would have written at ``step_0``.
        groups: those param-group dicts (``SyncFreeOptimizer.use_device_lr`` matches its
            groups against them).
    """

    def __init__(self, constants: _Constants, groups: list, device):
        self.c = constants
        self.groups = list(groups)
        self.step_0 = torch.zeros((), dtype=torch.float64, device=device)
        self.device = self.step_0.device  # "cuda" -> cuda:<current>, as tensors report it
        self.lrs: List[torch.Tensor] = [
            torch.zeros((), dtype=torch.float64, device=self.device) for _ in self.groups]

    @classmethod
    def from_scheduler(cls, scheduler, device) -> "DeviceLRSchedule":
        """The schedule of a Megatron ``OptimizerParamScheduler`` at its current ``num_steps``."""
        schedule = cls(_read_constants(scheduler), scheduler.optimizer.param_groups, device)
        schedule._fill(scheduler)
        return schedule

    def _fill(self, scheduler) -> None:
        """Host values (no graph): the scheduler's own ``get_lr`` at its ``num_steps``."""
        self.step_0.fill_(float(scheduler.num_steps))
        for lr_0, group in zip(self.lrs, self.groups):
            lr_0.fill_(scheduler.get_lr(group))

    def load_from(self, scheduler) -> None:
        """Refill the step count and the LRs from the host ``scheduler`` (after a checkpoint
        resume; outside any graph). Its schedule must be the one this object was built from:
        the constants are baked into a captured ``step()``."""
        c = _read_constants(scheduler)
        groups = scheduler.optimizer.param_groups
        if c != self.c or len(groups) != len(self.groups) or any(
                a is not b for a, b in zip(groups, self.groups)):
            raise ValueError(
                f"DeviceLRSchedule.load_from: the scheduler's schedule or param groups differ "
                f"from those this schedule was built from ({c} vs {self.c}); a captured step "
                f"would keep the old ones: build a new DeviceLRSchedule.from_scheduler (and "
                f"recapture) instead")
        self._fill(scheduler)

    @torch.no_grad()
    def step(self) -> None:
        """``OptimizerParamScheduler.step(increment=1)`` on the device: ``step_0 += 1``, every
        LR recomputed in place. Device ops only (graph-capturable, no host read)."""
        c = self.c
        n_0 = self.step_0.add_(1.0)
        if c.style != "constant":
            ratio_0 = (n_0 - c.warmup_steps) / float(c.decay_steps - c.warmup_steps)
            if c.style == "linear":
                coeff_0 = 1.0 - ratio_0
            else:
                coeff_0 = 0.5 * (torch.cos(math.pi * ratio_0) + 1.0)
            past_0 = n_0 > c.decay_steps
        warm_0 = n_0 <= c.warmup_steps if c.warmup_steps > 0 else None
        for lr_0, max_lr, min_lr in zip(self.lrs, c.max_lrs, c.min_lrs):
            if c.style == "constant":
                new_0 = torch.full_like(n_0, max_lr)
            else:
                new_0 = torch.where(past_0, min_lr, min_lr + coeff_0 * (max_lr - min_lr))
            if warm_0 is not None:
                ramp_0 = c.init_lr + ((max_lr - c.init_lr) * n_0 / float(c.warmup_steps))
                new_0 = torch.where(warm_0, ramp_0, new_0)
            lr_0.copy_(new_0)
