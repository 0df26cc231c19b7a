"""Layers that save (almost) nothing: a ReLU keeping 1 bit per element, and average pooling.

Randomized AD, section 4.2 and Appendix A's memory accounting: "∂a/∂h contains
the Jacobian of the ReLU activation function. This can be compactly stored using
1-bit per entry", and "the average pool and bias gradients does not require
saving since the gradient is constant". The public PrincetonLIPS code stores the
ReLU input in full and lets average pooling save its input; these layers store
what the paper counts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers._bits import PackedBits, pack_bits, unpack_nonzero
from ..layers._functorch import plain_ops
from . import _errors as errors

__all__ = ["BitReLU", "LeanAdaptiveAvgPool2d", "LeanAvgPool2d"]


class _BitReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        packed = pack_bits(~(y <= 0))  # autograd's test (threshold_backward): NaN passes
        ctx.save_for_backward(packed.data)
        ctx.shape = packed.shape
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (data,) = ctx.saved_tensors
        kept = unpack_nonzero(PackedBits(data, ctx.shape))  # threshold_backward tests > 0
        return torch.ops.aten.threshold_backward(g, kept, 0)


class BitReLU(nn.Module):
    """``relu(x)`` saving its derivative as a bit-packed mask: ``ceil(numel/8)`` bytes.

    Exact (forward and gradient); 32x less saved memory than a float32 activation.
    Under ``torch.func`` transforms (which save nothing) it is ``torch.relu``.
    """

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        del inplace  # the output is always a new tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if plain_ops():  # torch.func transforms: the same op, nothing saved anyway
            return torch.relu(x)
        return _BitReLUFn.apply(x)


def _like(g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A zero-stride stand-in of ``shape``: the pooling backwards read only its shape."""
    return g.new_zeros(()).expand(shape)


class _AvgPoolFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, opts: tuple[Any, ...]) -> torch.Tensor:
        ctx.shape, ctx.opts = x.shape, opts
        return F.avg_pool2d(x, *opts)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        kernel, stride, padding, ceil_mode, include_pad, divisor = ctx.opts
        gx = torch.ops.aten.avg_pool2d_backward(
            g, _like(g, ctx.shape), kernel, stride, padding, ceil_mode, include_pad, divisor
        )
        return gx, None


class _AdaptiveAvgPoolFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, size: Any) -> torch.Tensor:
        ctx.shape = x.shape
        return F.adaptive_avg_pool2d(x, size)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.ops.aten._adaptive_avg_pool2d_backward(g, _like(g, ctx.shape)), None


def _check_rank(layer: nn.Module, x: torch.Tensor) -> None:
    if x.dim() not in (3, 4):
        raise errors.RadInputError(errors.BAD_INPUT.format(
            layer=type(layer).__name__, want="an input of shape (N, C, H, W) or (C, H, W)",
            shape=tuple(x.shape), fix=""))  # fmt: skip


def _pair(v: int | tuple[int, ...]) -> list[int]:
    return [v, v] if isinstance(v, int) else list(v)


class LeanAvgPool2d(nn.AvgPool2d):
    """``nn.AvgPool2d`` that saves nothing for backward (its Jacobian is constant)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_rank(self, x)
        stride = self.stride if self.stride is not None else self.kernel_size
        opts = (
            _pair(self.kernel_size), _pair(stride), _pair(self.padding),
            self.ceil_mode, self.count_include_pad, self.divisor_override,
        )  # fmt: skip
        if plain_ops():  # torch.func transforms: the same op, nothing saved anyway
            return F.avg_pool2d(x, *opts)
        return _AvgPoolFn.apply(x, opts)


class LeanAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` that saves nothing for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_rank(self, x)
        if plain_ops():  # torch.func transforms: the same op, nothing saved anyway
            return F.adaptive_avg_pool2d(x, self.output_size)
        return _AdaptiveAvgPoolFn.apply(x, self.output_size)
