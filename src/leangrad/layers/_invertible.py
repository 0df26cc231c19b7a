"""Invertible, submersive chain layers: activations, the i-RevNet squeeze ψ, RevNet coupling.

Moonwalk v1 (invertible networks), section 4, Algorithm 1: once the input
cotangent ``h_0`` is known, every layer's output cotangent follows in a forward
sweep by a vector-inverse-Jacobian product, ``h_i = vijp(f_i, x_{i-1}, h_{i-1})``
(v1 eq. (10); v2 eq. (9)), and its parameter gradient by ``g_i = h_i ∂x_i/∂θ_i``
(v2 eq. (10)). Section 6.1 builds the network from additive couplings (eqs.
(12)–(13), Gomez et al., 2017) and the invertible down-sampling ψ of i-RevNet
(Jacobsen et al., 2018); RevBackprop recomputes inputs by ``inverse``.

Every layer here is both ``invertible`` (``inverse``) and ``submersive``
(``vijp``), and keeps the smallest residual its ``vjp_input`` needs:

==================  ==========================================  ==================================
layer               residual                                    vijp
==================  ==========================================  ==================================
LeakyReLU           sign of x, 1 bit per element (v2 §4.5)      divide by the slope where x ≤ 0
Tanh                y = tanh(x), full precision                 divide by 1 − y²
SpaceToDepth        nothing (a permutation)                     the same permutation
AdditiveCoupling    x1, half the input (F is recomputed)        one vjp through F
==================  ==========================================  ==================================
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from .._errors import LeangradError
from ._base import ChainLayer, LayerConditionError, param_grad_input
from ._bits import PackedBits, pack_bits, unpack_nonzero

__all__ = ["AdditiveCoupling", "LeakyReLU", "SpaceToDepth", "Tanh"]

SLOPE_NOT_POSITIVE = (
    "LeakyReLU(negative_slope={slope!r}) is not invertible: its Jacobian is singular where "
    "x ≤ 0 unless the slope is a finite number > 0; pass e.g. negative_slope=0.01 "
    "(a slope of 0 is ReLU, which Moonwalk cannot invert: use the fragmental mode for it)"
)
TANH_SATURATED = (
    "{layer}: tanh saturated in {op}: {count} of {numel} elements {detail}, so the Jacobian "
    "is numerically singular there and {what}; lower the learning rate or scale the inputs "
    "so that |x| stays well below {limit:.3g} (where 1 − tanh(x)² rounds to 0 in {dtype}), "
    "or use LeakyReLU, whose vijp and inverse are always finite"
)
BLOCK_NOT_POSITIVE = "SpaceToDepth(block_size={value!r}): block_size must be a positive int"
SPACE_TOO_FEW_DIMS = (
    "{layer} needs an input of shape (..., C, H, W), got shape {shape}; "
    "add a channel dimension, e.g. x.unsqueeze(-3)"
)
SPACE_NOT_DIVISIBLE = (
    "{layer}: spatial size H×W = {h}×{w} is not divisible by the block size {b}; "
    "pad or crop the input to multiples of {b} (e.g. {hp}×{wp}), or use a block size that "
    "divides both"
)
COUPLING_NOT_MODULE = "AdditiveCoupling(F=...) needs an nn.Module, got {type}"
COUPLING_BAD_DIM = "AdditiveCoupling(split_dim={dim!r}): split_dim must be an int"
NOT_FLOAT = "{layer} needs a floating-point input, got dtype {dtype}; cast it, e.g. x.float()"
DEPTH_NOT_DIVISIBLE = (
    "{layer}: inverse needs an input of shape (..., C·{b2}, H, W), got shape {shape}; "
    "its channel count {c} is not divisible by block_size² = {b2} (is it this layer's output?)"
)
COUPLING_FEW_DIMS = (
    "{layer} splits along dim {dim}, but the input has shape {shape}; "
    "pass split_dim= naming the channel dimension"
)
COUPLING_ODD = (
    "{layer}: the input has {size} channels along dim {dim}, an odd number, so it cannot be "
    "split into two halves x1, x2; use an even channel count (e.g. pad with one zero channel)"
)
COUPLING_SHAPE = (
    "{layer}: F must map x1's shape to x2's shape (y2 = x2 + F(x1)), but F maps {shape_in} "
    "to {shape_out}; make F keep the shape (e.g. convolutions with padding='same', stride 1, "
    "and out_channels == in_channels)"
)
COUPLING_F_FAILED = "{layer}: F failed on x1 of shape {shape}: {error}"
COUPLING_BATCHNORM = (
    "{layer}: F contains BatchNorm in training mode ({names}); the rules recompute F "
    "(vjp_input, vijp, forward_vjp_params, inverse), and every recomputation updates the "
    "running statistics again, so they move more than once per step (the gradients are "
    "still exact); put those layers in eval mode, or build them with "
    "track_running_stats=False, if the running statistics matter"
)


class _ParameterFree(ChainLayer):
    """A chain layer without parameters: ``forward_vjp_params`` is its forward, no autograd."""

    def forward_vjp_params(
        self, x: torch.Tensor, h_out: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(y, {})``: no parameters, so no autograd."""
        del h_out
        with torch.no_grad():
            return self(x), {}


# --------------------------------------------------------------------------- LeakyReLU
class LeakyReLU(_ParameterFree):
    """``y = x`` where ``x > 0``, else ``slope · x``: invertible when ``slope > 0``.

    Its Jacobian is the diagonal ``d = where(x > 0, 1, slope)``, so the vjp only
    needs the sign of ``x`` — 1 bit per element, bit-packed (Moonwalk v2,
    section 4.5: "Moonwalk only requires storing the sign of each activation to
    evaluate the LeakyReLU vjp"). The vijp divides by ``d`` (v2 eq. (9)).

    Args:
        negative_slope: the slope for ``x ≤ 0``; a finite number > 0.

    Raises:
        LayerConditionError: ``negative_slope`` is not a finite number > 0.
    """

    submersive = True
    invertible = True

    def __init__(self, negative_slope: float = 0.01) -> None:
        super().__init__()
        is_number = isinstance(negative_slope, numbers.Real) and not isinstance(
            negative_slope, bool
        )
        slope = float(negative_slope) if is_number else math.nan  # a string is not a slope
        if not (slope > 0 and math.isfinite(slope)):
            raise LayerConditionError(SLOPE_NOT_POSITIVE.format(slope=negative_slope))
        self.negative_slope = slope

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (a Proxy is skipped: the layer stays traceable by torch.fx, as fad.nest needs)
        if not isinstance(x, torch.fx.Proxy) and not x.is_floating_point():
            raise LayerConditionError(NOT_FLOAT.format(layer=self._describe(), dtype=x.dtype))
        return F.leaky_relu(x, self.negative_slope)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> PackedBits:
        """The sign mask ``x > 0``, bit-packed: ``ceil(numel / 8)`` bytes (v2 §4.5)."""
        del y
        return pack_bits(x > 0)

    def vjp_input(self, res: PackedBits, h_out: torch.Tensor) -> torch.Tensor:
        """``h_out · where(x > 0, 1, slope)`` from the packed sign (matches autograd at x = 0)."""
        # autograd's own leaky_relu kernel reads the unpacked mask as its x (it tests x > 0):
        # one pass, no temporary (torch.where was 70x slower on CPU, 262k floats); the uint8
        # unpacking feeds it without the bool conversion (1M elements: 2.3 vs 5.6 ms)
        return _leaky_backward(h_out, unpack_nonzero(res), self.negative_slope)

    def vijp(self, x: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
        """``h_in / where(x > 0, 1, slope)``, the inverse of the diagonal Jacobian (v2 eq. (9)),
        as leaky_relu's backward kernel with slope ``1/slope`` (one pass, no temporary; a
        cotangent in another layout, e.g. a fragmental conv's channels-last rebuild, as
        :func:`_leaky_backward` says)."""
        return _leaky_backward(h_in, x, 1.0 / self.negative_slope)

    def vijp_amplification(self) -> float:
        """``max(slope, 1/slope)``: the vijp divides the elements where ``x ≤ 0`` by the slope
        and leaves the others, so after a channel-mixing layer the rounding error of a
        cotangent can grow by up to this factor per LeakyReLU (by its square root for
        random signs; ``leangrad.layers._base.vijp_precision`` has the measurements)."""
        return max(self.negative_slope, 1.0 / self.negative_slope)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``where(y > 0, y, y / slope)`` (y has the sign of x since slope > 0)."""
        return torch.where(y > 0, y, y / self.negative_slope)


def _leaky_backward(h: torch.Tensor, x: torch.Tensor, slope: float) -> torch.Tensor:
    """``h · where(x > 0, 1, slope)`` by leaky_relu's backward kernel. A cotangent in another
    memory layout than a contiguous ``x`` (e.g. channels-last, from a conv's backward) is
    copied to ``x``'s layout and the result written over that copy: the same memory as a
    fresh output, and faster than the mixed-stride kernel (``docs/layers.md``)."""
    op = torch.ops.aten.leaky_relu_backward
    if x.is_contiguous() and not h.is_contiguous():
        hc = h.contiguous()
        return op.grad_input(hc, x, slope, False, grad_input=hc)
    return op(h, x, slope, False)


# --------------------------------------------------------------------------- Tanh
def _saturation_limit(dtype: torch.dtype) -> float:
    """|x| beyond which ``1 − tanh(x)²`` rounds to 0 in ``dtype``: ½·ln(8/eps)."""
    return 0.5 * math.log(8.0 / torch.finfo(dtype).eps)


class Tanh(ChainLayer):
    """``y = tanh(x)``: invertible and submersive while it does not saturate.

    The minimal residual is the output ``y`` itself, at full precision
    (``tanh'(x) = 1 − y²``; its sign alone does not determine it). The vijp
    divides by the same ``1 − tanh(x)²`` that autograd's vjp multiplies by, so the
    two are exact inverses of each other in floating point. Where ``|x|`` is large,
    ``1 − tanh(x)²`` rounds to 0 (saturation: |x| ≳ 19 in float64, ≳ 9 in
    float32); there the Jacobian is numerically singular, and ``vijp`` and
    ``inverse`` raise :class:`LayerConditionError` instead of returning inf/NaN.
    Moonwalk v1, section 6.6, reports the same instability for RevBackprop's
    inverse of tanh.
    """

    submersive = True
    invertible = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The output ``y`` (``tanh' = 1 − y²``)."""
        del x
        return y

    def vjp_input(self, res: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
        """``h_out · (1 − y²)`` with ``res = y`` (autograd's own formula)."""
        return h_out * (1 - res * res)

    def vijp(self, x: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
        """``h_in / (1 − tanh(x)²)`` (v2 eq. (9)); raises where tanh saturated."""
        y = torch.tanh(x)
        deriv = 1 - y * y
        self._raise_if_saturated(
            deriv == 0,
            x,
            op="vijp",
            detail="have 1 − tanh(x)² = 0 (largest |x| = {vmax:.3g})",
            what="vijp would divide by zero",
        )
        return h_in / deriv

    def forward_vjp_params(
        self, x: torch.Tensor, h_out: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(y, {})``: no parameters, so no autograd."""
        del h_out
        with torch.no_grad():
            return torch.tanh(x), {}

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``atanh(y)``; raises where ``|y| ≥ 1`` (saturated: x is lost)."""
        self._raise_if_saturated(
            y.abs() >= 1,
            y,
            op="inverse",
            detail="have |y| ≥ 1 (largest |y| = {vmax:.3g})",
            what="atanh(y) would be ±inf or NaN",
        )
        return torch.atanh(y)

    def _raise_if_saturated(
        self, bad: torch.Tensor, values: torch.Tensor, *, op: str, detail: str, what: str
    ) -> None:
        if bad.is_meta or is_fake(bad):  # shapes only (leangrad.measure.estimate_memory)
            return
        count = int(bad.sum())
        if count == 0:
            return
        vmax = float(values.abs().max())
        raise LayerConditionError(
            TANH_SATURATED.format(
                layer=self._describe(),
                op=op,
                count=count,
                numel=bad.numel(),
                detail=detail.format(vmax=vmax),
                what=what,
                dtype=values.dtype,
                limit=_saturation_limit(values.dtype),
            )
        )


# --------------------------------------------------------------------------- SpaceToDepth
class SpaceToDepth(_ParameterFree):
    """The invertible down-sampling ψ of i-RevNet: ``(…, C, H, W) → (…, C·b², H/b, W/b)``.

    Moonwalk v1, section 6.1: "ψ effectively divides the spatial dimensions into
    the channel dimension". It moves each ``b × b`` spatial block into channels,
    in the order of :func:`torch.nn.functional.pixel_unshuffle` (output channel
    ``c·b² + i·b + j`` holds input ``(c, b·h + i, b·w + j)``). It is a
    permutation ``P`` of the entries — an orthogonal map — so ``vjp_input = Pᵀ =
    P⁻¹ = pixel_shuffle``, ``vijp = P = pixel_unshuffle``, and it stores no
    residual.

    Args:
        block_size: ``b``, the side of the spatial block (2 in i-RevNet).

    Raises:
        LayerConditionError: ``block_size`` is not a positive int; (in ``forward``
            and ``check``) the input has fewer than 3 dims or H, W not divisible by b.
    """

    submersive = True
    vijp_needs_input = False  # a fixed permutation
    invertible = True

    def __init__(self, block_size: int = 2) -> None:
        super().__init__()
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise LayerConditionError(BLOCK_NOT_POSITIVE.format(value=block_size))
        self.block_size = block_size

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check(x)
        return F.pixel_unshuffle(x, self.block_size)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Nothing: the vjp of a permutation needs no data."""
        del x, y

    def vjp_input(self, res: None, h_out: torch.Tensor) -> torch.Tensor:
        """``h_out · P = P⁻¹ h_out``: depth-to-space (``pixel_shuffle``)."""
        del res
        return F.pixel_shuffle(h_out, self.block_size)

    def vijp(self, x: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
        """``h_in · P⁻¹ = P h_in``: space-to-depth (``pixel_unshuffle``)."""
        del x
        self.check(h_in)
        return F.pixel_unshuffle(h_in, self.block_size)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Depth-to-space (``pixel_shuffle``)."""
        b2 = self.block_size**2
        if y.dim() < 3:
            raise LayerConditionError(
                SPACE_TOO_FEW_DIMS.format(layer=self._describe(), shape=tuple(y.shape))
            )
        if y.shape[-3] % b2:
            raise LayerConditionError(
                DEPTH_NOT_DIVISIBLE.format(
                    layer=self._describe(), b2=b2, shape=tuple(y.shape), c=y.shape[-3]
                )
            )
        return F.pixel_shuffle(y, self.block_size)

    def check(self, x: torch.Tensor | None = None) -> None:
        """Raise unless ``x`` is ``(..., C, H, W)`` with H and W divisible by the block size."""
        if x is None:
            return
        if x.dim() < 3:
            raise LayerConditionError(
                SPACE_TOO_FEW_DIMS.format(layer=self._describe(), shape=tuple(x.shape))
            )
        h, w, b = x.shape[-2], x.shape[-1], self.block_size
        if h % b or w % b:
            hp, wp = -(-h // b) * b, -(-w // b) * b
            raise LayerConditionError(
                SPACE_NOT_DIVISIBLE.format(layer=self._describe(), h=h, w=w, b=b, hp=hp, wp=wp)
            )


# --------------------------------------------------------------------------- AdditiveCoupling
def _training_batchnorms(module: nn.Module) -> list[str]:
    return [
        f"F.{name}" if name else "F"
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]


class AdditiveCoupling(ChainLayer):
    """RevNet's additive coupling: ``y1 = x1``, ``y2 = x2 + F(x1)``.

    Moonwalk v1, section 6.1, eqs. (12)–(13) (Gomez et al., 2017): ``x = (x1, x2)``
    is split in halves along ``split_dim``; ``F`` is any module mapping x1's shape
    to x2's shape (it need not be invertible). The Jacobian is block triangular
    ``[[I, 0], [J_F, I]]`` (rows y1, y2), so

    - ``vjp_input``: ``h_in1 = h_out1 + h_out2 J_F``, ``h_in2 = h_out2``;
    - ``vijp`` (v2 eq. (9)): ``h_out2 = h_in2``, ``h_out1 = h_in1 − h_in2 J_F``;
    - ``inverse`` (v1 eq. (13)): ``x1 = y1``, ``x2 = y2 − F(y1)``.

    Each of these runs ``F`` once more (on x1) and does at most one vjp through it;
    the residual is x1 alone, half the input. ``F``'s parameters are named as in
    ``self.named_parameters()`` (``"F.0.weight"``, ...).

    Args:
        F: the coupling function.
        split_dim: the channel dimension to split (1 for ``(N, C, ...)`` inputs).

    Raises:
        LayerConditionError: ``F`` is not a module; (in ``forward`` and ``check``)
            the split dimension has an odd size, or ``F`` changes the shape.

    Warns:
        RuntimeWarning: once per layer, when F contains BatchNorm in training mode,
            whose running statistics every recomputation of F updates again.
    """

    submersive = True
    invertible = True

    def __init__(self, F: nn.Module, *, split_dim: int = 1) -> None:
        super().__init__()
        if not isinstance(F, nn.Module):
            raise LayerConditionError(COUPLING_NOT_MODULE.format(type=type(F).__name__))
        if isinstance(split_dim, bool) or not isinstance(split_dim, int):
            raise LayerConditionError(COUPLING_BAD_DIM.format(dim=split_dim))
        self.F = F
        self.split_dim = split_dim
        self._warned_batchnorm = False

    def extra_repr(self) -> str:
        return f"split_dim={self.split_dim}"

    def _describe(self) -> str:
        return f"AdditiveCoupling(F={type(self.F).__name__}, split_dim={self.split_dim})"

    # -- helpers -----------------------------------------------------------
    def _split(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self.split_dim
        if not -t.dim() <= dim < t.dim():
            raise LayerConditionError(
                COUPLING_FEW_DIMS.format(layer=self._describe(), dim=dim, shape=tuple(t.shape))
            )
        size = t.shape[dim]
        if size % 2:
            raise LayerConditionError(
                COUPLING_ODD.format(layer=self._describe(), size=size, dim=dim)
            )
        a, b = t.split(size // 2, dim=dim)
        return a, b

    def _join(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b], dim=self.split_dim)

    def _check_shape(self, shape_in: torch.Size, shape_out: torch.Size) -> None:
        if shape_out != shape_in:
            raise LayerConditionError(
                COUPLING_SHAPE.format(
                    layer=self._describe(), shape_in=tuple(shape_in), shape_out=tuple(shape_out)
                )
            )

    def _warn_batchnorm_once(self, stacklevel: int) -> None:
        if not self._warned_batchnorm and (names := _training_batchnorms(self.F)):
            self._warned_batchnorm = True
            warnings.warn(
                COUPLING_BATCHNORM.format(layer=self._describe(), names=", ".join(names)),
                RuntimeWarning,
                stacklevel=stacklevel + 1,
            )

    def _recompute(self, x1: torch.Tensor) -> torch.Tensor:
        """``F(x1)`` outside ``forward``: warns (once) if that moves BatchNorm statistics."""
        self._warn_batchnorm_once(stacklevel=3)
        return self.F(x1)

    def _vjp_f(self, x1: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``v · ∂F/∂x1``: one forward of F with a graph, one backward to x1 only."""
        with torch.enable_grad():
            x1g = x1.detach().requires_grad_(True)
            f = self._recompute(x1g)
            if not f.requires_grad:  # F ignores x1
                return torch.zeros_like(x1)
            (g,) = torch.autograd.grad(f, x1g, v, allow_unused=True)
        return g if g is not None else torch.zeros_like(x1)

    # -- the layer and its rules -------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self._split(x)
        try:
            f = self.F(x1)
        except RuntimeError as error:  # e.g. F built for all channels: it sees half of them
            if isinstance(error, (LeangradError, torch.OutOfMemoryError)):
                raise
            raise LayerConditionError(
                COUPLING_F_FAILED.format(layer=self._describe(), shape=tuple(x1.shape), error=error)
            ) from error
        self._check_shape(x2.shape, f.shape)
        return self._join(x1, x2 + f)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``x1``, copied so that it does not keep the whole of ``x``'s storage alive."""
        del y
        return self._split(x)[0].clone(memory_format=torch.contiguous_format)

    def vjp_input(self, res: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
        """``(h_out1 + h_out2 · ∂F/∂x1, h_out2)`` from ``res = x1`` (one vjp through F)."""
        h1, h2 = self._split(h_out)
        return self._join(h1 + self._vjp_f(res, h2), h2)

    def vijp(self, x: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
        """``(h_in1 − h_in2 · ∂F/∂x1, h_in2)`` (v2 eq. (9); one vjp through F)."""
        x1, _ = self._split(x)
        h1, h2 = self._split(h_in)
        return self._join(h1 - self._vjp_f(x1, h2), h2)

    def forward_vjp_params(
        self, x: torch.Tensor, h_out: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``y`` and ``{name: h_out2 · ∂F/∂θ}`` (v2 eq. (10)): one forward, one backward."""
        x1, x2 = self._split(x.detach())
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        with torch.enable_grad() if params else torch.no_grad():
            f = self._recompute(param_grad_input(x1) if params else x1)
        self._check_shape(x2.shape, f.shape)
        y = self._join(x1, x2 + f.detach())
        if not params:
            return y, {}
        _, h2 = self._split(h_out)
        grads = torch.autograd.grad(f, list(params.values()), h2, allow_unused=True)
        out = {
            n: (g if g is not None else torch.zeros_like(p))
            for (n, p), g in zip(params.items(), grads, strict=True)
        }
        return y, out

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``(y1, y2 − F(y1))`` (v1 eq. (13))."""
        y1, y2 = self._split(y)
        with torch.no_grad():
            return self._join(y1, y2 - self._recompute(y1))

    def check(self, x: torch.Tensor | None = None) -> None:
        """Raise unless ``x`` splits in even halves and ``F`` maps x1's shape to x2's.

        ``F`` runs on meta tensors when it can (shapes only, no compute), else on
        ``x1`` with copies of its buffers, so checking never moves BatchNorm
        statistics. Warns (once) about BatchNorm in training mode.
        """
        self._warn_batchnorm_once(stacklevel=2)
        if x is None:
            return
        x1, x2 = self._split(x)
        self._check_shape(x2.shape, self._f_shape(x1))

    def _f_shape(self, x1: torch.Tensor) -> torch.Size:
        state = {**dict(self.F.named_parameters()), **dict(self.F.named_buffers())}
        # tie_weights=False: with True, a module F holds twice is swapped twice and left
        # holding the stand-in (meta) tensors
        try:
            meta = {n: t.to("meta") for n, t in state.items()}
            with torch.no_grad():
                return torch.func.functional_call(
                    self.F, meta, (x1.to("meta"),), tie_weights=False
                ).shape
        except Exception:  # F may not support meta tensors: run it for real
            pass
        copies = {**state, **{n: b.clone() for n, b in self.F.named_buffers()}}
        try:
            with torch.no_grad():
                return torch.func.functional_call(self.F, copies, (x1,), tie_weights=False).shape
        except Exception as error:
            raise LayerConditionError(
                COUPLING_F_FAILED.format(layer=self._describe(), shape=tuple(x1.shape), error=error)
            ) from error
