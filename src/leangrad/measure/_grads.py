"""Gradient quality: errors against a reference, and bias/variance of estimators.

All arithmetic is done in float64, whatever the gradients' dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

__all__ = [
    "BAD_DRAWS",
    "DRAW_NAMES",
    "EMPTY_GRADS",
    "NOT_A_TENSOR",
    "SHAPE_MISMATCH",
    "EstimatorStats",
    "GradComparison",
    "compare_grads",
    "estimator_stats",
    "grads_of",
]

EMPTY_GRADS = (
    "{func}: no gradients to compare (an empty mapping); pass name -> tensor for at least "
    "one parameter, e.g. grads_of(model)"
)
NOT_A_TENSOR = (
    "{func}: {side} {name!r} is {type}, not a tensor; use grads_of(model), which gives "
    "zeros for a parameter whose .grad is None"
)
BAD_DRAWS = "draws must be an int >= 2 to estimate a variance, got {value!r}"
DRAW_NAMES = (
    "estimator_stats: draw() returned gradients named {got}, but exact has {want}; "
    "return one tensor per name of exact"
)


@dataclasses.dataclass(frozen=True)
class GradComparison:
    """How close gradients are to a reference.

    Relative error is normwise in the max norm: ``max|g − r| / max|r|``, per
    parameter and over all parameters together (``max_rel_err``). Cosine
    similarity is of the flattened vectors. A parameter whose reference is all
    zeros has relative error ``max|g|`` (absolute).

    Attributes:
        max_rel_err: over all parameters concatenated.
        cosine: over all parameters concatenated.
        per_param: name -> (max_rel_err, cosine).
    """

    max_rel_err: float
    cosine: float
    per_param: dict[str, tuple[float, float]]

    @property
    def worst_param(self) -> str:
        """The parameter with the largest relative error (a NaN one first)."""
        return max(self.per_param, key=lambda n: _nan_last(self.per_param[n][0]))


def _nan_last(err: float) -> float:
    """Sort key ranking a NaN error above every number (``max`` would skip it)."""
    return math.inf if math.isnan(err) else err


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``p.grad`` for trainable parameters (zeros where ``.grad`` is None)."""
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _finite(g: torch.Tensor, r: torch.Tensor) -> bool:
    return bool(torch.isfinite(g).all()) and bool(torch.isfinite(r).all())


def _rel(g: torch.Tensor, r: torch.Tensor) -> float:
    if not _finite(g, r):
        return math.nan  # a NaN/Inf anywhere is never "close"
    scale = r.abs().max().item() if r.numel() else 0.0
    err = (g - r).abs().max().item() if r.numel() else 0.0
    return err / scale if scale > 0 else err


def _cos(g: torch.Tensor, r: torch.Tensor) -> float:
    if not _finite(g, r):
        return math.nan  # (min(1.0, nan) is 1.0 in Python: never clamp a NaN)
    ng, nr = g.norm().item(), r.norm().item()
    if ng == 0 and nr == 0:
        return 1.0
    if ng == 0 or nr == 0:
        return 0.0
    return max(-1.0, min(1.0, float(torch.dot(g, r).item() / (ng * nr))))


SHAPE_MISMATCH = (
    "gradient {name!r} has shape {shape} but its reference has shape {ref}; compare the "
    "gradients of the same parameters (a transposed weight is not the same gradient)"
)


def compare_grads(
    grads: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]
) -> GradComparison:
    """Compare gradients to a reference with the same names and shapes (in float64).

    A NaN or Inf in either side makes that parameter's error and cosine (and the overall
    ones) NaN: a non-finite gradient is never reported as close.

    Raises:
        KeyError: the names differ. ValueError: no gradients, or a shape differs (shapes
        must match exactly: a ``(2, 3)`` and a ``(3, 2)`` gradient are not compared
        flattened). TypeError: a value is not a tensor (e.g. a ``.grad`` that is None).
    """
    if not reference and not grads:
        raise ValueError(EMPTY_GRADS.format(func="compare_grads"))
    if set(grads) != set(reference):
        missing = sorted(set(reference) - set(grads))
        extra = sorted(set(grads) - set(reference))
        raise KeyError(f"gradient names differ: missing {missing}, unexpected {extra}")
    per: dict[str, tuple[float, float]] = {}
    gs, rs = [], []
    for n, r in reference.items():
        _check_tensor("compare_grads", "gradient", n, grads[n])
        _check_tensor("compare_grads", "reference", n, r)
        if tuple(grads[n].shape) != tuple(r.shape):
            raise ValueError(SHAPE_MISMATCH.format(
                name=n, shape=tuple(grads[n].shape), ref=tuple(r.shape)))  # fmt: skip
        g64 = grads[n].detach().to("cpu", torch.float64).reshape(-1)
        r64 = r.detach().to("cpu", torch.float64).reshape(-1)
        per[n] = (_rel(g64, r64), _cos(g64, r64))
        gs.append(g64)
        rs.append(r64)
    g_all, r_all = torch.cat(gs), torch.cat(rs)
    return GradComparison(max_rel_err=_rel(g_all, r_all), cosine=_cos(g_all, r_all), per_param=per)


@dataclasses.dataclass(frozen=True)
class EstimatorStats:
    """Bias and variance of a gradient estimator over ``draws`` independent draws.

    Attributes:
        draws: number of draws.
        mean: per-parameter mean estimate (float64).
        rel_bias: ``‖mean − exact‖ / ‖exact‖`` (shrinks like 1/√draws when unbiased).
        variance: total variance, the sum over coordinates of the sample variance.
        z_mean_square: mean over coordinates of z² with
            z = (mean − exact) / (sample std / √draws); close to 1 when unbiased.
        max_abs_z: the largest |z| over coordinates.
        cosine_of_mean: cosine between the mean estimate and the exact gradient.
        mean_cosine: mean cosine of single draws to the exact gradient.
    """

    draws: int
    mean: dict[str, torch.Tensor]
    rel_bias: float
    variance: float
    z_mean_square: float
    max_abs_z: float
    cosine_of_mean: float
    mean_cosine: float


def estimator_stats(
    draw: Callable[[], Mapping[str, torch.Tensor]],
    exact: Mapping[str, torch.Tensor],
    *,
    draws: int,
) -> EstimatorStats:
    """Draw an estimator ``draws`` times and summarise its bias and variance vs ``exact``.

    ``draw()`` returns one gradient estimate (name -> tensor, the names and shapes of
    ``exact``). Sums are kept in float64 (Welford would be steadier; with draws ≤ 1e5
    plain sums suffice).

    A NaN or Inf in any draw (or in ``exact``) makes every statistic NaN, never a
    reassuring number. A coordinate with zero sample variance (a deterministic part,
    such as an exact bias gradient) gets ``z = 0`` whatever its bias: read ``rel_bias``
    for those.

    Raises:
        ValueError: ``draws`` is not an int >= 2, ``exact`` is empty, or a draw's shapes
            differ from ``exact``'s. KeyError: a draw's names differ from ``exact``'s.
    """
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 2:
        raise ValueError(BAD_DRAWS.format(value=draws))
    if not exact:
        raise ValueError(EMPTY_GRADS.format(func="estimator_stats"))
    names = list(exact)
    for n in names:
        _check_tensor("estimator_stats", "exact", n, exact[n])
    ex = torch.cat([exact[n].detach().to("cpu", torch.float64).reshape(-1) for n in names])
    s1 = torch.zeros_like(ex)
    s2 = torch.zeros_like(ex)
    cos_sum = 0.0
    for _ in range(draws):
        est = draw()
        _check_draw(est, exact)
        g = torch.cat([est[n].detach().to("cpu", torch.float64).reshape(-1) for n in names])
        s1 += g
        s2 += g * g
        cos_sum += _cos(g, ex)
    mean = s1 / draws
    var = (s2 - draws * mean * mean).clamp_min(0) / (draws - 1)
    se = (var / draws).sqrt()
    z = torch.where(se > 0, (mean - ex) / se.clamp_min(1e-300), torch.zeros_like(ex))
    finite = _finite(s1, s2) and bool(torch.isfinite(ex).all())
    if not finite:  # `se > 0` is False for NaN: z would read 0, "unbiased"
        z = torch.full_like(ex, math.nan)
    sizes = [exact[n].numel() for n in names]
    means = {n: m.reshape(exact[n].shape) for n, m in zip(names, mean.split(sizes), strict=True)}
    ex_norm = ex.norm().item()
    if not finite:
        rel_bias = math.nan
    else:
        rel_bias = (mean - ex).norm().item() / ex_norm if ex_norm > 0 else math.inf
    return EstimatorStats(
        draws=draws,
        mean=means,
        rel_bias=rel_bias,
        variance=var.sum().item() if finite else math.nan,
        z_mean_square=(z * z).mean().item(),
        max_abs_z=z.abs().max().item(),
        cosine_of_mean=_cos(mean, ex),
        mean_cosine=cos_sum / draws,
    )


def _check_draw(est: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor]) -> None:
    """One draw has exactly ``exact``'s names and shapes (never compared flattened)."""
    if set(est) != set(exact):
        raise KeyError(DRAW_NAMES.format(got=sorted(est), want=sorted(exact)))
    for n, r in exact.items():
        t = est[n]
        _check_tensor("estimator_stats", "draw", n, t)
        if tuple(t.shape) != tuple(r.shape):
            shapes = {"shape": tuple(t.shape), "ref": tuple(r.shape)}
            raise ValueError(SHAPE_MISMATCH.format(name=n, **shapes))


def _check_tensor(func: str, side: str, name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(NOT_A_TENSOR.format(func=func, side=side, name=name, type=type(t).__name__))
