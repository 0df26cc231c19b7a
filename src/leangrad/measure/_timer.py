"""Wall-clock timing: medians of interleaved repeats after warm-up, as ratios in one run."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "BAD_COUNT",
    "NOT_CALLABLE",
    "NO_FUNCTIONS",
    "NO_THREADS",
    "Timing",
    "num_threads",
    "time_across_threads",
    "time_interleaved",
]

BAD_COUNT = "{name} must be an int >= {least}, got {value!r}"
NO_FUNCTIONS = (
    "time_interleaved needs at least one function to time, got an empty mapping; "
    "pass e.g. {{'backprop': step}}"
)
NO_THREADS = "time_across_threads needs at least one thread count, e.g. threads=[1, 2]"
NOT_CALLABLE = (
    "time_interleaved: fns[{name!r}] must be a zero-argument callable, got {type}; "
    "wrap a call with arguments as lambda: step(model, x)"
)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of one timed function over the repeats, and its ratio to the reference.

    Attributes:
        median, minimum, maximum: seconds per call over ``repeats`` calls.
        ratio: ``median / reference median`` (``None`` without a reference).
        repeats: how many calls were timed (after warm-up).
    """

    median: float
    minimum: float
    maximum: float
    ratio: float | None
    repeats: int


@contextlib.contextmanager
def num_threads(n: int | None) -> Iterator[None]:
    """Set ``torch.set_num_threads(n)`` inside the block (``None`` leaves it)."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _check_count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(BAD_COUNT.format(name=name, least=least, value=value))


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int = 5,
    warmup: int = 1,
    reference: str | None = None,
    threads: int | None = 1,
    progress: Callable[[], None] | None = None,
) -> dict[str, Timing]:
    """Time several functions fairly: round-robin, so drifts hit all of them alike.

    Each round calls every function once, in an order rotated by one each
    round. Warm-up rounds are not timed. Times are medians, so one slow
    outlier (a page fault, another process) does not move the result.

    Args:
        fns: name -> zero-argument callable (one training step each).
        repeats: timed rounds.
        warmup: untimed rounds first (allocator, caches, lazy init).
        reference: name whose median the ratios divide by (e.g. ``"backprop"``).
        threads: ``torch.set_num_threads`` during timing (1 by default; ``None`` leaves it).
        progress: called after each timed call (e.g. a progress bar's update).

    Raises:
        ValueError: no functions, or ``repeats`` < 1, ``warmup`` < 0, ``threads`` < 1
            (or not ints); TypeError: a value of ``fns`` is not callable; KeyError: an
            unknown ``reference``.
    """
    _check_args(fns, repeats=repeats, warmup=warmup, reference=reference)
    if threads is not None:
        _check_count("threads", threads, 1)
    return _rounds(fns, repeats=repeats, warmup=warmup, reference=reference,
                   threads=[threads], progress=progress)[threads]


def time_across_threads(
    fns: Mapping[str, Callable[[], object]],
    *,
    threads: Sequence[int],
    repeats: int = 5,
    warmup: int = 1,
    reference: str | None = None,
    progress: Callable[[], None] | None = None,
) -> dict[int, dict[str, Timing]]:
    """:func:`time_interleaved` at several torch thread counts, side by side in one run.

    Each round times every function at every thread count (thread counts and functions
    both rotated by one each round), so a drift of the machine hits every cell alike;
    ratios divide by the reference's median *at the same thread count*. Warm-up rounds run
    every function at every thread count first.

    Returns:
        thread count -> (name -> :class:`Timing`), in the order of ``threads``.

    Raises:
        ValueError: as :func:`time_interleaved`, and for no thread counts, a count < 1 or
            the same count twice.
    """
    _check_args(fns, repeats=repeats, warmup=warmup, reference=reference)
    if not threads:
        raise ValueError(NO_THREADS)
    for n in threads:
        _check_count("threads", n, 1)
    if len(set(threads)) != len(threads):
        raise ValueError(f"threads lists a count twice: {list(threads)}")
    return _rounds(fns, repeats=repeats, warmup=warmup, reference=reference,
                   threads=list(threads), progress=progress)  # fmt: skip


def _check_args(fns: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int,
                reference: str | None) -> None:  # fmt: skip
    if not fns:
        raise ValueError(NO_FUNCTIONS)
    for name, fn in fns.items():
        if not callable(fn):
            raise TypeError(NOT_CALLABLE.format(name=name, type=type(fn).__name__))
    if reference is not None and reference not in fns:
        raise KeyError(f"reference {reference!r} is not among the timed functions {list(fns)}")
    _check_count("repeats", repeats, 1)
    _check_count("warmup", warmup, 0)


def _rounds(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int,
    reference: str | None,
    threads: list[int | None],
    progress: Callable[[], None] | None,
) -> dict[Any, dict[str, Timing]]:
    """Warm-up, then ``repeats`` rounds of every (thread count, function), both rotated."""
    names = list(fns)
    samples: dict[Any, dict[str, list[float]]] = {t: {n: [] for n in names} for t in threads}
    for t in threads:
        with num_threads(t):
            for _ in range(warmup):
                for n in names:
                    fns[n]()
    for r in range(repeats):
        for t in _rotated(threads, r):
            with num_threads(t):
                for n in _rotated(names, r):
                    _sync()
                    t0 = time.perf_counter()
                    fns[n]()
                    _sync()
                    samples[t][n].append(time.perf_counter() - t0)
                    if progress is not None:
                        progress()
    return {t: _timings(per, reference) for t, per in samples.items()}


def _rotated(items: list[Any], r: int) -> list[Any]:
    """``items`` rotated left by ``r`` (round r of the interleaving starts at item r)."""
    return items[r % len(items) :] + items[: r % len(items)]


def _timings(samples: dict[str, list[float]], reference: str | None) -> dict[str, Timing]:
    ref = statistics.median(samples[reference]) if reference is not None else None
    return {
        n: Timing(
            median=(med := statistics.median(s)),
            minimum=min(s),
            maximum=max(s),
            ratio=(med / ref) if ref else None,
            repeats=len(s),
        )
        for n, s in samples.items()
    }
