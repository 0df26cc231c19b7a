"""``RandLinear``: a linear layer whose weight gradient is estimated from a sampled input.

Randomized AD, section 4.2 (eq. 7 and after): in ``h = W a + b`` the memory
bottleneck of backprop is ``∂h/∂W = a``, the layer's input. RAD stores a
random reduced copy ``S_P[a]`` (section 3.2) and forms ``∂L/∂W = gᵀ â`` with
``E[â] = a``, so the weight gradient is unbiased. The input gradient
``g W`` needs only ``W``, a parameter kept anyway, so it stays exact, and the
bias gradient ``Σ g`` needs nothing.
"""

from __future__ import annotations

from typing import Any, TypedDict, TypeVar, Unpack, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..layers._functorch import plain_ops
from . import _errors as errors
from ._sampling import SampleSpec, draw_seed, make_generator

__all__ = ["RandLinear", "rand_linear"]

_M = TypeVar("_M", bound=nn.Module)


class _RandLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: SampleSpec,
        seed: int,
    ) -> torch.Tensor:
        d = x.shape[-1]
        kept = spec.compress(x.reshape(-1, 1, d), seed)
        ctx.save_for_backward(kept, weight)
        ctx.spec, ctx.seed, ctx.x_shape, ctx.has_bias = spec, seed, x.shape, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        kept, weight = ctx.saved_tensors
        d = ctx.x_shape[-1]
        gx = gw = gb = None
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[0]:
            gx = (g2 @ weight).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            gw = ctx.spec.weight_grad(g2, kept, d, ctx.seed)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb, None, None


def rand_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    spec: SampleSpec,
    seed: int,
    layer: str = "rand_linear",
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose backward sees only ``spec``'s reduced copy of ``x``.

    Args:
        x: input ``(..., in_features)``; mode ``"different"`` samples per row of the
            leading dimensions and needs at least one (a batch).
        weight, bias: as in ``F.linear``.
        spec: what to keep (:class:`SampleSpec`).
        seed: seed of this call's sample or projection (regenerated in backward).
        layer: name used in error messages.

    Returns:
        The exact output; its weight gradient is an unbiased estimate (section 4.2).

    Raises:
        RadInputError: ``spec`` is not a :class:`SampleSpec`, ``x``'s last dimension is not
            the weight's ``in_features``, mode ``"different"`` gets no batch dimension, or
            it runs under a ``torch.func`` transform (which never runs the estimator).
    """
    if not isinstance(spec, SampleSpec):
        raise errors.RadInputError(errors.NOT_A_SPEC.format(type=type(spec).__name__))
    if plain_ops():  # its estimator lives in autograd's backward, which transforms never run
        raise errors.RadInputError(errors.UNDER_TRANSFORM.format(layer=layer))
    features = weight.shape[-1]
    if x.dim() == 0 or x.shape[-1] != features:
        raise errors.RadInputError(errors.BAD_INPUT.format(
            layer=layer, want=f"an input of shape (..., {features})", shape=tuple(x.shape),
            fix=f"; its last dimension must be the layer's {features} input features"))  # fmt: skip
    if x.dim() < 2 and spec.mode == "different" and not spec.exact:
        raise errors.RadInputError(
            errors.NEEDS_BATCH.format(layer=layer, mode=spec.mode, shape=tuple(x.shape))
        )
    return _RandLinearFn.apply(x, weight, bias, spec, seed)


class LayerOptions(TypedDict, total=False):
    """The keyword-only options of every RAD layer's constructor, after its ``nn`` base's
    own arguments (defaults in :meth:`SampledLayer.__init__`, their one home)."""

    fraction: float
    mode: str
    replace: bool
    seed: int | None
    device: torch.device | str | None
    dtype: torch.dtype | None


class SampledLayer:
    """Mixin of the RAD layers (listed before their ``nn`` base): what each shares, its
    :class:`SampleSpec` and the generator that seeds each call's sample."""

    spec: SampleSpec
    generator: torch.Generator | None

    def __init__(
        self,
        *base_args: Any,
        fraction: float = 0.1,
        mode: str = "different",
        replace: bool = False,
        seed: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Build the ``nn`` base from ``base_args`` (its positional arguments) and the
        factory arguments, then ``spec`` from the sampling options and ``generator`` from
        ``seed``."""
        cast(Any, super()).__init__(*base_args, device=device, dtype=dtype)  # the nn base
        self.spec, self.generator = SampleSpec(fraction, mode, replace), make_generator(seed)

    def _options_repr(self) -> str:
        s = self.spec
        return f"fraction={s.fraction}, mode={s.mode!r}, replace={s.replace}"

    def _draw_seed(self) -> int:
        """The seed of this call's sample, drawn from ``generator``."""
        return draw_seed(self.generator, layer=type(self).__name__)

    def _rand_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """:func:`rand_linear` with this layer's spec, a fresh seed and its name in errors."""
        name = type(self).__name__
        return rand_linear(x, weight, bias, spec=self.spec, seed=self._draw_seed(), layer=name)


def adopted(
    cls: type[_M],
    source: nn.Module,
    shared: tuple[str, ...],
    spec: SampleSpec,
    generator: torch.Generator | None,
) -> _M:
    """A ``cls`` holding ``spec`` and ``generator`` and ``source``'s attributes ``shared``
    (its sizes and its parameters: the same ``Parameter`` objects, no copies): what
    ``from_linear``/``from_conv``/``from_cell`` build."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    sampled = cast(SampledLayer, new)
    sampled.spec, sampled.generator = spec, generator
    for name in shared:
        setattr(new, name, getattr(source, name))
    return new


class RandLinear(SampledLayer, nn.Linear):
    """``nn.Linear`` with RAD's sampled weight gradient (section 4.2).

    The forward is exact. The weight gradient is unbiased, built from a reduced
    copy of the input: ``fraction`` of its features per example (``"different"``),
    the same features for the whole batch (``"same"``), or a seeded Rademacher
    projection to ``fraction`` of its size (``"project"``, Appendix A). A new
    sample is drawn at every call. Input and bias gradients are exact.

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        fraction: share of input features kept per call, in (0, 1]; 1 is exact.
        mode: ``"different"``, ``"same"`` or ``"project"``.
        replace: sample with replacement (the paper's choice) instead of without.
        seed: seeds this layer's sampler; ``None`` draws from torch's global RNG,
            so ``torch.manual_seed`` makes runs reproducible.

    Trade-off: saved input bytes shrink by ``fraction`` (indices and projection
    matrices are regenerated from a seed, never stored) for extra gradient
    variance; the backward never rebuilds the whole dense input (blocks of rows, or
    factored products).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        **options: Unpack[LayerOptions],
    ) -> None:
        super().__init__(in_features, out_features, bias, **options)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, spec: SampleSpec, generator: torch.Generator | None = None
    ) -> RandLinear:
        """A ``RandLinear`` sharing ``linear``'s weight and bias parameters (no copy)."""
        shared = ("in_features", "out_features", "weight", "bias")
        return adopted(cls, linear, shared, spec, generator)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._options_repr()}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._rand_linear(x, self.weight, self.bias)
