"""How :func:`leangrad.plan` picks among the candidates that fit once they are timed, and
what it does when the fastest are within timing noise of each other.

The rule, in two rounds:

1. Every fitting candidate is timed side by side (:func:`leangrad.measure.time_interleaved`:
   medians of ``repeats`` interleaved rounds after one warm-up). The fastest median leads.
   A candidate is *within noise* of it when the spreads of their repeats overlap (its
   fastest repeat is no slower than the leader's slowest) or its median is within
   :data:`CLOSE` of the leader's. A compiled row, timed in a fresh process and scaled from
   backprop's timing here, has backprop's spread scaled by the same ratio.
2. No candidate within noise: the leader is chosen. Otherwise the leader and those within
   noise of it — at most :data:`MOST_CONTENDERS`, the fastest medians first — are timed
   again, alone and interleaved (round-robin, order rotated each round, after one warm-up
   round), with ``max(RETIME_REPEATS, 2 * repeats)`` rounds (backprop is timed beside them
   as the reference when a compiled row is among them); nothing else is timed again. The
   fastest median of that round wins unless another contender's median is within
   :data:`TIE` of it; then they are indistinguishable and the tie is broken
   deterministically: the **lower peak**, then the **simpler engine** (fewer composed parts,
   an optimizer stepped inside ``on_grad`` counting as one), then the **planner's order**
   (least recomputation first). The chosen row's ``tie_break`` says so:
   ``"within noise of chunked_ce (0.98×): chose by lower peak"``.

Why these margins: the first round is medians of a few repeats, and steps that do the same
work differ by up to ~9% there (``results/issue31/full-size.json``: leangrad's per-block
checkpointing of the full-size GPT at 1.06× backprop's time, PyTorch's at 0.97×, the same
peak), so a gap under :data:`CLOSE` (10%) in that round is no evidence, and a spread that
overlaps is none either. The second round is longer and every contender runs next to every
other, so its medians order steps more reliably, but same-work pairs still differ by a few
percent (the suites' "1.19× vs 1.21×: equal within noise"): a gap under :data:`TIE` (5%) is
taken as none, and then the lower peak, which buys headroom for the same time, decides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ._plan_measure import Tried
from .measure import Timing

__all__ = [
    "CLOSE", "MOST_CONTENDERS", "RETIME_REPEATS", "RULES", "TIE", "WITHIN_NOISE",
    "Choice", "Timer", "choose", "contenders", "within_noise",
]

CLOSE = 0.10
"""First round: a median within this fraction of the fastest's is within noise of it."""
TIE = 0.05
"""Second round: medians within this fraction of the fastest's are indistinguishable."""
MOST_CONTENDERS = 3
"""At most this many candidates (the fastest medians first) are timed again."""
RETIME_REPEATS = 5
"""The second round times at least this many interleaved rounds (``2 * repeats`` if more)."""
RULES = ("lower peak", "simpler engine", "the planner's order")
"""The tie-break, in order: what decides between indistinguishable contenders."""
WITHIN_NOISE = "within noise of {others}: chose by {rule}"
"""The chosen row's ``tie_break`` (each other one as ``label (its time over the chosen's)``)."""


class Timer(Protocol):
    """:func:`leangrad.measure.time_interleaved`'s signature, as the choice calls it."""

    def __call__(self, fns: Mapping[str, Callable[[], object]], *, repeats: int,
                 warmup: int) -> Mapping[str, Timing]: ...  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the timing decided.

    Attributes:
        label: the chosen row's label (``None``: nothing was timed).
        seconds: each timed row's seconds (a contender's from the second round).
        contenders: the labels timed again (empty: the first round decided).
        tie_break: the chosen row's note when the second round could not tell the
            contenders apart (:data:`WITHIN_NOISE`), else ``None``.
    """

    label: str | None
    seconds: dict[str, float]
    contenders: tuple[str, ...] = ()
    tie_break: str | None = None


def within_noise(timing: Timing, leader: Timing, *, margin: float = CLOSE) -> bool:
    """``timing`` cannot be told from the faster ``leader``: their repeats' spreads
    overlap, or its median is within ``margin`` of the leader's."""
    return timing.minimum <= leader.maximum or timing.median <= (1 + margin) * leader.median


def contenders(timings: Mapping[str, Timing]) -> list[str]:
    """The fastest median's label, then those within noise of it (:func:`within_noise`),
    fastest first, at most :data:`MOST_CONTENDERS` in all (ties in median keep the order
    of ``timings``)."""
    ranked = sorted(timings, key=lambda lb: timings[lb].median)  # stable
    leader = timings[ranked[0]]
    near = [lb for lb in ranked[1:] if within_noise(timings[lb], leader)]
    return [ranked[0], *near][:MOST_CONTENDERS]


def choose(
    steps: Mapping[str, Callable[[], object]],
    *,
    fitting: Sequence[str],
    scaled: Mapping[str, float],
    reference: str,
    rows: Sequence[Tried],
    repeats: int,
    timer: Timer,
    progress: Callable[[str], None] | None = None,
) -> Choice:
    """Time the fitting candidates and choose one by the rule of this module.

    Args:
        steps: label -> one step, for every row timed in this process (``reference``
            among them whenever ``scaled`` is not empty).
        fitting: the labels of ``steps`` that are candidates (the reference may be in
            ``steps`` only to scale the compiled rows from).
        scaled: a compiled row's label -> its time over the reference's.
        reference: the label ``scaled`` is relative to (``"backprop"``).
        rows: the plan's rows, in the planner's order (peaks and names for the tie-break).
        repeats: the first round's timed rounds.
        timer: :func:`leangrad.measure.time_interleaved` (tests give a fake one).
        progress: told when the second round starts.
    """
    first = timer(steps, repeats=repeats, warmup=1)
    timings = _candidate_timings(first, fitting, scaled, reference)
    if not timings:
        return Choice(None, {})
    seconds = {lb: t.median for lb, t in timings.items()}
    near = contenders(timings)
    if len(near) == 1:
        return Choice(near[0], seconds)
    again = {lb: steps[lb] for lb in near if lb in steps}
    if any(lb in scaled for lb in near):
        again[reference] = steps[reference]
    if progress is not None:
        progress(f"timing the {len(near)} within noise of the fastest again, interleaved")
    second = timer(again, repeats=max(RETIME_REPEATS, 2 * repeats), warmup=1)
    retimed = _candidate_timings(second, near, {lb: scaled[lb] for lb in near if lb in scaled},
                                 reference)  # fmt: skip
    seconds.update({lb: t.median for lb, t in retimed.items()})
    best = min(near, key=lambda lb: seconds[lb])  # the first of equal medians: stable
    tied = [lb for lb in near if seconds[lb] <= (1 + TIE) * seconds[best]]
    if len(tied) == 1:
        return Choice(best, seconds, tuple(near))
    chosen, rule = _tie_break(tied, rows)
    others = ", ".join(f"{lb} ({seconds[lb] / seconds[chosen]:.2f}×)"
                       for lb in tied if lb != chosen)  # fmt: skip
    return Choice(chosen, seconds, tuple(near), WITHIN_NOISE.format(others=others, rule=rule))


def _candidate_timings(timed: Mapping[str, Timing], fitting: Sequence[str],
                       scaled: Mapping[str, float], reference: str,
                       ) -> dict[str, Timing]:  # fmt: skip
    """Each candidate's timing: its own where it was timed here, else (a compiled row) the
    reference's scaled by its ratio, spread and all."""
    out = {lb: timed[lb] for lb in fitting if lb in timed}
    ref = timed.get(reference)
    if ref is not None:
        out.update({lb: _scale(ref, ratio) for lb, ratio in scaled.items()})
    return out


def _scale(t: Timing, ratio: float) -> Timing:
    return Timing(t.median * ratio, t.minimum * ratio, t.maximum * ratio, None, t.repeats)


def _tie_break(tied: Sequence[str], rows: Sequence[Tried]) -> tuple[str, str]:
    """The tied label the rule picks, and the rule (one of :data:`RULES`) that decided:
    the first key on which it differs from the runner-up."""
    at = {t.label: i for i, t in enumerate(rows)}
    by = {t.label: t for t in rows}

    def key(label: str) -> tuple[int, int, int]:
        row = by.get(label)
        peak = row.peak if row is not None and row.peak is not None else 2**63
        parts = 1 + (row.name.count("+") + row.per_layer if row is not None else 0)
        return peak, parts, at.get(label, len(rows))

    ranked = sorted(tied, key=key)
    first, second = key(ranked[0]), key(ranked[1])
    rule = next((r for r, a, b in zip(RULES, first, second, strict=True) if a != b), RULES[-1])
    return ranked[0], rule
