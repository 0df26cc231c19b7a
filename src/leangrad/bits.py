"""Exact savings for any model: layers that keep less for the backward pass than
PyTorch's, with the same forward and the same gradient.

- ReLU keeps a 1-bit mask of ``y > 0`` instead of its output (:class:`BitReLU`, from
  randomized AD's section 4.2 accounting), LeakyReLU a 1-bit mask of ``x > 0``
  (:class:`BitLeakyReLU`), dropout a 1-bit mask instead of PyTorch's 1-byte bool mask
  (:class:`BitDropout`: the same masks, drawn by the same kernel from the same RNG);
- average pooling keeps nothing (its Jacobian is constant).

A saving is real only where nothing else keeps the full tensor anyway: a ReLU whose
output feeds a ``Linear``, a convolution or a BatchNorm is kept by that layer (the 1-bit
mask is then 1/32 *more*); a ReLU read only by dropout or a residual add saves it all,
and so does every dropout (on CPU PyTorch keeps its mask as a full float tensor) and
average pooling. :func:`swap` reports what it changed; the planner
(:func:`leangrad.plan`) measures whether it pays on a given model. As a transform:
``leangrad.engine("bits")``, ``"checkpoint+bits"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layers._bits import PackedBits, pack_bits, unpack_bits, unpack_nonzero
from .layers._functorch import plain_ops
from .rad._relu import BitReLU, LeanAdaptiveAvgPool2d, LeanAvgPool2d

__all__ = [
    "BitDropout",
    "BitLeakyReLU",
    "BitReLU",
    "LeanAdaptiveAvgPool2d",
    "LeanAvgPool2d",
    "SwapReport",
    "swap",
]


class _BitLeakyReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slope: float) -> torch.Tensor:
        packed = pack_bits(x > 0)  # leaky_relu_backward's own test: input > 0
        ctx.save_for_backward(packed.data)
        ctx.shape, ctx.slope = packed.shape, slope
        return F.leaky_relu(x, slope)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (data,) = ctx.saved_tensors
        positive = unpack_nonzero(PackedBits(data, ctx.shape))  # leaky_relu's test: > 0
        return torch.ops.aten.leaky_relu_backward(g, positive, ctx.slope, False), None


class BitLeakyReLU(nn.LeakyReLU):
    """``nn.LeakyReLU`` keeping its derivative as 1 bit per element (exact)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if plain_ops():  # torch.func transforms: the same op, nothing saved anyway
            return F.leaky_relu(x, self.negative_slope)
        return _BitLeakyReLUFn.apply(x, self.negative_slope)


class _BitDropoutFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float) -> torch.Tensor:
        out, mask = torch.ops.aten.native_dropout(x, p, True)  # nn.Dropout's kernel and RNG
        packed = pack_bits(mask)
        ctx.save_for_backward(packed.data)
        ctx.shape, ctx.scale = packed.shape, 1.0 / (1.0 - p)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (data,) = ctx.saved_tensors
        mask = unpack_bits(PackedBits(data, ctx.shape))
        return torch.ops.aten.native_dropout_backward(g, mask, ctx.scale), None


class BitDropout(nn.Dropout):
    """``nn.Dropout`` keeping its mask as 1 bit per element instead of a byte (exact: the
    same kernel draws the same masks from the same RNG stream)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.p == 1:
            return torch.zeros_like(x)
        if plain_ops():  # torch.func transforms: nn.Dropout's call (the engines replay its mask)
            return F.dropout(x, self.p, True)
        return _BitDropoutFn.apply(x, self.p)


@dataclasses.dataclass(frozen=True)
class SwapReport:
    """What :func:`swap` changed: module name -> ``"ReLU -> BitReLU"``."""

    swapped: dict[str, str]

    def __str__(self) -> str:
        if not self.swapped:
            return ("bits: nothing to swap (no nn.ReLU, nn.LeakyReLU, nn.Dropout or average "
                    "pooling modules; functional calls such as F.relu are not seen)")  # fmt: skip
        return "bits: " + ", ".join(f"{k}: {v}" for k, v in self.swapped.items())


def _replacement(m: nn.Module) -> nn.Module | None:
    t = type(m)
    if t is nn.ReLU:
        return BitReLU()
    if t is nn.LeakyReLU:
        return BitLeakyReLU(m.negative_slope)  # type: ignore[arg-type]
    if t is nn.Dropout:
        new = BitDropout(m.p)  # type: ignore[arg-type]
        new.train(m.training)
        return new
    if t is nn.AvgPool2d:
        return LeanAvgPool2d(m.kernel_size, m.stride, m.padding, m.ceil_mode,  # type: ignore[arg-type]
                             m.count_include_pad, m.divisor_override)  # type: ignore[arg-type]  # fmt: skip
    if t is nn.AdaptiveAvgPool2d:
        return LeanAdaptiveAvgPool2d(m.output_size)  # type: ignore[arg-type]
    return None


def swap(model: nn.Module) -> SwapReport:
    """Swap ``model``'s ReLU, LeakyReLU, Dropout and average-pooling modules for the exact
    lean versions above, in place (they hold no parameters). Returns what changed."""
    swapped: dict[str, str] = {}
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            new = _replacement(child)
            if new is not None:
                setattr(parent, child_name, new)
                full = f"{name}.{child_name}" if name else child_name
                swapped[full] = f"{type(child).__name__} -> {type(new).__name__}"
    return SwapReport(swapped)
