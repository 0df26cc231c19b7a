"""``leangrad.plan`` spends its steps only where they decide: the first
timing round is a race (a candidate far behind after one round is out, its row saying
so), a candidate whose fake-tensor estimate is well over the budget is never run, one
whose first step fits is tracked once, and no timing round runs a warm-up of its own (the
second round's pooling of the first's rounds: ``tests/test_plan_noise.py``). Counted,
never timed: the clock is a fake that runs every step it is given and answers given
seconds; the steps each candidate runs are counted where the planner makes its engines."""

from __future__ import annotations

import collections
import random
import statistics
from collections.abc import Callable, Mapping, Sequence

import pytest
import torch

import leangrad
import leangrad.planner._choice as pc
import leangrad.planner._measure as pm
import leangrad.planner._plan as planner
from leangrad._sizes import fmt_bytes
from leangrad.measure import Timing, estimate_step, profile_step
from leangrad.planner._measure import ESTIMATE_MARGIN, ESTIMATED, FIRST_STEP_MARGIN, Tried
from shared_models import tiny_gpt_step


class Clock:
    """Stands in for ``time_interleaved``: runs each function ``warmup + repeats`` times
    (``run=True``) and answers each label's next ``repeats`` given seconds; records every
    call (labels in order, repeats, warm-up)."""

    def __init__(self, seconds: Mapping[str, Sequence[float]], *, run: bool = True) -> None:
        self.seconds = {k: list(v) for k, v in seconds.items()}
        self.used: dict[str, int] = dict.fromkeys(seconds, 0)
        self.calls: list[tuple[list[str], int, int]] = []
        self.run = run

    def __call__(self, fns: Mapping[str, Callable[[], object]], *, repeats: int,
                 warmup: int, **_: object) -> dict[str, Timing]:  # fmt: skip
        self.calls.append((list(fns), repeats, warmup))
        out = {}
        for k, fn in fns.items():
            for _ in range(warmup + repeats if self.run else 0):
                fn()
            got = self.seconds[k][self.used[k]: self.used[k] + repeats]
            assert len(got) == repeats, f"{k}: no more seconds given"
            self.used[k] += repeats
            out[k] = Timing(statistics.median(got), min(got), max(got), None, repeats)
        return out

    def timed(self, label: str) -> int:
        """How many timed rounds ``label`` ran."""
        return self.used[label]


def _row(label: str, peak: int) -> Tried:
    return Tried(object(), label, True, peak, "fits", label, {})


def _choose(clock: Clock, labels: Sequence[str], *, repeats: int = 3,
            race: float | None = pc.RACE,
            race_two: float | None = pc.RACE_TWO) -> pc.Choice:  # fmt: skip
    steps: dict[str, Callable[[], object]] = {lb: (lambda: None) for lb in labels}
    rows = [_row(lb, 100 + i) for i, lb in enumerate(labels)]
    return pc.choose(steps, fitting=list(labels), scaled={}, reference="backprop", rows=rows,
                     repeats=repeats, timer=clock, race=race, race_two=race_two)  # fmt: skip


def test_the_race_drops_a_candidate_far_behind_after_one_round() -> None:
    """Four candidates; the one 1.6× the fastest in the race's round runs no other round,
    keeps that round's time and is reported; the rest run all ``repeats`` rounds (the second
    cut left out: the next test), and the choice is the one the rule without the race
    makes."""
    seconds = {"a": [1.00, 1.02, 0.98], "b": [1.30, 1.28, 1.31], "c": [1.60, 1.62, 1.58],
               "d": [1.45, 1.50, 1.40]}  # fmt: skip
    raced, full = Clock(seconds, run=False), Clock(seconds, run=False)
    got = _choose(raced, list(seconds), race_two=None)
    assert got.raced == {"c": pytest.approx(1.60)} and got.seconds["c"] == 1.60
    assert raced.timed("c") == 1 and all(raced.timed(k) == 3 for k in "abd")
    assert raced.calls[0] == (["a", "b", "c", "d"], 1, 0)  # the race: one round, no warm-up
    assert all(c[1:] == (1, 0) and "c" not in c[0] for c in raced.calls[1:])
    assert [c[0] for c in raced.calls[1:]] == [["b", "d", "a"], ["d", "a", "b"]]  # rotated
    whole = _choose(full, list(seconds), race=None)  # the rule without the race
    assert whole.raced == {} and all(full.timed(k) == 3 for k in "abcd")
    assert (got.label, got.contenders) == (whole.label, whole.contenders) == ("a", ())
    assert got.seconds == {**whole.seconds, "c": 1.60}  # the rest: the same medians


def test_the_second_cut_drops_a_candidate_whose_faster_round_is_far_behind() -> None:
    """After two rounds: b's faster round (1.28) is more than RACE_TWO times a's slower one
    (1.02): out, with the median of its two and a note that says so; d, at 1.22x, runs the
    third round, which the choice is made from as without the cut."""
    seconds = {"a": [1.00, 1.02, 0.98], "b": [1.30, 1.28, 1.31], "d": [1.22, 1.25, 1.20]}
    cut, full = Clock(seconds, run=False), Clock(seconds, run=False)
    got = _choose(cut, list(seconds))
    assert got.raced == {"b": pytest.approx(1.29 / 1.01)} and got.raced_in == {"b": 2}
    assert got.seconds["b"] == pytest.approx(1.29)
    assert cut.timed("b") == 2 and cut.timed("a") == cut.timed("d") == 3
    assert pc.raced_note(got, "b") == "raced out: 1.28× the fastest in 2 rounds"
    assert pc.raced_note(got, "a") is None
    whole = _choose(full, list(seconds), race=None)
    assert (got.label, got.contenders) == (whole.label, whole.contenders) == ("a", ())
    short = Clock(seconds, run=False)  # two rounds in all: nothing left to save
    assert _choose(short, list(seconds), repeats=2).raced == {}


@pytest.mark.parametrize("seed", range(20))
def test_the_second_cut_drops_no_contender_of_the_full_rule(seed: int) -> None:
    """Random scenarios with ±9% noise, some candidates 1.0-1.15× the fastest and some
    1.3-1.6× (within the first cut's margin, so only the second can drop them): what the
    two cuts drop is never a contender of the full rule, which chooses the same."""
    _, got, whole = _against_the_full_rule(random.Random(1000 + seed), slow=(1.3, 1.6))
    assert not set(got.raced) & set(whole.contenders)


def test_a_candidate_just_inside_the_race_margin_runs_every_round() -> None:
    clock = Clock({"a": [1.00] * 3, "b": [pc.RACE * 1.00] * 3}, run=False)  # exactly 1.5×
    got = _choose(clock, ["a", "b"], race_two=None)
    assert got.raced == {} and clock.timed("b") == 3 and got.label == "a"


def test_short_steps_are_not_raced() -> None:
    """Below RACE_FROM seconds one round is at the mercy of the machine: everyone runs
    every round, and the medians decide as without the race."""
    short = pc.RACE_FROM / 10
    clock = Clock({"a": [short] * 9, "b": [2 * short, 1.05 * short, 1.05 * short] + [
        1.2 * short] * 6}, run=False)  # fmt: skip
    got = _choose(clock, ["a", "b"])
    assert got.raced == {} and clock.timed("b") == 3 + 3  # within noise: 6 rounds in all
    assert got.contenders == ("a", "b") and got.label == "a"


@pytest.mark.parametrize("seed", range(20))
def test_the_race_chooses_what_the_full_rule_chooses_when_the_dropped_are_slower(
    seed: int,
) -> None:  # fmt: skip
    """Random scenarios: step times with ±9% noise (the module's measured spread), some
    candidates close to the fastest (so the second round and the tie-break run), some
    truly ≥ 1.8× slower. Each label's seconds are the same sequence with and without the
    race: the chosen row, the contenders and the tie-break are identical, and every
    candidate the race dropped is one of the slow ones."""
    true, got, _ = _against_the_full_rule(random.Random(seed), slow=(1.8, 3.0))
    assert all(true[k] >= 1.8 for k in got.raced)


def _against_the_full_rule(rng: random.Random, *, slow: tuple[float, float],
                           ) -> tuple[dict[str, float], pc.Choice, pc.Choice]:  # fmt: skip
    """A random scenario — 3-9 candidates, each 1.0×, 1.0-1.15× or ``slow`` times the
    fastest, ±9% noise per round — chosen with the race and by the full rule on the same
    seconds: the true times and both choices, asserted to agree (label, contenders,
    tie-break) with the race timing no more steps."""
    true = {f"e{i}": rng.choice([1.0, 1.0 + rng.uniform(0, 0.15), rng.uniform(*slow)])
            for i in range(rng.randint(3, 9))}  # fmt: skip
    true["e0"] = 1.0  # one fastest at least
    seconds = {k: [t * rng.uniform(0.91, 1.09) for _ in range(3 + 6)] for k, t in true.items()}
    raced, full = Clock(seconds, run=False), Clock(seconds, run=False)
    got = _choose(raced, list(seconds))
    whole = _choose(full, list(seconds), race=None)
    assert (got.label, got.contenders, got.tie_break) == (
        whole.label, whole.contenders, whole.tie_break)  # fmt: skip
    assert sum(raced.used.values()) <= sum(full.used.values())
    return true, got, whole


def test_the_race_scales_a_compiled_row_from_the_reference() -> None:
    """A compiled row (not timed here) races at its ratio times backprop's round: at 1.7×
    it is out, and backprop, its reference only, is not timed further for it."""
    clock = Clock({"backprop": [1.0] * 3, "checkpoint": [0.9] * 3}, run=False)
    rows = [_row("checkpoint", 100), _row("compile", 90)]
    steps: dict[str, Callable[[], object]] = {"checkpoint": lambda: None,
                                              "backprop": lambda: None}  # fmt: skip
    got = pc.choose(steps, fitting=["checkpoint"], scaled={"compile": 1.7}, reference="backprop",
                    rows=rows, repeats=3, timer=clock)  # fmt: skip
    assert got.raced == {"compile": pytest.approx(1.7 / 0.9)} and got.label == "checkpoint"
    assert clock.timed("backprop") == 1 and clock.timed("checkpoint") == 3
    assert got.seconds["compile"] == pytest.approx(1.7)


# -- through leangrad.plan: steps counted per candidate -----------------------------------


_gpt = tiny_gpt_step


B0, B01, FRAG = ("checkpoint(blocks=['blocks.0'])", "checkpoint(blocks=['blocks.0', 'blocks.1'])",
                 "checkpoint(fragments=2)")  # fmt: skip
ENGINES = [("backprop", {}), ("checkpoint", {"blocks": ["blocks.0"]}),
           ("checkpoint", {"blocks": ["blocks.0", "blocks.1"]}), ("checkpoint", {}),
           ("checkpoint", {"fragments": 2})]  # fmt: skip


@pytest.mark.slow
def test_plan_runs_a_candidate_only_where_a_step_decides(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """At 945 kB on the tiny GPT (totals: backprop 1.51 MB, blocks.0 1.23 MB, blocks.0-1
    948 kB, checkpoint 770 kB, fragments=2 681 kB): backprop and blocks.0 are over by more
    than the margin on their estimates and never run (fragments=2, which probes, is not
    estimated); blocks.0-1, over by 0.4%, is measured (its first step over budget by less
    than ``FIRST_STEP_MARGIN``: tracked again, warm — 2); checkpoint fits on its
    first step (1), and so does fragments=2, whose probe holds nothing at the step's peak
    (1); both are raced and timed with no warm-up rounds (3), and the chosen one
    re-measured once (1). The same plan took 20 steps before (every peak 2, every round a
    warm-up, the re-measurement 2); 11 now."""
    model, idx, loss_fn = _gpt()
    clock = Clock({"checkpoint": [1.0] * 3, FRAG: [1.2] * 3})
    monkeypatch.setattr(planner, "time_interleaved", clock)
    p = leangrad.plan(model, idx, loss_fn, budget=945_000, repeats=3, engines=ENGINES)
    real = {lb: n for (lb, kind), n in counted.items() if kind == "real"}
    assert real == {B01: 2, "checkpoint": 1 + 3 + 1, FRAG: 1 + 3}
    fake = {lb: n for (lb, kind), n in counted.items() if kind == "fake"}
    # backprop's first: can anything be allocated here? FRAG probes: never estimated
    assert fake == {"backprop": 1 + 1, B0: 1, B01: 1, "checkpoint": 1}
    assert sum(real.values()) == 11
    rows = {c.label: c for c in p.table}
    for label, (name, opts) in (("backprop", ENGINES[0]), (B0, ENGINES[1])):
        assert rows[label].verdict == f"over budget ({ESTIMATED})" and rows[label].estimate
        assert rows[label].seconds is None
        assert rows[label].peak_bytes == profile_step(  # the estimate is the tracker's peak
            leangrad.engine(name, **opts), model, idx, loss_fn, repeats=0).total_bytes
    assert rows[B01].verdict == "over budget" and not rows[B01].estimate
    assert rows[B01].peak_bytes is not None and 945_000 < rows[B01].peak_bytes <= (
        1 + ESTIMATE_MARGIN) * 945_000  # fmt: skip
    assert p.engine is not None and p.engine.label == "checkpoint" and p.seconds == 1.0
    assert rows[FRAG].verdict == "fits" and rows[FRAG].seconds == 1.2
    assert [c[1:] for c in clock.calls] == [(1, 0)] * 3  # the race, two rounds, no warm-up


def test_a_row_over_budget_by_more_than_the_margin_on_its_estimate_is_not_run(
    counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """blocks.0-1 (948 kB on the tiny GPT), 5% over at 900 kB: more than
    ``ESTIMATE_MARGIN`` (2%) on its estimate, so it is never run (it was at 10%)."""
    model, idx, loss_fn = _gpt()
    p = leangrad.plan(model, idx, loss_fn, budget=900_000, repeats=1, engines=[ENGINES[2]])
    row = p.table[0]
    assert row.verdict == f"over budget ({ESTIMATED})" and row.estimate
    assert row.peak_bytes is not None and row.peak_bytes > (1 + ESTIMATE_MARGIN) * 900_000
    assert counted[(B01, "real")] == 0 and counted[(B01, "fake")] == 1


@pytest.mark.slow
def test_fragments_are_estimated_where_real_steps_cost_far_more_than_fake_ones(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """Fragments' estimates cost about a step, so they are asked only once the plan's real
    steps have taken ``COSTLY_FROM`` times its cheapest fake one (the ResNet's convolutions).
    With the ratio at 0, a fake and a real step are evidence enough: after blocks.0-1's
    estimate (948 kB, screened) and fragments=2's real step (681 kB, 13.5% over 600 kB),
    fragments=4 (637 kB, 6% over) is estimated and not run. With the rule off (``counted``
    pins the ratio infinite: counts must not depend on this machine's speed) both fragment
    rows are stepped."""
    model, idx, loss_fn = _gpt()
    with monkeypatch.context() as shipped:  # the library's ratio, not the fixture's
        shipped.setattr(pm, "COSTLY_FROM", 50.0)
        assert not pm.Clock().fakes_cheap() and not pm.Clock(fake=0.1, real=4.9).fakes_cheap()
        assert pm.Clock(fake=0.1, real=5.0).fakes_cheap() and not pm.Clock(real=5.0).fakes_cheap()
    four = "checkpoint(fragments=4)"
    engines = [ENGINES[2], ENGINES[4], ("checkpoint", {"fragments": 4})]

    def steps() -> dict[tuple[str, str], int]:  # backprop's too-big check aside
        return {k: n for k, n in counted.items() if n and k[0] != "backprop"}

    leangrad.plan(model, idx, loss_fn, budget=600_000, repeats=1, engines=engines)
    assert steps() == {(B01, "fake"): 1, (FRAG, "real"): 1, (four, "real"): 1}
    counted.clear()
    monkeypatch.setattr(pm, "COSTLY_FROM", 0.0)
    p = leangrad.plan(model, idx, loss_fn, budget=600_000, repeats=1, engines=engines)
    row = {c.label: c for c in p.table}[four]
    assert row.verdict == f"over budget ({ESTIMATED})" and row.estimate
    assert row.peak_bytes is not None and row.peak_bytes > (1 + ESTIMATE_MARGIN) * 600_000
    # a fake warm-up step first (it probes)
    assert steps() == {(B01, "fake"): 1, (FRAG, "real"): 1, (four, "fake"): 2}


@pytest.mark.slow
@pytest.mark.parametrize(("budget", "steps"), [(678_000, 2), (672_000, 1), (600_000, 1)])
def test_a_first_step_a_little_over_budget_is_tracked_again_warm(
    counted: collections.Counter[tuple[str, str]], budget: int, steps: int,
) -> None:  # fmt: skip
    """fragments=2 (681 kB on the tiny GPT) is not estimated, so nothing but its first
    step speaks for it: 0.4% over at 678 kB it is tracked again, warm (2 steps), and that
    decides; 1.3% over at 672 kB and 13.5% at 600 kB, more than ``FIRST_STEP_MARGIN``, its
    first step decides alone (1)."""
    model, idx, loss_fn = _gpt()
    p = leangrad.plan(model, idx, loss_fn, budget=budget, repeats=1, engines=[ENGINES[4]])
    assert (p.table[0].peak_bytes > (1 + FIRST_STEP_MARGIN) * budget) is (steps == 1)  # type: ignore[operator]
    assert p.table[0].verdict == "over budget" and counted[(FRAG, "real")] == steps
    assert counted[(FRAG, "fake")] == 0


def test_an_engine_that_probes_but_estimates_cheaply_is_estimated_first(
    counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """``trace=True`` and ``segments="auto"`` do extra work on their first step
    (:attr:`~leangrad.engines.Engine.probes`), but a fake step of theirs costs what any
    other engine's does (not :attr:`~leangrad.engines.Engine.costly_estimate`): well over
    the budget on its estimate (a fake warm-up step, then the tracked one), such a candidate
    is never run for real; fragments still are."""
    model, idx, loss_fn = _gpt()
    engines = [("checkpoint", {"blocks": ["blocks.0"], "trace": True}),
               ("checkpoint", {"blocks": ["blocks.0"], "fragments": 2})]  # fmt: skip
    for name, opts in engines:
        eng = leangrad.engine(name, **opts)
        assert eng.probes and eng.costly_estimate is ("fragments" in opts)
    p = leangrad.plan(model, idx, loss_fn, budget=600_000, repeats=1, engines=engines)
    traced = "checkpoint(blocks=['blocks.0'],trace=True)"
    rows = {c.label: c for c in p.table}
    assert rows[traced].verdict == f"over budget ({ESTIMATED})" and rows[traced].estimate
    assert counted[(traced, "real")] == 0 and counted[(traced, "fake")] == 2
    assert rows[traced].peak_bytes == profile_step(leangrad.engine(*engines[0][:1],
        **engines[0][1]), model, idx, loss_fn, repeats=0).total_bytes  # fmt: skip
    fragged = "checkpoint(blocks=['blocks.0'],fragments=2)"
    # measured for real, its first step over by more than FIRST_STEP_MARGIN: one step
    assert rows[fragged].peak_bytes > (1 + FIRST_STEP_MARGIN) * 600_000  # type: ignore[operator]
    assert counted[(fragged, "real")] == 1 and counted[(fragged, "fake")] == 0


@pytest.mark.slow
def test_plan_reports_a_raced_out_row(monkeypatch: pytest.MonkeyPatch,
                                      counted: collections.Counter[tuple[str, str]],
                                      ) -> None:  # fmt: skip
    """The fragments at 1.6× the fastest in the race's round: one timed step, that round's
    time in its row, and a verdict that says why; printing and saving the plan keep it."""
    model, idx, loss_fn = _gpt()
    clock = Clock({"checkpoint": [1.0] * 3, FRAG: [1.6]})
    monkeypatch.setattr(planner, "time_interleaved", clock)
    p = leangrad.plan(model, idx, loss_fn, budget=900_000, repeats=3, engines=ENGINES)
    rows = {c.label: c for c in p.table}
    assert counted[(FRAG, "real")] == 1 + 1 and clock.timed(FRAG) == 1
    note = pc.RACED_OUT.format(ratio=1.6, rounds="one round")
    assert note == "raced out: 1.60× the fastest in one round"
    assert rows[FRAG].verdict == f"fits; {note}"
    assert rows[FRAG].seconds == 1.6 and note in str(p)
    assert p.engine is not None and p.engine.label == "checkpoint"


@pytest.mark.slow
def test_an_estimate_decides_nothing_where_it_counts_what_a_warm_step_does_not(
    counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """With an optimizer (its state is made on the first step, which the fake step counts
    and the warmed-up real one does not), every candidate is measured for real as
    before: no row is an estimate, and none is skipped."""
    model, idx, loss_fn = _gpt()
    p = leangrad.plan(model, idx, loss_fn, budget=900_000, repeats=1, engines=ENGINES[:2],
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))  # fmt: skip
    assert all(not c.estimate for c in p.table) and p.engine is None
    assert all(c.verdict == "over budget" for c in p.table)
    fake = {key: n for key, n in counted.items() if key[1] == "fake"}
    assert fake == {("backprop", "fake"): 1}  # only whether anything can be allocated here
    assert counted[("backprop", "real")] == counted[(B0, "real")] == 2 * 2  # 2 kinds, 2 steps


@pytest.mark.slow
def test_the_estimate_that_skips_a_candidate_is_the_real_trackers() -> None:
    """The shortcut rests on this: on the tiny GPT every candidate's fake-tensor estimate
    equals its real peak, fragments (which probe on their first step) included."""
    model, idx, loss_fn = _gpt()
    for name, opts in ENGINES:
        est = estimate_step(leangrad.engine(name, **opts), model, idx, loss_fn).total_bytes
        real = profile_step(leangrad.engine(name, **opts), model, idx, loss_fn, repeats=0)
        assert est == real.total_bytes, name


def test_nothing_fits_names_an_estimated_smallest_peak_as_one() -> None:
    """At 1 KiB every candidate is over on its estimate and none is run: the message's
    smallest peak is marked as an estimate (``~``), as the table marks it."""
    model, idx, loss_fn = _gpt()
    p = leangrad.plan(model, idx, loss_fn, budget=1024, repeats=1, engines=ENGINES[:4])
    assert p.engine is None and all(c.estimate for c in p.table)
    smallest = min(p.table, key=lambda c: c.peak_bytes or 0)
    assert p.message.startswith(f"nothing fits 1 KiB: the smallest peak found is ~"
                                f"{fmt_bytes(smallest.peak_bytes)} ({smallest.label})")
