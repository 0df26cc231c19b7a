"""CumSumProd: the reversed linear recurrence along the residual path (paper eq. 9, 12).

``u[t] = v[t] + u[t+1] · k[t+1]``, i.e. ``u[t] = Σ_{j≥t} v[j] k[j] … k[t+1]``, for
``t = L−1 … 0`` with ``u[L−1] = v[L−1]``. ``k`` is ``None`` (identity: a reversed
cumulative sum), a scalar per layer (``(L, 1, …, 1)``) or diagonal (``(L, *state)``);
products of such K commute, which is what lets the parallel scan reorder them.

- :func:`cumsumprod_parallel` — Hillis & Steele's scan (Appendix B, Algorithm 1):
  ⌈log2 L⌉ rounds of whole-tensor operations, O(L log L) work;
- :func:`cumsumprod_sequential` — the L-step loop of eq. 9, O(L) work;
- :func:`cumsumprod` picks one by ``scan=`` (``"auto"``: the parallel scan on
  accelerators, and on CPU only for tiny per-layer states, where one loop step costs
  mostly dispatch overhead — see :data:`AUTO_PARALLEL_MAX_NUMEL`).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["AUTO_PARALLEL_MAX_NUMEL", "SCANS", "Scan", "cumsumprod", "cumsumprod_parallel",
           "cumsumprod_sequential"]  # fmt: skip

Scan = Literal["parallel", "sequential", "auto"]
SCANS: tuple[str, ...] = ("parallel", "sequential", "auto")
AUTO_PARALLEL_MAX_NUMEL = 256
"""On CPU, ``scan="auto"`` uses the parallel scan only when one layer's state has at most
this many elements; on other devices always. Measured on CPU, one thread (suite
``highway-rnn``, records ``kind = "scan"``): the parallel scan's O(L log L) work and
temporaries lose to the loop's O(L) work once a state holds more than a few hundred
numbers (GRU batch 32 x hidden 128 at L = 256 and 1024); the loop's per-step dispatch
cost only dominates for tiny states."""


def _reverse_cumsum(v: torch.Tensor) -> torch.Tensor:
    return v.flip(0).cumsum(0).flip(0)


def cumsumprod_parallel(
    v: torch.Tensor, k: torch.Tensor | None, *, inplace: bool = False
) -> torch.Tensor:
    """Hillis-Steele CumSumProd (Algorithm 1): ``u[t] = Σ_{j≥t} v[j] k[j]…k[t+1]``.

    Args:
        v: ``(L, *state)`` values.
        k: ``(L, *state)`` or ``(L, 1, …, 1)`` multipliers, or ``None`` for identity.

        inplace: write ``u`` into ``v`` (saves one copy).

    Returns:
        ``u`` of the shape of ``v``.
    """
    if k is None:
        return v.copy_(_reverse_cumsum(v)) if inplace else _reverse_cumsum(v)
    length = v.shape[0]
    u = v if inplace else v.clone()
    if length < 2:
        return u
    # p[t] = product of multipliers from t+1 up to t+d (commuting: scalar/diagonal K)
    p = k[1:].clone()
    d = 1
    while d < length:
        u[: length - d] += u[d:] * p[: length - d]
        if d < length - 1:
            p[: length - 1 - d] = p[: length - 1 - d] * p[d:]
        d *= 2
    return u


def cumsumprod_sequential(
    v: torch.Tensor, k: torch.Tensor | None, *, inplace: bool = False
) -> torch.Tensor:
    """The same recurrence as :func:`cumsumprod_parallel`, one layer at a time (eq. 9)."""
    if k is None:
        return v.copy_(_reverse_cumsum(v)) if inplace else _reverse_cumsum(v)
    u = v if inplace else v.clone()
    for t in range(v.shape[0] - 2, -1, -1):
        u[t].addcmul_(u[t + 1], k[t + 1])
    return u


def cumsumprod(
    v: torch.Tensor, k: torch.Tensor | None, *, scan: Scan = "auto", inplace: bool = False
) -> torch.Tensor:
    """CumSumProd by the chosen algorithm (``"parallel"``, ``"sequential"`` or ``"auto"``)."""
    if scan == "auto":
        per_layer = v[0].numel() if v.shape[0] else 0
        parallel = v.device.type != "cpu" or per_layer <= AUTO_PARALLEL_MAX_NUMEL
        scan = "parallel" if parallel else "sequential"
    if scan == "parallel":
        return cumsumprod_parallel(v, k, inplace=inplace)
    if scan == "sequential":
        return cumsumprod_sequential(v, k, inplace=inplace)
    raise ValueError(f"scan must be one of {', '.join(SCANS)}, got {scan!r}")
