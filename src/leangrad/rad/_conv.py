"""``RandConv2d``: a convolution whose weight gradient is estimated from sampled positions.

Randomized AD, section 4.2 and Figure 4: "For X and H we sample spatial elements
and compute the Jacobians ∂H/∂W with the sparse tensors." The input is stored
at ``fraction`` of its spatial positions (all channels of a kept position), per
example (``"different"``), shared by the batch (``"same"``), or projected over
positions by a seeded Rademacher matrix (``"project"``), rescaled so that the
weight gradient is unbiased. The input gradient needs only the weight and stays
exact; the bias gradient needs nothing.
"""

from __future__ import annotations

from typing import Any, Unpack

import torch
import torch.nn.functional as F
from torch import nn

from . import _errors as errors
from ._linear import LayerOptions, SampledLayer, adopted
from ._sampling import SampleSpec

__all__ = ["RandConv2d"]


class _RandConvFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        opts: tuple[Any, ...],
        spec: SampleSpec,
        seed: int,
    ) -> torch.Tensor:
        b, c, h, w = x.shape
        kept = spec.compress(x.reshape(b, c, h * w), seed)
        ctx.save_for_backward(kept, weight)
        ctx.spec, ctx.seed, ctx.x_shape, ctx.opts = spec, seed, x.shape, opts
        ctx.has_bias = bias is not None
        return F.conv2d(x, weight, bias, *opts)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        kept, weight = ctx.saved_tensors
        b, c, h, w = ctx.x_shape
        stride, padding, dilation, groups = ctx.opts
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        if need_w:
            x_hat = ctx.spec.expand(kept, h * w, ctx.seed).reshape(b, c, h, w)
        else:  # the input gradient reads only the input's shape
            x_hat = g.new_zeros(()).expand(ctx.x_shape)
        gx, gw, gb = torch.ops.aten.convolution_backward(
            g, x_hat, weight, [weight.shape[0]] if need_b else None,
            list(stride), list(padding), list(dilation), False, [0, 0], groups,
            [need_x, need_w, need_b],
        )  # fmt: skip
        return gx, gw, gb, None, None, None


def _pair(v: Any) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


class RandConv2d(SampledLayer, nn.Conv2d):
    """``nn.Conv2d`` with RAD's sampled weight gradient (section 4.2, Figure 4).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias:
            as ``nn.Conv2d`` (numeric padding, ``padding_mode="zeros"`` only).
        fraction: share of spatial positions kept per call, in (0, 1]; 1 is exact.
        mode: ``"different"`` (per example), ``"same"`` (per batch) or ``"project"``.
        replace: sample positions with replacement instead of without.
        seed: seeds this layer's sampler; ``None`` uses torch's global RNG.

    Trade-off: the saved input shrinks by ``fraction``; backward rebuilds one dense
    ``x̂`` transiently. Convolutions tie weights over positions, so even ``"same"``
    updates every weight (section 4.3).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        **options: Unpack[LayerOptions],
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
            **options,
        )  # fmt: skip
        if (why := self.supports(self)) is not None:
            raise errors.RadInputError(
                errors.BAD_PADDING.format(layer=type(self).__name__, why=why)
            )

    @staticmethod
    def supports(conv: nn.Conv2d) -> str | None:
        """Why ``conv`` cannot be randomized, or ``None`` when it can."""
        if conv.padding_mode != "zeros":
            return f"padding_mode={conv.padding_mode!r} (only 'zeros')"
        if isinstance(conv.padding, str):
            return f"padding={conv.padding!r} (only numeric padding)"
        return None

    @classmethod
    def from_conv(
        cls, conv: nn.Conv2d, *, spec: SampleSpec, generator: torch.Generator | None = None
    ) -> RandConv2d:
        """A ``RandConv2d`` sharing ``conv``'s weight and bias parameters (no copy)."""
        shared = (*conv.__constants__, "transposed", "_reversed_padding_repeated_twice")
        return adopted(cls, conv, (*shared, "weight", "bias"), spec, generator)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._options_repr()}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        c = self.in_channels
        if x.dim() not in (3, 4) or x.shape[-3] != c:
            raise errors.RadInputError(errors.BAD_INPUT.format(
                layer=type(self).__name__, want=f"an input of shape (N, {c}, H, W) or ({c}, H, W)",
                shape=tuple(x.shape), fix=""))  # fmt: skip
        unbatched = x.dim() == 3
        if unbatched:
            if spec.mode == "different" and not spec.exact:
                raise errors.RadInputError(
                    errors.NEEDS_BATCH.format(layer=type(self).__name__, mode=spec.mode,
                                         shape=tuple(x.shape))
                )  # fmt: skip
            x = x.unsqueeze(0)
        opts = (_pair(self.stride), _pair(self.padding), _pair(self.dilation), self.groups)
        out = _RandConvFn.apply(x, self.weight, self.bias, opts, spec, self._draw_seed())
        return out.squeeze(0) if unbatched else out
