"""bisect_last_fit: the one bisection of the benchmark searches (fad, fragmental, rad)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from leangrad_bench._search import bisect_last_fit


def _probing(limit: int, probes: list[int]) -> Callable[[int], bool]:
    def fits(b: int) -> bool:
        probes.append(b)
        return b <= limit

    return fits


@pytest.mark.parametrize("limit", [0, 1, 2, 7, 63, 64, 100, 149, 150])
def test_finds_the_last_fit_with_the_inclusive_search_rads_probes(limit: int) -> None:
    got: list[int] = []
    best = bisect_last_fit(_probing(limit, got), 0, 151)
    want: list[int] = []  # the inclusive lo <= hi search rad's equal_memory_batch used
    lo, hi, old = 1, 150, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        want.append(mid)
        if mid <= limit:
            old, lo = mid, mid + 1
        else:
            hi = mid - 1
    assert best == old == min(limit, 150) and got == want


@pytest.mark.parametrize("limit", [0, 5, 64, 200, 1000, 4095])
def test_relative_stops_within_lo_over_relative(limit: int) -> None:
    got: list[int] = []
    lo = bisect_last_fit(_probing(limit, got), 0, 4096, relative=64)
    assert lo <= limit < 4096 and limit - lo <= max(1, lo // 64)
    assert len(got) == len(set(got))  # no size probed twice
