"""Unbiased reduced copies of activations: sampling and seeded random projections.

Randomized AD (Oktay, McGreivy, Aduol, Beatson, Adams, ICLR 2021), section 3.2,
"random matrix injection": a Jacobian factor is right-multiplied by a random
matrix ``P`` with ``E[P] = I`` and ``P = R Rᵀ``, ``R ∈ R^{d×k}``, ``k < d``
(eq. 6). Only ``x R`` (``k`` numbers instead of ``d``) is stored; the backward
pass rebuilds ``x̂ = x R Rᵀ`` with ``E[x̂] = x``. Three choices of ``R``:

- sampling *with* replacement: ``P = d/k Σ_s e_{i_s} e_{i_s}ᵀ``, ``i_s`` uniform
  (the paper's construction);
- sampling *without* replacement: ``k`` distinct indices, scaled by ``d/k``
  (each index is kept with probability ``k/d``, so ``E[P] = I`` too);
- projection (Appendix A): ``R`` has i.i.d. ±1/√k entries (Rademacher).

Indices and projection matrices are never stored: they are regenerated in the
backward pass from an integer seed drawn per call. The sampled axis is the
last one of a ``(rows, channels, d)`` view: rows draw independent samples in
mode ``"different"`` and share one in ``"same"`` and ``"project"``; channels
always share the row's sample (conv: one sample of spatial positions for all
channels).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from ..layers._functorch import plain_ops
from . import _errors as errors

__all__ = [
    "MODES",
    "SampleSpec",
    "check_fraction",
    "check_mode",
    "draw_seed",
    "make_generator",
    "rademacher",
]

MODES = ("different", "same", "project")
"""Sampling modes: per-row samples, one sample per call, a seeded Rademacher projection."""

_SEED_HIGH = 2**62
_BLOCK = 1 << 14
"""Elements of the dense block of rows of ``x̂`` that a "different" weight gradient builds
at a time (64 KiB in float32): small beside an activation, large enough for a fast GEMM."""


def check_fraction(fraction: object) -> float:
    """``fraction`` as a float, or :class:`RadInputError` unless it lies in (0, 1]."""
    if (
        not isinstance(fraction, numbers.Real)
        or isinstance(fraction, bool)
        or not 0.0 < float(fraction) <= 1.0  # also rejects nan
    ):
        raise errors.RadInputError(errors.BAD_FRACTION.format(value=fraction))
    return float(fraction)


def check_mode(mode: object) -> str:
    """``mode`` if it is one of :data:`MODES`, else :class:`RadInputError` listing them."""
    if mode not in MODES:
        raise errors.RadInputError(errors.BAD_MODE.format(mode=mode, known=", ".join(MODES)))
    return str(mode)


def make_generator(seed: object) -> torch.Generator | None:
    """A CPU generator seeded with ``seed``, ``None`` for ``None``; RadInputError otherwise."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise errors.RadInputError(errors.BAD_SEED.format(value=seed))
    return torch.Generator().manual_seed(int(seed))


def draw_seed(generator: torch.Generator | None, *, layer: str = "a randomized layer") -> int:
    """A fresh seed for one call, from ``generator`` (or torch's global RNG when ``None``).

    Raises:
        RadInputError: called under a ``torch.func`` transform (``layer`` names the layer):
            its estimator lives in autograd's backward, which a transform never runs.
    """
    if plain_ops():
        raise errors.RadInputError(errors.UNDER_TRANSFORM.format(layer=layer))
    return int(torch.randint(_SEED_HIGH, (), generator=generator).item())


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def rademacher(
    d: int, k: int, *, seed: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The ``(d, k)`` matrix ``R`` of i.i.d. ±1/√k entries that ``seed`` determines.

    ``E[R Rᵀ] = I`` (Appendix A). The same seed, device and shape give the same ``R``.
    """
    bits = torch.randint(2, (d, k), generator=_generator(seed, device), device=device)
    return (bits.to(dtype) * 2 - 1) / math.sqrt(k)


@dataclasses.dataclass(frozen=True)
class SampleSpec:
    """How a randomized layer reduces what it saves.

    Attributes:
        fraction: share of the sampled axis kept, in (0, 1]; ``k = ceil(fraction·d)``.
            At 1 the full activation is kept (exact gradients in every mode).
        mode: ``"different"`` (a sample per row: per example), ``"same"`` (one sample
            shared by all rows) or ``"project"`` (a seeded Rademacher projection).
        replace: sample indices with replacement (the paper) or without.
    """

    fraction: float
    mode: str = "different"
    replace: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fraction", check_fraction(self.fraction))
        object.__setattr__(self, "mode", check_mode(self.mode))
        if not isinstance(self.replace, bool):  # "no" would be truthy: with replacement
            raise errors.RadInputError(errors.BAD_REPLACE.format(value=self.replace))

    def kept(self, d: int) -> int:
        """``k``: how many of ``d`` entries (or projection columns) are stored."""
        return min(d, max(1, math.ceil(self.fraction * d - 1e-9)))

    @property
    def exact(self) -> bool:
        """Whether the full activation is stored (fraction 1): no randomness at all."""
        return self.fraction >= 1.0

    def _window(
        self, rows: int, d: int, k: int, seed: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """What :meth:`_indices` draws from: ``(windows, start)`` without replacement, the
        ``(n, k)`` indices themselves with replacement (``n``: 1 unless ``"different"``)."""
        n = rows if self.mode == "different" else 1
        gen = _generator(seed, device)
        if self.replace:
            return torch.randint(d, (n, k), generator=gen, device=device)
        # k distinct of d per row: a window of k consecutive entries of one random
        # permutation, from a uniform start drawn per row. For a fixed start the window of
        # a uniform permutation is a uniform k-subset, and starts are independent, so any
        # two entries of different rows are kept independently (probability k/d each) and
        # two entries of one row together with probability k(k-1)/(d(d-1)): every first
        # and second moment of the keep pattern, hence the estimator's mean and covariance,
        # is that of independent per-row samples, for O(d + n·k) random numbers instead
        # of a top-k over n·d uniform keys.
        perm = torch.randperm(d, generator=gen, device=device)
        windows = torch.cat([perm, perm[: k - 1]]).unfold(0, k, 1)  # (d, k) view: all windows
        return windows, torch.randint(d, (n,), generator=gen, device=device)

    @staticmethod
    def _rows(drawn: tuple[torch.Tensor, torch.Tensor] | torch.Tensor,
              lo: int = 0, hi: int | None = None) -> torch.Tensor:  # fmt: skip
        """Rows ``lo:hi`` of the ``(n, k)`` indices :meth:`_window` drew."""
        if isinstance(drawn, torch.Tensor):
            return drawn[lo:hi]
        windows, start = drawn
        return windows.index_select(0, start[lo:hi])

    def _indices(self, rows: int, d: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
        """The ``(n, k)`` sampled indices ``seed`` determines (``n``: rows in ``"different"``
        mode, else 1), with or without replacement."""
        if rows == 0 and self.mode == "different":  # an empty batch: no rows to sample for
            return torch.zeros(0, k, dtype=torch.long, device=device)
        return self._rows(self._window(rows, d, k, seed, device))

    def compress(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        """The ``(rows, channels, k)`` reduced copy of ``x`` of shape ``(rows, channels, d)``.

        Returns ``x`` itself when :meth:`exact`.
        """
        rows, channels, d = x.shape
        if self.exact:
            return x
        k = self.kept(d)
        if self.mode == "project":
            return x @ rademacher(d, k, seed=seed, device=x.device, dtype=x.dtype)
        idx = self._indices(rows, d, k, seed, x.device)
        if self.mode == "same":
            return x.index_select(2, idx[0])
        return x.gather(2, idx.unsqueeze(1).expand(rows, channels, k))

    def weight_grad(self, g: torch.Tensor, kept: torch.Tensor, d: int, seed: int) -> torch.Tensor:
        """``gᵀ x̂`` for a linear layer, without building the dense ``(rows, d)`` ``x̂``.

        ``g``: ``(rows, out)`` output gradient; ``kept``: :meth:`compress`'s copy of the
        ``(rows, 1, d)`` input. Returns the ``(out, d)`` weight gradient estimate. The
        projection is applied as ``(gᵀ xR) Rᵀ``, "same" fills ``k`` columns, and
        "different" rebuilds ``x̂`` a 64 KiB block of rows at a time (:func:`_scattered_product`),
        so the backward allocates nothing of the input's full size.
        """
        rows, _, k = kept.shape
        vals = kept.reshape(rows, k)
        if self.exact:
            return g.T @ vals
        if self.mode == "project":
            r = rademacher(d, k, seed=seed, device=kept.device, dtype=kept.dtype)
            return (g.T @ vals) @ r.T
        if self.mode == "same":
            idx = self._indices(rows, d, k, seed, kept.device)
            out = g.new_zeros(g.shape[1], d)
            return out.index_add_(1, idx[0], (g.T @ vals).mul_(d / k))
        return _scattered_product(g, vals, self._window(rows, d, k, seed, kept.device), k, d)

    def expand(self, kept: torch.Tensor, d: int, seed: int) -> torch.Tensor:
        """``x̂`` of shape ``(rows, channels, d)``, ``E[x̂] = x``, from :meth:`compress`'s copy."""
        rows, channels, k = kept.shape
        if self.exact:
            return kept
        if self.mode == "project":
            r = rademacher(d, k, seed=seed, device=kept.device, dtype=kept.dtype)
            return kept @ r.T
        idx = self._indices(rows, d, k, seed, kept.device)
        out = kept.new_zeros(rows, channels, d)
        if self.mode == "same":
            out.index_add_(2, idx[0], kept)
        else:
            out.scatter_add_(2, idx.unsqueeze(1).expand(rows, channels, k), kept)
        return out.mul_(d / k)


def _scattered_product(
    g: torch.Tensor,
    vals: torch.Tensor,
    drawn: tuple[torch.Tensor, torch.Tensor] | torch.Tensor,
    k: int,
    d: int,
) -> torch.Tensor:
    """``gᵀ x̂`` for ``x̂`` of shape ``(rows, d)`` holding ``vals[r]`` at row ``r``'s sampled
    columns, scaled by ``d/k``: a dense block of rows of ``x̂`` at a time (about
    :data:`_BLOCK` elements, reused), so the scratch stays small and the product runs as a
    dense GEMM, faster on a CPU than a sparse product at RAD's 5-50% densities."""
    rows = vals.shape[0]
    step = max(1, min(rows, _BLOCK // max(d, 1)))
    block = vals.new_empty(min(step, rows), d)
    out = g.new_empty(g.shape[1], d)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        x_hat = block[: hi - lo].zero_().scatter_add_(1, SampleSpec._rows(drawn, lo, hi),
                                                       vals[lo:hi])  # fmt: skip
        # beta=0 on the first block: out's uninitialised values are ignored, not scaled
        torch.addmm(out, g[lo:hi].T, x_hat, beta=1 if lo else 0, alpha=d / k, out=out)
    if rows == 0:
        out.zero_()
    return out
