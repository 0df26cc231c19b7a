"""The largest batch whose step fits a fixed budget, for the ``zoo`` suite.

:func:`max_batch` searches a monotone ``total(batch)`` (parameters, buffers, inputs and the
step's peak): two probes give an affine guess (activations grow linearly with the batch),
a doubling walk brackets the boundary around it, and bisection closes the bracket. Each
probe is :func:`footprint`: the allocator-level tracker on a real step, or the same tracker
on fake tensors (:func:`leangrad.measure.estimate_memory`, nothing allocated), which the
suite uses where it equals the real tracker at the base batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from leangrad.engines import available, engine_class
from leangrad.engines._transforms import AccumulateTransform
from leangrad.measure import estimate_memory, profile_step

from ._models import build
from ._search import bisect_last_fit
from ._zoo_methods import Method

__all__ = [
    "NOT_ESTIMABLE",
    "BatchSearch",
    "Footprint",
    "estimable",
    "footprint",
    "max_batch",
    "micro_batches",
]

NOT_ESTIMABLE = (
    "not estimated on fake tensors: {engine}'s forward-mode AD (vmap of jvps) reads values, "
    "and a failure inside it under FakeTensorMode left the dispatcher's thread-local state "
    "excluding autograd for the rest of the process (torch 2.13); the tracker measures it"
)
BAD_SEARCH = "max_batch: start and limit must be ints with 1 <= start <= limit, got {s!r}, {lim!r}"


@dataclasses.dataclass(frozen=True)
class Footprint:
    """One step's memory at one batch size, in bytes.

    Attributes:
        baseline: parameters, buffers and inputs.
        peak: the tracker's peak above the baseline.
        kept: live bytes above the baseline when the forward phase ended (``None`` if the
            step did not mark it).
        estimate: measured on fake tensors.
    """

    baseline: int
    peak: int
    kept: int | None
    estimate: bool

    @property
    def total(self) -> int:
        return self.baseline + self.peak


@dataclasses.dataclass(frozen=True)
class BatchSearch:
    """The result of :func:`max_batch`.

    Attributes:
        batch: the largest batch that fits (0: not even one sample).
        capped: ``batch`` is the search's ``limit``; a larger one may fit too.
        probes: batch -> total bytes, every size measured.
        fails: the smallest batch probed that does not fit (``None``: none did); with a
            ``relative`` search the true boundary lies in ``[batch, fails)``.
    """

    batch: int
    capped: bool
    probes: dict[int, int]
    fails: int | None = None


def estimable(method: Method) -> str | None:
    """``None`` if ``method`` may run on fake tensors, else why not (:data:`NOT_ESTIMABLE`)."""
    name = method.spec.get("engine", "")
    base = name.split("+")[0]  # a composition's base engine (forward-mode ones take none)
    if base in available() and engine_class(base).forward_mode:
        return NOT_ESTIMABLE.format(engine=name)
    return None


def micro_batches(method: Method) -> int:
    """How many micro-batches ``method`` splits the batch into (1: it does not)."""
    spec = method.spec
    if "engine" in spec:
        if "accumulate" not in spec["engine"].split("+"):
            return 1
        default = AccumulateTransform().options["micro_batches"]
        return int(spec.get("options", {}).get("micro_batches", default))
    return int(spec.get("arg") or 1) if "accumulate" in str(spec.get("torch")) else 1


def footprint(
    name: str,
    size: dict[str, Any],
    method: Method,
    batch: int,
    *,
    estimate: bool,
    device: str = "cpu",
) -> Footprint:
    """Memory of ``method``'s step on zoo model ``name`` at ``batch``: on fake tensors when
    ``estimate`` (a method that is not :func:`estimable` raises ``ValueError`` saying why),
    otherwise a warm-up step, then the tracked one on ``device`` (estimates are of the
    CPU's allocations: the same tensors, without the CUDA allocator's rounding).

    A batch below the method's :func:`micro_batches` k (gradient accumulation has no step
    with fewer examples than micro-batches) is measured at k: the total stays
    non-decreasing in the batch, as :func:`max_batch` needs, and a search finds 0 where
    not even k examples fit."""
    batch = max(batch, micro_batches(method))
    why = estimable(method)
    if estimate and why is not None:
        raise ValueError(why)
    if not estimate:
        wl = build(name, size, batch=batch, device=device)
        prof = profile_step(method.make(), wl.model, wl.inputs, wl.loss_fn, repeats=0)
        return Footprint(prof.baseline_bytes, prof.peak_bytes, prof.kept_bytes, False)
    held: dict[str, Any] = {}

    def make() -> tuple[Any, Any]:
        wl = build(name, size, batch=batch)
        held["loss"] = wl.loss_fn
        return wl.model, wl.inputs

    def step(model: Any, x: Any) -> None:
        method.make().backward(model, x if isinstance(x, tuple) else (x,), held["loss"])

    rep = estimate_memory(make, step)
    return Footprint(rep.baseline_bytes, rep.peak_bytes, rep.forward_live_bytes, True)


def max_batch(
    total: Callable[[int], int],
    budget: int,
    *,
    start: int,
    limit: int,
    fixed: int = 0,
    known: dict[int, int] | None = None,
    relative: int | None = None,
) -> BatchSearch:
    """The largest ``b <= limit`` with ``total(b) <= budget``, for ``total`` non-decreasing
    in ``b`` (then the answer is non-decreasing in ``budget``).

    The first guess assumes ``total(b) = fixed + b * (total(start) - fixed) / start``; a
    doubling walk from it brackets the boundary and bisection closes the bracket, so a
    wrong ``fixed`` costs probes, never correctness.

    Args:
        total: batch size -> bytes the step needs in all.
        budget: bytes available.
        start: the batch probed first (e.g. the suite's base batch).
        limit: the largest batch tried.
        fixed: bytes that do not grow with the batch (e.g. parameters and gradients).
        known: ``{batch: total}`` already measured (not measured again).
        relative: stop once the bracket is within ``batch // relative`` (and walk in steps
            of ``guess // relative``): an answer within 1/``relative`` for far fewer probes
            where each is a measured step of a large model. ``None``: exact.

    Returns:
        A :class:`BatchSearch` (``batch=0`` when even one sample does not fit).
    """
    if not (isinstance(start, int) and isinstance(limit, int) and 1 <= start <= limit):
        raise ValueError(BAD_SEARCH.format(s=start, lim=limit))
    seen: dict[int, int] = dict(known or {})

    def fits(b: int) -> bool:
        if b not in seen:
            seen[b] = total(b)
        return seen[b] <= budget

    fits(start)
    slope = (seen[start] - fixed) / start
    guess = start + int((budget - seen[start]) // slope) if slope > 0 else limit
    guess = max(1, min(limit, guess))
    step = max(1, guess // relative) if relative else 1
    if fits(guess):  # walk up: lo fits, hi does not (or lies past the limit)
        lo, hi = guess, limit + 1
        while guess + step <= limit:
            if not fits(guess + step):
                hi = guess + step
                break
            lo, step = guess + step, 2 * step
        if hi == limit + 1 and lo < limit:
            if fits(limit):
                lo = limit
            else:
                hi = limit
    else:  # walk down
        lo, hi = 0, guess
        while guess - step >= 1:
            if fits(guess - step):
                lo = guess - step
                break
            hi, step = guess - step, 2 * step
    lo = bisect_last_fit(fits, lo, hi, relative=relative)
    fails = min((b for b, t in seen.items() if t > budget), default=None)
    return BatchSearch(
        batch=lo, capped=lo == limit, probes=dict(sorted(seen.items())), fails=fails
    )
