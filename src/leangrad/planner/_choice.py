"""How :func:`leangrad.plan` picks among the candidates that fit once they are timed, and
what it does when the fastest are within timing noise of each other.

The rule, in two rounds (the first raced):

1. Every fitting candidate is timed side by side (:func:`leangrad.measure.time_interleaved`:
   medians of ``repeats`` interleaved rounds). The first round is a race: one interleaved
   round of every candidate, and a candidate whose time in it is more than :data:`RACE`
   times the fastest's is out — its row keeps that one round's time and says so
   (:data:`RACED_OUT`) — and only the others run the remaining ``repeats - 1`` rounds
   (interleaved, the order rotated each round as ``time_interleaved`` rotates it; a
   candidate's median is over all its rounds, the race's included). Where rounds remain
   after the second, the race cuts once more: a candidate whose faster round is more than
   :data:`RACE_TWO` times the slower round of the fastest median so far is out, its row
   keeping the median of its two. The fastest median leads. A candidate is *within noise*
   of it when the spreads of their repeats overlap (its fastest repeat is no slower than
   the leader's slowest) or its median is within :data:`CLOSE` of the leader's. A compiled
   row, timed in a fresh process and scaled from backprop's timing here, has backprop's
   spread scaled by the same ratio (in the race too).
2. No candidate within noise: the leader is chosen. Otherwise the leader and those within
   noise of it — at most :data:`MOST_CONTENDERS`, the fastest medians first — are timed
   again, alone and interleaved (round-robin, order rotated each round), until each has
   ``max(RETIME_REPEATS, 2 * repeats)`` rounds, its first round's ``repeats`` included
   (backprop is timed beside them as the reference when a compiled row is among them);
   nothing else is timed again. The fastest median over those rounds wins unless another
   contender's median is within :data:`TIE` of it; then they are indistinguishable and the
   tie is broken deterministically: the **lower peak**, then the **simpler engine** (fewer
   composed parts, an optimizer stepped inside ``on_grad`` counting as one), then the
   **planner's order** (least recomputation first). The chosen row's ``tie_break`` says so:
   ``"within noise of chunked_ce (0.98×): chose by lower peak"``.

The second round keeps the first round's rounds of its contenders (the same steps timed the
same way), so a contender runs ``max(RETIME_REPEATS, 2 * repeats) - repeats`` more steps.
No round runs a warm-up of its own: every row timed here has run before — its peak was
measured on a real step (:mod:`leangrad.planner._measure`) — and the planner runs a row it
has not run yet (the reference backprop when only compiled rows need it) once before the
race.

Why these margins: steps that do the same work differ by up to ~9% in a first round of a
few repeats, so a gap under :data:`CLOSE` is no evidence; the second round's medians are
over more rounds, but same-work pairs still differ by a few percent, so a gap under
:data:`TIE` is taken as none and the lower peak, which buys headroom for the same time,
decides. The race's cuts (:data:`RACE`, :data:`RACE_TWO`) drop only candidates too far
behind to have been contenders under the full rule, and only where steps take long enough
(:data:`RACE_FROM`) for one round to mean something. The measurements behind these margins:
docs/planner-evidence.md.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ..measure import Timing
from ._measure import Tried

__all__ = [
    "CLOSE", "MOST_CONTENDERS", "RACE", "RACED_OUT", "RACE_FROM", "RACE_TWO", "RETIME_REPEATS",
    "RULES", "TIE", "WITHIN_NOISE", "Choice", "Timer", "choose", "contenders", "raced_note",
    "within_noise",
]

CLOSE = 0.10
"""First round: a median within this fraction of the fastest's is within noise of it."""
TIE = 0.05
"""Second round: medians within this fraction of the fastest's are indistinguishable."""
MOST_CONTENDERS = 3
"""At most this many candidates (the fastest medians first) are timed again."""
RETIME_REPEATS = 5
"""A contender's second-round median is over at least this many interleaved rounds
(``2 * repeats`` if more), its first round's included."""
RACE = 1.5
"""The race: a candidate whose one timed round is more than this times the fastest's is out
(why that is safe: docs/planner-evidence.md)."""
RACE_FROM = 0.5
"""Seconds: the race drops nothing where the fastest's round took less (one round of a
short step is at the mercy of whatever else the machine runs: docs/planner-evidence.md)."""
RACE_TWO = 1.25
"""The race's second cut, after two rounds: a candidate whose faster round is more than this
times the slower round of the fastest median is out (why that is safe:
docs/planner-evidence.md)."""
RACED_OUT = "raced out: {ratio:.2f}× the fastest in {rounds}"
"""What a raced-out row's verdict adds (its time is the median of the rounds it ran;
``rounds``: "one round" or "2 rounds")."""
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
        raced: each raced-out row's time over the fastest's when it was dropped
            (:data:`RACE`, :data:`RACE_TWO`).
        raced_in: the rounds each raced-out row ran where more than one (:data:`RACE_TWO`).
    """

    label: str | None
    seconds: dict[str, float]
    contenders: tuple[str, ...] = ()
    tie_break: str | None = None
    raced: dict[str, float] = dataclasses.field(default_factory=dict)
    raced_in: dict[str, int] = dataclasses.field(default_factory=dict)


def raced_note(choice: Choice, label: str) -> str | None:
    """What ``label``'s verdict adds where the race dropped it (:data:`RACED_OUT`)."""
    ratio = choice.raced.get(label)
    if ratio is None:
        return None
    rounds = choice.raced_in.get(label, 1)
    return RACED_OUT.format(ratio=ratio, rounds="one round" if rounds == 1 else f"{rounds} rounds")


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
    race: float | None = RACE,
    race_two: float | None = RACE_TWO,
) -> Choice:
    """Time the fitting candidates and choose one by the rule of this module.

    Args:
        steps: label -> one step, for every row timed in this process (``reference``
            among them whenever ``scaled`` is not empty), each run here before (the
            rounds run no warm-up of their own).
        fitting: the labels of ``steps`` that are candidates (the reference may be in
            ``steps`` only to scale the compiled rows from).
        scaled: a compiled row's label -> its time over the reference's.
        reference: the label ``scaled`` is relative to (``"backprop"``).
        rows: the plan's rows, in the planner's order (peaks and names for the tie-break).
        repeats: the first round's timed rounds (the race's one included).
        timer: :func:`leangrad.measure.time_interleaved` (tests give a fake one), called
            once per round (one timed repeat, no warm-up).
        progress: told when the second round starts.
        race: :data:`RACE`; ``None`` races nothing (every candidate runs every round: the
            rule without the race, which tests compare it with); nor does a race whose
            fastest round took less than :data:`RACE_FROM` seconds.
        race_two: :data:`RACE_TWO`; ``None`` makes no second cut (nor does a race that
            races nothing).
    """
    samples: dict[str, list[float]] = {}
    _add(samples, timer(steps, repeats=1, warmup=0))  # the race: round 0
    single = _candidate_timings(_timings(samples), fitting, scaled, reference)
    if not single:
        return Choice(None, {})
    fastest = min(t.median for t in single.values())
    racing = race is not None and fastest >= RACE_FROM
    raced = {lb: t.median / fastest for lb, t in single.items()
             if racing and t.median > (race or 0) * fastest}  # fmt: skip
    alive = [lb for lb in single if lb not in raced]
    seconds = {lb: single[lb].median for lb in raced}
    raced_in: dict[str, int] = {}

    def now() -> dict[str, Timing]:
        return _candidate_timings(_timings(samples), alive,
                                  {lb: v for lb, v in scaled.items() if lb in alive},
                                  reference)  # fmt: skip

    for r in range(1, repeats):
        _add(samples, _round(timer, _steps_of(alive, steps, scaled, reference), r))
        if r == 1 and r + 1 < repeats and racing and race_two is not None:  # the second cut
            two = now()
            lead = two[min(two, key=lambda lb: two[lb].median)]
            for lb, t in two.items():
                if t.minimum > race_two * lead.maximum:
                    raced[lb], raced_in[lb], seconds[lb] = t.median / lead.median, 2, t.median
            alive = [lb for lb in alive if lb not in raced_in]
    timings = now()
    seconds |= {lb: t.median for lb, t in timings.items()}
    near = contenders(timings)
    if len(near) == 1:
        return Choice(near[0], seconds, raced=raced, raced_in=raced_in)
    if progress is not None:
        progress(f"timing the {len(near)} within noise of the fastest again, interleaved")
    retimed = _retimed(near, steps, samples, scaled, reference, repeats, timer)
    seconds.update({lb: t.median for lb, t in retimed.items()})
    best = min(near, key=lambda lb: seconds[lb])  # the first of equal medians: stable
    tied = [lb for lb in near if seconds[lb] <= (1 + TIE) * seconds[best]]
    if len(tied) == 1:
        return Choice(best, seconds, tuple(near), raced=raced, raced_in=raced_in)
    chosen, rule = _tie_break(tied, rows)
    others = ", ".join(f"{lb} ({seconds[lb] / seconds[chosen]:.2f}×)"
                       for lb in tied if lb != chosen)  # fmt: skip
    return Choice(chosen, seconds, tuple(near), WITHIN_NOISE.format(others=others, rule=rule),
                  raced, raced_in)  # fmt: skip


def _retimed(near: Sequence[str], steps: Mapping[str, Callable[[], object]],
             samples: Mapping[str, list[float]], scaled: Mapping[str, float], reference: str,
             repeats: int, timer: Timer) -> dict[str, Timing]:  # fmt: skip
    """The second round: the contenders ``near`` (and the reference, where one of them is
    scaled from it) timed again, interleaved, their first round's samples pooled in."""
    again = _steps_of(near, steps, scaled, reference)
    pooled = {lb: list(samples[lb]) for lb in again}  # their first round's, then more
    for r in range(repeats, max(RETIME_REPEATS, 2 * repeats)):
        _add(pooled, _round(timer, again, r))
    return _candidate_timings(_timings(pooled), near,
                              {lb: scaled[lb] for lb in near if lb in scaled},
                              reference)  # fmt: skip


def _steps_of(names: Sequence[str], steps: Mapping[str, Callable[[], object]],
              scaled: Mapping[str, float], reference: str) -> dict[str, Callable[[], object]]:
    """The steps of ``names`` timed in this process, and the reference where one of them
    is a compiled row scaled from it."""
    fns = {lb: steps[lb] for lb in names if lb in steps}
    if any(lb in scaled for lb in names):
        fns[reference] = steps[reference]
    return fns


def _round(timer: Timer, fns: Mapping[str, Callable[[], object]], r: int) -> Mapping[str, Timing]:
    """Round ``r``: each of ``fns`` timed once, in the order rotated left by ``r`` (the
    rotation :func:`~leangrad.measure.time_interleaved` gives its round ``r``), no warm-up."""
    names = list(fns)
    order = names[r % len(names):] + names[: r % len(names)]
    return timer({lb: fns[lb] for lb in order}, repeats=1, warmup=0)


def _add(samples: dict[str, list[float]], timed: Mapping[str, Timing]) -> None:
    """Append one round's times (one timed repeat each) to ``samples``."""
    for lb, t in timed.items():
        samples.setdefault(lb, []).append(t.median)


def _timings(samples: Mapping[str, list[float]]) -> dict[str, Timing]:
    """Each label's rounds as one :class:`~leangrad.measure.Timing` (median, spread)."""
    return {lb: Timing(statistics.median(s), min(s), max(s), None, len(s))
            for lb, s in samples.items()}  # fmt: skip


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
