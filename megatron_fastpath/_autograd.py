"""Autograd helpers shared by the capabilities."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["call_in_backward"]


class _CallInBackward(torch.autograd.Function):
    """Identity on ``x`` whose backward calls ``callback()`` before passing the gradient on:
    on a layer's output it marks where the layer's backward starts, on its input where it ends."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


def call_in_backward(x: torch.Tensor, callback: Callable[[], None]) -> torch.Tensor:
    """``x`` (a view of it) whose gradient arrival first runs ``callback``."""
    return _CallInBackward.apply(x, callback)
