"""The bisection the benchmark searches share: the largest batch or depth that still fits
(fad's and the zoo's max batch, fragmental's deepest depth, rad's equal-memory batch)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["bisect_last_fit"]


def bisect_last_fit(
    fits: Callable[[int], bool], lo: int, hi: int, *, relative: int | None = None
) -> int:
    """The last size that fits in ``lo < hi``: ``lo`` fits (or is a floor such as 0), ``hi`` not.

    Probes ``(lo + hi) // 2`` until ``hi - lo ≤ 1``, or, with ``relative``, until
    ``hi - lo ≤ lo // relative`` (a 1/``relative`` answer costs fewer probes when each
    one is a measured step). Returns the final ``lo``; without ``relative`` the first
    size that does not fit is ``lo + 1``.

    Args:
        fits: Whether a size fits (each call may be a measured step; none is repeated).
        lo: A size known to fit, or the floor below the smallest size.
        hi: A size known not to fit (or one past the largest allowed).
        relative: Stop once the bracket is within ``lo // relative``.
    """
    while hi - lo > max(1, lo // relative if relative else 1):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
