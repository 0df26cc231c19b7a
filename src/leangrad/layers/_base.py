"""The chain-layer contract (DESIGN.md, "Layer rules"): the rules an engine may ask for.

A chain layer is an ``nn.Module`` mapping one tensor to one tensor, with these
rules beside its ``forward`` (each has a generic default where one exists):

- ``residual(x, y)``: minimal data to pull a cotangent back to ``x``
  (default: ``x`` itself);
- ``vjp_input(res, h_out)``: ``h_in = h_out · ∂y/∂x`` (default: autograd from ``x``);
- ``vijp(x, h_in)``: ``h_out = h_in · (∂y/∂x)⁺``, submersive layers only
  (default: raises :class:`NotSubmersiveError`);
- ``forward_vjp_params(x, h_out)``: ``(y, {name: h_out · ∂y/∂θ})`` in one forward
  (default: autograd on this layer alone);
- ``inverse(y)``: ``x`` from ``y``, invertible layers only (default: raises
  :class:`NotInvertibleError`);
- ``check(x=None)``: validate the layer's conditions (default: nothing to check).

Moonwalk v2 (Krylov, Karamzade, Fox, AISTATS 2026), eqs. (8)–(10): with the
input cotangent h₀ known, ``h_i = vijp(f_i, x_{i−1}, h_{i−1})`` and
``g_i = h_i ∂x_i/∂θ_i`` recover every parameter gradient in a forward sweep.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from .._errors import LeangradError

__all__ = [
    "FRAGMENT_RULE",
    "INPUT_DTYPE",
    "KEEP_MARGIN",
    "NOT_POSITIVE_INT",
    "PRECISION_LOSS",
    "PRECISION_WARN_RTOL",
    "VIJP_AMPLIFICATION_LIMIT",
    "ChainLayer",
    "FragmentalLayer",
    "LayerConditionError",
    "NotInvertibleError",
    "NotSubmersiveError",
    "PrecisionWarning",
    "VijpPrecision",
    "autograd_forward_vjp_params",
    "autograd_vjp_input",
    "chain_dtype",
    "check_input_dtype",
    "param_grad_input",
    "positive_int",
    "precision_keep_points",
    "vijp_precision",
    "warn_vijp_precision",
]


class NotSubmersiveError(LeangradError, TypeError):
    """A layer without a right-inverse Jacobian was asked for a vijp."""


class NotInvertibleError(LeangradError, TypeError):
    """A layer without an inverse was asked to invert."""


class LayerConditionError(LeangradError, ValueError):
    """A layer's construction or input violates a condition its rules rely on."""


NOT_SUBMERSIVE = (
    "{layer} is not submersive (its Jacobian has no right-inverse), so Moonwalk cannot "
    "rebuild its output cotangent from its input cotangent; make it submersive (e.g. "
    "leangrad.layers.SubmersiveConv2d, whose Lemma 1 conditions guarantee it), move it "
    "into the chain's head, or use the 'checkpoint' engine"
)
NOT_POSITIVE_INT = "{layer}: {name} must be a positive int, got {value!r}"
INPUT_DTYPE = (
    "{layer} has {param} parameters but got an input of dtype {dtype}; cast the input, "
    "e.g. x.to({param}), or the layer, e.g. layer.to({dtype})"
)
NOT_INVERTIBLE = (
    "{layer} is not invertible, so 'revbackprop' cannot recompute its input; "
    "use the 'moonwalk' or 'checkpoint' engine"
)
FRAGMENT_RULE = (
    "{layer} is a FragmentalLayer but does not implement {rule}; implement check_fragment, "
    "fragments and vijp_fragments (see leangrad.layers.FragmentalConv1d)"
)


def positive_int(layer: str, name: str, value: object) -> int:
    """``value`` as an int >= 1 (numpy ints too), else :class:`LayerConditionError`.

    Never rounds: ``4.7`` features is an error, not 4; ``True`` is not 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise LayerConditionError(NOT_POSITIVE_INT.format(layer=layer, name=name, value=value))
    return int(value)


def check_input_dtype(layer: str, x: torch.Tensor, param: torch.Tensor) -> None:
    """A floating input must have its layer's parameter dtype (autocast regions excepted:
    there the kernels cast both), named here instead of as a raw kernel error."""
    if (
        x.dtype != param.dtype
        and x.is_floating_point()
        and not torch.is_autocast_enabled(x.device.type)
    ):
        raise LayerConditionError(INPUT_DTYPE.format(layer=layer, param=param.dtype, dtype=x.dtype))


def autograd_vjp_input(layer: nn.Module, x: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """``h_out · ∂layer/∂x`` by autograd (recomputes the layer's forward from ``x``)."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        y = layer(xg)
        (h_in,) = torch.autograd.grad(y, xg, h_out)
    return h_in


def param_grad_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, as the input of a forward whose backward asks for the parameters'
    gradients alone — copied to the standard layout when its channels are innermost
    (channels-last, or a slice of it): PyTorch's GroupNorm backward on such an input
    without an input gradient dereferences the missing one and kills the process (a
    segfault, CPU). Any other input is used as it is (no copy)."""
    x = x.detach()
    if x.dim() in (4, 5) and not x.is_contiguous() and x.stride(1) == min(x.stride()):
        return x.contiguous()
    return x


def autograd_forward_vjp_params(
    layer: nn.Module, x: torch.Tensor, h_out: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(layer(x), {name: h_out · ∂layer/∂θ})`` with one forward and one backward."""
    params = {n: p for n, p in layer.named_parameters() if p.requires_grad}
    with torch.enable_grad():
        y = layer(param_grad_input(x) if params else x.detach())
        if not params:
            return y.detach(), {}
        grads = torch.autograd.grad(y, list(params.values()), h_out, allow_unused=True)
    out = {
        n: (g if g is not None else torch.zeros_like(p))
        for (n, p), g in zip(params.items(), grads, strict=True)
    }
    return y.detach(), out


class ChainLayer(nn.Module):
    """Base class of layers that carry Moonwalk/RevBackprop rules.

    Subclasses implement ``forward`` and override the rules they can do better
    than the defaults. Class attributes say what the layer is:

    Attributes:
        submersive: ``vijp`` is implemented (the Jacobian is right-invertible).
        invertible: ``inverse`` is implemented.
        vijp_needs_input: ``vijp`` reads ``x`` (``False`` for linear layers).
        fragmental: not submersive, but a :class:`FragmentalLayer`, whose
            ``vijp_fragments`` rebuilds the output cotangent from fragments of it kept in
            Phase II (Moonwalk v2 section 5.1, fragmental checkpointing).
    """

    submersive: ClassVar[bool] = False
    fragmental: ClassVar[bool] = False
    invertible: ClassVar[bool] = False
    vijp_needs_input: ClassVar[bool] = True
    """``False`` when ``vijp`` ignores ``x`` (a linear layer: its Jacobian is constant), so
    an engine may call ``vijp(None, h_in)`` and build ``x`` only afterwards."""

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        """What Phase I keeps to compute ``vjp_input`` later. Default: ``x`` itself."""
        del y
        return x

    def vjp_input(self, res: Any, h_out: torch.Tensor) -> torch.Tensor:
        """Input cotangent from the output cotangent. Default: autograd from ``res = x``."""
        return autograd_vjp_input(self, res, h_out)

    def vijp(self, x: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
        """Output cotangent from the input cotangent (right-inverse Jacobian product)."""
        del x, h_in
        raise NotSubmersiveError(NOT_SUBMERSIVE.format(layer=self._describe()))

    def vijp_amplification(self) -> float:
        """How much ``vijp`` can enlarge the relative rounding error of a cotangent that a
        channel-mixing layer composed before it (≥ 1; see :func:`vijp_precision`).

        1 (the default) for a layer whose Jacobian scales every element alike; a layer
        whose vijp divides some elements by a small derivative and others not (a
        LeakyReLU: ``1/slope`` where ``x ≤ 0``, 1 elsewhere) returns the spread.
        """
        return 1.0

    def forward_vjp_params(
        self, x: torch.Tensor, h_out: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The output and the parameter gradients ``{name: h_out · ∂y/∂θ}``."""
        return autograd_forward_vjp_params(self, x, h_out)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """The input that produced ``y``."""
        del y
        raise NotInvertibleError(NOT_INVERTIBLE.format(layer=self._describe()))

    def check(self, x: torch.Tensor | None = None) -> None:
        """Raise :class:`LayerConditionError` naming a violated condition (``x``: an input)."""
        del x

    def _describe(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


class FragmentalLayer(ChainLayer):
    """Base class of chain layers that are not submersive but whose output cotangent can be
    rebuilt from their input cotangent and *fragments* of the output cotangent kept in
    Phase II: fragmental checkpointing (Moonwalk v2 section 5.1, Appendix 10, Algorithm 3),
    which ``moonwalk(fragment=B)`` runs through the three rules below.
    """

    submersive: ClassVar[bool] = False
    fragmental: ClassVar[bool] = True

    def check_fragment(self, block: int) -> None:
        """Raise :class:`LayerConditionError` unless fragments of blocks of ``block`` (B)
        positions can rebuild this layer's output cotangent."""
        raise NotImplementedError(
            FRAGMENT_RULE.format(layer=type(self).__name__, rule="check_fragment")
        )

    def fragments(self, h_out: torch.Tensor, block: int) -> Any:
        """What Phase II keeps of the output cotangent ``h_out`` (blocks of ``block``)."""
        raise NotImplementedError(
            FRAGMENT_RULE.format(layer=type(self).__name__, rule="fragments")
        )

    def vijp_fragments(
        self, x: torch.Tensor | None, h_in: torch.Tensor, frags: Any, block: int
    ) -> torch.Tensor:
        """The output cotangent, rebuilt from the input cotangent ``h_in`` and
        :meth:`fragments` of it (``x`` is ``None`` when ``vijp_needs_input`` is false)."""
        raise NotImplementedError(
            FRAGMENT_RULE.format(layer=type(self).__name__, rule="vijp_fragments")
        )


# --------------------------------------------------------------------------- precision
VIJP_AMPLIFICATION_LIMIT = 256.0
"""The estimated rounding-error amplification a run of vijps may reach without a
:class:`PrecisionWarning`: 256x autograd's error, ~3e-5 relative in float32."""
PRECISION_WARN_RTOL = 3e-5
"""...provided the estimated relative error also exceeds this, so that float64 warns
only where its error grows past what float32 autograd would give."""
KEEP_MARGIN = 16.0
""":func:`precision_keep_points` caps every run at the warning's limit / this: the
estimate is the typical growth, and the worst measured runs exceed it several times
(a cap of 64 left 7x autograd's error on one seed of 40; 16 leaves ≤ 1.9x)."""

PRECISION_LOSS = (
    "{engine}: in {dtype}, the forward sweep of vijps runs through {count} layers whose "
    "vijp divides by a small derivative ({layers}); it amplifies rounding errors by about "
    "{amp:.2g}x (the product of √(1/slope) over them), so the gradients of the deepest "
    "layers may be off by ~{estimate:.1g} relative ({dtype} eps: {eps:.1g}); "
    "for autograd's accuracy run in float64 (model.double()), make those layers better "
    "conditioned (a LeakyReLU: negative_slope ≥ {slope:.2g} keeps the amplification under "
    "{limit:.3g}x), or use the 'checkpoint' engine"
)


class PrecisionWarning(UserWarning):
    """A leangrad result that is exact in exact arithmetic is expected to lose many more
    floating-point digits than autograd's (e.g. float32 Moonwalk through a deep chain of
    LeakyReLUs with a small slope); the message names the estimate and the fix."""


_WARNED: set[str] = set()
"""Messages :func:`warn_vijp_precision` already emitted in this process (each once)."""


@dataclass(frozen=True)
class VijpPrecision:
    """The estimated rounding-error growth of a chain's forward sweep of vijps.

    Attributes:
        amplification: the largest product of ``√vijp_amplification()`` over one run of
            vijps (the layers between two cotangents taken from the backward pass).
        layers: the amplifying layers (``vijp_amplification() > 1``) of that run.
        eps: the machine epsilon of the dtype.
    """

    amplification: float
    layers: tuple[ChainLayer, ...]
    eps: float

    @property
    def estimate(self) -> float:
        """The estimated relative error of the deepest gradients, ``eps · amplification``."""
        return self.eps * self.amplification

    @property
    def amplification_limit(self) -> float:
        """The amplification that passes without a warning in this dtype."""
        return max(VIJP_AMPLIFICATION_LIMIT, PRECISION_WARN_RTOL / self.eps)

    @property
    def exceeded(self) -> bool:
        """The estimate exceeds both ``VIJP_AMPLIFICATION_LIMIT``·eps and
        ``PRECISION_WARN_RTOL``: the case :func:`warn_vijp_precision` warns about."""
        return self.amplification > self.amplification_limit


def vijp_precision(
    layers: Sequence[ChainLayer], dtype: torch.dtype, *, kept: Collection[int] = ()
) -> VijpPrecision:
    """Estimate how much a forward sweep of vijps over ``layers`` amplifies rounding errors.

    Why it grows: a channel-mixing layer's vjp (e.g. a triangular conv's) adds, into one
    channel, that channel's own cotangent and the other channels'; a LeakyReLU then scales
    each element by 1 or by ``slope`` depending on its sign. After n such pairs a
    channel's own part may be ``slope^k`` times smaller than the parts mixed into it, and
    storing the sum in the working precision rounds that part at ``eps`` of the sum. The
    vijps divide the ``slope^k`` back out, so the recovered cotangent carries an error
    ``eps/slope^k``: it is in the *input* of the sweep (``h₀`` as stored), so no
    reordering of the vijps' own arithmetic can remove it (measured: the same error with
    the vijps in float64 from ``h₀`` rounded to float32). With random signs, k ≈ n/2, so
    the estimate is ``eps · Π √vijp_amplification()``; on ``submersive_cnn(3, 4, d, 3,
    stem="repeat")`` at 256×256 in float32 (worst of 12 seeds, relative to float64
    autograd; float32 autograd: ≤ 4e-6), slope 0.1: d = 4: 9e-7 (estimate 1.2e-5), 6: 3e-6
    (1.2e-4), 7: 4e-5 (3.8e-4), 8: 4e-4 (1.2e-3); slope 0.01: d = 4: 2e-5 (1.2e-3), 5: 2e-3
    (1.2e-2), 8: 25 (12). It is an estimate, not a bound: the worst case is the full
    product (``eps/slope^n``).

    A run ends where the output cotangent comes from the backward pass instead of a vijp:
    at a layer that is not submersive (its cotangent is kept, ``fragment=``) and at the
    indices in ``kept``.
    """
    eps = torch.finfo(dtype).eps
    best = VijpPrecision(1.0, (), eps)
    amp = 1.0
    run: list[ChainLayer] = []
    for i, layer in enumerate(layers):
        if not layer.submersive or i in kept:
            amp, run = 1.0, []
            continue
        a = layer.vijp_amplification()
        if a > 1:
            amp *= math.sqrt(a)
            run.append(layer)
            if amp > best.amplification:
                best = VijpPrecision(amp, tuple(run), eps)
    return best


def precision_keep_points(
    layers: Sequence[ChainLayer], dtype: torch.dtype, *, limit: float | None = None
) -> list[int]:
    """Indices of the layers whose output cotangent an engine should take from its backward
    pass (instead of the vijp) so that no run of vijps amplifies rounding errors beyond
    ``limit`` (default: the warning's :attr:`VijpPrecision.amplification_limit` for
    ``dtype`` / :data:`KEEP_MARGIN`: 16 in float32).

    In a downsampling CNN the amplification builds up in the deep layers, whose
    cotangents are small, so the points are few and small (measured: ``docs/layers.md``).
    """
    eps = torch.finfo(dtype).eps
    cap = (
        limit if limit is not None
        else VijpPrecision(1.0, (), eps).amplification_limit / KEEP_MARGIN
    )  # fmt: skip
    points: list[int] = []
    amp = 1.0
    for i, layer in enumerate(layers):
        if not layer.submersive:
            amp = 1.0
            continue
        amp *= math.sqrt(max(layer.vijp_amplification(), 1.0))
        if amp > cap:
            points.append(i)
            amp = 1.0
    return points


def chain_dtype(
    layers: Sequence[ChainLayer], inputs: Sequence[object]
) -> torch.dtype | None:
    """The floating dtype the chain computes in: its first floating parameter or buffer's,
    else the first floating input's (None if there is neither)."""
    for layer in layers:
        for t in (*layer.parameters(), *layer.buffers()):
            if t.is_floating_point():
                return t.dtype
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.dtype
    return None


def warn_vijp_precision(
    engine: str,
    layers: Sequence[ChainLayer],
    inputs: Sequence[object],
    *,
    kept: Collection[int] = (),
    stacklevel: int = 4,
) -> VijpPrecision | None:
    """Emit a :class:`PrecisionWarning` (once per distinct message and process) when a
    forward sweep of vijps over ``layers`` is estimated to lose digits beyond
    :data:`VIJP_AMPLIFICATION_LIMIT` × autograd's and :data:`PRECISION_WARN_RTOL`
    (:func:`vijp_precision`). Returns the estimate (None when no dtype is known)."""
    dtype = chain_dtype(layers, inputs)
    if dtype is None:
        return None
    prec = vijp_precision(layers, dtype, kept=kept)
    if not prec.exceeded:
        return prec
    n = len(prec.layers)
    spread = prec.amplification_limit ** (2.0 / n)  # Π √a ≤ limit with every a equal
    names = sorted({layer._describe() for layer in prec.layers})
    msg = PRECISION_LOSS.format(
        engine=engine,
        dtype=str(dtype).removeprefix("torch."),
        count=n,
        layers=", ".join(names),
        amp=prec.amplification,
        estimate=min(prec.estimate, 1.0),
        eps=prec.eps,
        slope=1.0 / spread,
        limit=prec.amplification_limit,
    )
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, PrecisionWarning, stacklevel=stacklevel)
    return prec
