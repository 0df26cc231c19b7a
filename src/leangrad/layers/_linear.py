"""``SubmersiveLinear``: a dense layer whose Jacobian has a cheap exact right-inverse.

Moonwalk v2 (Krylov, Karamzade, Fox, AISTATS 2026), Definition 1: a layer is
submersive when its input Jacobian is surjective, and then the output cotangent
``h' = vijp(x, h) = h (∂y/∂x)⁺`` (eq. (9)) is unique for every ``h`` in the row
space. For ``y = x Wᵀ + b`` the Jacobian is ``W`` (out × in); it is
right-invertible when its leading out × out block ``A = W[:, :out]`` is, and
Lemma 1 (ii)–(iii) for a 1×1 convolution make ``A`` upper-triangular
(``W[c', c] = 0`` for ``c < c'``) with a diagonal kept away from zero. The vijp
is then one triangular solve, ``h' A = h[..., :out]``, in O(out²) per row.

The diagonal is ``1 + 0.5·tanh(raw)`` ∈ (0.5, 1.5): bounded below, so the
diagonal cannot drift towards 0, and bounded above, so its own spread adds at
most a factor 3 to the condition number of ``A`` (see ``_conv.py`` for the
measurements behind this choice). Ill-conditioning can still come from large
off-diagonal entries; ``vijp`` and ``check`` warn when ``κ₁(A)·eps`` exceeds
:data:`COND_WARN_RTOL`. The helpers here are shared with ``_conv.py``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from ._base import ChainLayer, LayerConditionError, check_input_dtype, positive_int

__all__ = ["SubmersiveLinear", "TriangularLead"]

DIAG_CENTRE = 1.0
DIAG_HALF_SPAN = 0.5
COND_WARN_RTOL = 1e-3
"""Warn when ``κ₁(A) · eps(dtype)`` exceeds this: the vijp may then lose more
than ~0.1 % relative accuracy (float32: κ₁ > 8.4e3; float64: κ₁ > 4.5e12;
float16/bfloat16: κ₁ > 100)."""

LINEAR_TOO_WIDE = (
    "{layer} violates Moonwalk v2 Definition 1 / Lemma 1 (ii): out_features ≤ in_features "
    "(got out_features={n_out} > in_features={n_in}); a layer that widens its input has no "
    "right-inverse Jacobian: use out_features ≤ {n_in}, or a non-submersive nn.Linear with "
    "the fragmental mode of the moonwalk engine"
)
LINEAR_NOT_FLOAT = (
    "{layer} needs a floating-point input, got dtype {dtype}; cast it, e.g. x.float()"
)
LINEAR_BAD_INPUT = (
    "{layer} needs an input of shape (..., {n_in}), got shape {shape}; "
    "flatten the input's last dimensions to in_features={n_in}"
)
ILL_CONDITIONED = (
    "{layer}: the triangular block the vijp solves with (Lemma 1 (ii)-(iii)) is "
    "ill-conditioned: κ₁ = {kappa:.3g} (min |diagonal| {dmin:.3g}, max |off-diagonal| "
    "{omax:.3g}), so the vijp in {dtype} may lose ~{loss:.1g} relative accuracy; legal, but "
    "shrink the off-diagonal weights (weight decay, a lower learning rate) or compute in float64"
)


def diag_from_raw(raw: torch.Tensor) -> torch.Tensor:
    """The triangular block's diagonal, ``1 + 0.5·tanh(raw)`` ∈ (0.5, 1.5)."""
    return DIAG_CENTRE + DIAG_HALF_SPAN * torch.tanh(raw)


def diag_grad_from_raw(raw: torch.Tensor) -> torch.Tensor:
    """``d diag / d raw``."""
    return DIAG_HALF_SPAN * (1.0 - torch.tanh(raw) ** 2)


def triangular_inverse(a: torch.Tensor, layer: str, *, stacklevel: int = 3) -> torch.Tensor:
    """``A⁻¹`` of an upper-triangular ``A``; warns naming ``layer`` if ``A`` is ill-conditioned.

    The explicit inverse costs O(n³/3) once per call (n = channels, not
    positions) and turns every solve into one matrix product; it also gives
    the 1-norm condition number ``κ₁ = ‖A‖₁‖A⁻¹‖₁`` for the warning, raised
    when ``κ₁·eps`` exceeds both :data:`COND_WARN_RTOL` and 100·eps (so that
    half precision warns only for κ₁ > 100). Half-precision ``A`` is inverted
    in float32 (``solve_triangular`` has no half kernels on CPU). ``stacklevel``: the
    warning's, counted from this function (3: the caller of the layer method calling it).
    """
    work = a if a.dtype in (torch.float32, torch.float64) else a.float()
    eye = torch.eye(a.shape[0], dtype=work.dtype, device=a.device)
    inv = torch.linalg.solve_triangular(work, eye, upper=True)
    kappa = float(work.abs().sum(0).amax() * inv.abs().sum(0).amax())
    eps = torch.finfo(a.dtype).eps
    if not math.isfinite(kappa) or kappa * eps > max(COND_WARN_RTOL, 100 * eps):
        off = torch.triu(work, diagonal=1).abs()
        warnings.warn(
            ILL_CONDITIONED.format(
                layer=layer,
                kappa=kappa,
                dmin=float(work.diagonal().abs().amin()),
                omax=float(off.amax()) if off.numel() else 0.0,
                dtype=str(a.dtype).removeprefix("torch."),
                loss=min(kappa * eps, 1.0) if math.isfinite(kappa) else 1.0,
            ),
            RuntimeWarning,
            stacklevel=stacklevel,
        )
    return inv.to(a.dtype)


class TriangularLead(ChainLayer):
    """Base of the submersive dense and convolutional layers: their shared parametrisation.

    The effective weight (:meth:`weight`) is ``weight_raw`` masked so that its leading
    out × out block ``A`` (for a convolution: at the kernel's centre tap, Lemma 1 (ii)) is
    strictly upper-triangular, with the diagonal ``diag_from_raw(diag_raw)`` put in: ``A``
    is upper-triangular with a diagonal in (0.5, 1.5), so its inverse is one triangular
    solve (:func:`triangular_inverse`).
    """

    submersive = True
    vijp_needs_input = False  # the Jacobian is constant

    _mask: torch.Tensor
    weight_raw: nn.Parameter
    diag_raw: nn.Parameter

    def _centre(self) -> tuple[int, ...]:
        """Where ``A`` lies in the weight's axes after (out, in): nowhere for a dense layer,
        the centre tap (the padding) for a convolution."""
        return ()

    def _lead(self, n_out: int) -> tuple[slice | int, ...]:
        """The index of ``A`` in the weight."""
        return (slice(None), slice(None, n_out), *self._centre())

    def _init_parameters(self, weight: torch.Tensor, *, bias: bool, bound: float) -> None:
        """Register the mask, ``weight_raw`` (the initialised ``weight``, masked), ``diag_raw``
        (zeros: a unit diagonal) and a ``bias`` drawn from U(-bound, bound) or ``None``."""
        n_out = weight.shape[0]
        kw: dict[str, Any] = {"device": weight.device, "dtype": weight.dtype}
        mask = torch.ones_like(weight)
        lead = self._lead(n_out)
        mask[lead] = torch.triu(mask[lead], diagonal=1)
        self.register_buffer("_mask", mask, persistent=False)
        self.weight_raw = nn.Parameter(weight)
        with torch.no_grad():
            self.weight_raw.mul_(self._mask)
        self.diag_raw = nn.Parameter(torch.zeros(n_out, **kw))
        self.bias = nn.Parameter(torch.empty(n_out, **kw).uniform_(-bound, bound)) if bias else None

    def weight(self) -> torch.Tensor:
        """The effective weight, differentiable in the raw parameters."""
        idx = torch.arange(self.diag_raw.shape[0], device=self.diag_raw.device)
        centre = tuple(idx.new_full((), c) for c in self._centre())
        w = self.weight_raw * self._mask
        return w.index_put((idx, idx, *centre), diag_from_raw(self.diag_raw))

    def _lead_inverse(self, w: torch.Tensor | None = None) -> torch.Tensor:
        """``A⁻¹`` of the effective weight ``w`` (default: :meth:`weight`), without autograd;
        warns when ``A`` is ill-conditioned."""
        with torch.no_grad():
            w = self.weight() if w is None else w
            lead = w[self._lead(self.diag_raw.shape[0])]
            return triangular_inverse(lead, self._describe(), stacklevel=4)  # past this frame


class SubmersiveLinear(TriangularLead):
    """``y = x Wᵀ + b`` with ``W[:, :out]`` upper-triangular, diagonal in (0.5, 1.5).

    Parameters: ``weight_raw`` (out × in; its entries on and below the leading
    block's diagonal are masked to exactly zero), ``diag_raw`` (out; the
    diagonal is ``1 + 0.5·tanh(diag_raw)``), ``bias`` (out, optional). The
    effective weight is :meth:`weight`.

    Rules: ``residual`` keeps nothing (``None``); ``vjp_input = h W``;
    ``vijp`` solves ``h' A = h[..., :out]`` (``h`` must lie in the row space of
    ``W``, as every input cotangent of a Moonwalk chain does; the other
    ``in − out`` columns are then implied and not read); ``forward_vjp_params``
    gives the gradients of the raw parameters in one forward.

    Args:
        in_features: input size.
        out_features: output size, at most ``in_features``.
        bias: learn an additive bias.
        device, dtype: factory arguments of the parameters.

    Raises:
        LayerConditionError: ``out_features > in_features``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = positive_int("SubmersiveLinear", "in_features", in_features)
        self.out_features = positive_int("SubmersiveLinear", "out_features", out_features)
        self.has_bias = bias
        self.check()
        n_out, n_in = self.out_features, self.in_features
        bound = 1.0 / math.sqrt(n_in)  # nn.Linear's default init
        weight = torch.empty(n_out, n_in, device=device, dtype=dtype).uniform_(-bound, bound)
        self._init_parameters(weight, bias=bias, bound=bound)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.has_bias}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if not x.is_floating_point():
            raise LayerConditionError(
                LINEAR_NOT_FLOAT.format(layer=self._describe(), dtype=x.dtype)
            )
        check_input_dtype(self._describe(), x, self.weight_raw)
        return nn.functional.linear(x, self.weight(), self.bias)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Nothing: ``vjp_input`` needs only the weight."""
        del x, y
        return None

    def vjp_input(self, res: None, h_out: torch.Tensor) -> torch.Tensor:
        """``h = h' W``."""
        del res
        return h_out @ self.weight()

    def vijp(self, x: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
        """``h'`` with ``h' W = h`` (``h`` in the row space): ``h' = h[..., :out] A⁻¹``."""
        del x
        self._check_input(h_in)
        inv = self._lead_inverse()
        return h_in[..., : self.out_features] @ inv.to(h_in.dtype)

    def forward_vjp_params(
        self, x: torch.Tensor, h_out: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(y, grads)``: ``∂W = h'ᵀ x`` chained through the mask and the diagonal map."""
        with torch.no_grad():
            y = self.forward(x)
            x2 = x.reshape(-1, self.in_features)
            h2 = h_out.reshape(-1, self.out_features)
            gw = h2.T @ x2
            full = {
                "weight_raw": gw * self._mask,
                "diag_raw": gw.diagonal() * diag_grad_from_raw(self.diag_raw),
            }
            if self.bias is not None:
                full["bias"] = h2.sum(0)
        return y, {n: full[n] for n, p in self.named_parameters() if p.requires_grad}

    def check(self, x: torch.Tensor | None = None) -> None:
        """Raise :class:`LayerConditionError` if ``out > in`` or ``x`` has the wrong width;
        warn if the triangular block is ill-conditioned."""
        if self.out_features > self.in_features:
            raise LayerConditionError(
                LINEAR_TOO_WIDE.format(
                    layer=self._describe(), n_out=self.out_features, n_in=self.in_features
                )
            )
        if x is not None:
            self._check_input(x)
        if hasattr(self, "diag_raw"):
            self._lead_inverse()

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise LayerConditionError(
                LINEAR_BAD_INPUT.format(
                    layer=self._describe(), n_in=self.in_features, shape=tuple(x.shape)
                )
            )
