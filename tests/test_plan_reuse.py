"""``leangrad.plan(..., reuse=earlier_plan)``: a plan of the same step at another budget
takes the earlier plan's peaks and warm engines (item 6: the zoo plans each model
at ½, ¼ and ⅛ of backprop's peak, and stepped every candidate three times). Its rows are
the rows a fresh plan at that budget makes; only a row the new budget could judge
differently is stepped again. Counted, never timed (``tests/test_plan_racing.py``'s fake
clock and step counter)."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import leangrad
import leangrad.planner._measure as measuring
import leangrad.planner._plan as planner
from leangrad.planner._measure import ESTIMATE_MARGIN, ESTIMATED, FIRST_STEP_MARGIN, Tried
from test_plan_racing import B0, B01, ENGINES, FRAG, Clock, _gpt


def _real(steps: collections.Counter[tuple[str, str]]) -> dict[str, int]:
    return {lb: n for (lb, kind), n in steps.items() if kind == "real"}


def _steps(expected: dict[str, int]) -> dict[str, int]:
    """``expected`` without the engines it expects no step of."""
    return {lb: n for lb, n in expected.items() if n}


def _rows(p: leangrad.Plan) -> dict[str, tuple[str, int | None]]:
    """Each row's verdict and peak; a row an estimate screened out reads as over budget
    (where the earlier plan measured it, the reusing plan keeps that measurement: on the
    tiny GPT every estimate is the real peak, ``tests/test_plan_racing.py``)."""
    return {c.label: (c.verdict.removesuffix(f" ({ESTIMATED})"), c.peak_bytes)
            for c in p.table}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("budget", "again_steps", "fresh_steps"),
                         [(768_000, 1, 2), (720_000, 0, 0)])  # fmt: skip
def test_a_lower_budget_reuses_every_peak_and_steps_only_what_it_judges_anew(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
    budget: int, again_steps: int, fresh_steps: int,
) -> None:  # fmt: skip
    """At 900 kB the tiny GPT's checkpoint (770 kB) and fragments=2 (681 kB) fit on their
    first steps. At 768 kB, reusing that plan, checkpoint's first-step peak no longer fits,
    so it alone is tracked again (warm, one step); at 720 kB it is over by more than
    :data:`~leangrad.planner._measure.FIRST_STEP_MARGIN` and decides alone (no step).
    fragments=2 is timed without a peak measurement of its own. The rows, peaks and choice
    are those of a fresh plan at that budget, which measures fragments=2's peak again and
    checkpoint's in two steps at 768 kB (0.3% over, its estimate too), at 720 kB (7% over)
    not at all (its estimate is over by more than the estimate's margin)."""
    model, idx, loss_fn = _gpt()
    monkeypatch.setattr(planner, "time_interleaved",
                        Clock({"checkpoint": [1.0] * 3, FRAG: [1.2] * 3}))  # fmt: skip
    first = leangrad.plan(model, idx, loss_fn, budget=900_000, repeats=3, engines=ENGINES)
    assert first.engine is not None and first.engine.label == "checkpoint"
    assert (1 + FIRST_STEP_MARGIN) * budget < 770_056 or again_steps
    counted.clear()
    monkeypatch.setattr(planner, "time_interleaved", Clock({FRAG: [1.2] * 3}))
    again = leangrad.plan(model, idx, loss_fn, budget=budget, repeats=3, engines=ENGINES,
                          reuse=first)  # fmt: skip
    # checkpoint: tracked once more (warm) or not; fragments=2: timed (3), re-measured (1)
    assert _real(counted) == _steps({"checkpoint": again_steps, FRAG: 3 + 1})
    # the one fake step: backprop's, asking whether a step can be allocated here at all
    assert {lb: n for (lb, kind), n in counted.items() if kind == "fake"} == {"backprop": 1}
    assert again.engine is not None and again.engine.label == FRAG
    assert again.engine is first.measured.rows[f"checkpoint {ENGINES[4][1]!r}"][0].engine  # type: ignore[union-attr]
    counted.clear()
    monkeypatch.setattr(planner, "time_interleaved", Clock({FRAG: [1.2] * 3}))
    fresh = leangrad.plan(model, idx, loss_fn, budget=budget, repeats=3, engines=ENGINES)
    # its peak, timed, re-measured as chosen
    assert _real(counted) == _steps({"checkpoint": fresh_steps, FRAG: 1 + 3 + 1})
    assert _rows(again) == _rows(fresh)
    assert fresh.engine is not None and fresh.engine.label == FRAG
    assert _rows(again)["checkpoint"][0] == "over budget"


@pytest.mark.slow
def test_a_higher_budget_measures_the_rows_its_estimate_no_longer_rules_out(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """At 700 kB backprop (1.51 MB), blocks.0 (1.23 MB), blocks.0-1 (948 kB) and
    checkpoint (770 kB) are over by more than the margin on their estimates and never run.
    At 1.3 MB, reusing that plan, backprop still is (above 1.43 MB) and stays unrun; the
    others are measured now, as a fresh plan measures them, and fit."""
    model, idx, loss_fn = _gpt()
    monkeypatch.setattr(planner, "time_interleaved", Clock({FRAG: [1.2] * 3}))
    low = leangrad.plan(model, idx, loss_fn, budget=700_000, repeats=3, engines=ENGINES)
    screened = {c.label for c in low.table if c.verdict == f"over budget ({ESTIMATED})"}
    assert screened == {"backprop", B0, B01, "checkpoint"}
    counted.clear()
    seconds = {B0: [0.9] * 3, B01: [1.0] * 3, "checkpoint": [1.1] * 3, FRAG: [1.2] * 3}
    monkeypatch.setattr(planner, "time_interleaved", Clock(seconds))
    high = leangrad.plan(model, idx, loss_fn, budget=1_300_000, repeats=3, engines=ENGINES,
                         reuse=low)  # fmt: skip
    rows, table = _rows(high), {c.label: c for c in high.table}
    assert table["backprop"].verdict == f"over budget ({ESTIMATED})"
    assert rows["backprop"][1] > (1 + ESTIMATE_MARGIN) * 1_300_000  # type: ignore[operator]
    assert counted[("backprop", "real")] == 0
    assert counted[(B0, "real")] >= 1 and rows[B0][0].startswith("chosen")
    assert rows[B01][0] == rows["checkpoint"][0] == "fits"
    assert not table[B01].estimate and counted[("checkpoint", "real")] >= 1
    monkeypatch.setattr(planner, "time_interleaved", Clock(seconds))
    fresh = leangrad.plan(model, idx, loss_fn, budget=1_300_000, repeats=3, engines=ENGINES)
    assert rows == _rows(fresh)


def test_reuse_refuses_a_plan_of_another_step(tmp_path) -> None:
    """Another model, other inputs, other settings, or a plan without measurements (loaded
    from a file): a ValueError naming which, and what to do."""
    model, idx, loss_fn = _gpt()
    first = leangrad.plan(model, idx, loss_fn, budget=10**9, repeats=1, engines=ENGINES[:1])
    other, other_idx, _ = _gpt()
    for kwargs, why in (
        ({"model": other}, "another model or other inputs"),
        ({"idx": other_idx.clone()}, "another model or other inputs"),
        ({"exact": False}, "other settings"),
        ({"engines": ENGINES[:2]}, "other settings"),
        ({"optimizer": lambda ps: torch.optim.SGD(ps, lr=0.1)}, "other settings"),
    ):
        args = {"model": model, "idx": idx, "exact": True, "engines": ENGINES[:1], **kwargs}
        with pytest.raises(ValueError, match=f"{why}.*plan without reuse="):
            leangrad.plan(args.pop("model"), args.pop("idx"), loss_fn, budget=10**9,
                          repeats=1, reuse=first, **args)  # fmt: skip
    loaded = leangrad.Plan.load(first.save(tmp_path / "p.json"))
    with pytest.raises(ValueError, match="has no measurements"):
        leangrad.plan(model, idx, loss_fn, budget=10**9, engines=ENGINES[:1], reuse=loaded)


def test_reuse_with_an_optimizer_steps_the_same_copy_and_leaves_the_users_model() -> None:
    """With an optimizer the plan steps a copy; the reusing plan steps that same copy, and
    the user's parameters, gradients and buffers are as they were."""
    model, idx, loss_fn = _gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    make = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    first = leangrad.plan(model, idx, loss_fn, budget=10**9, repeats=1, engines=ENGINES[:2],
                          optimizer=make)  # fmt: skip
    again = leangrad.plan(model, idx, loss_fn, budget=10**8, repeats=1, engines=ENGINES[:2],
                          optimizer=make, reuse=first)  # fmt: skip
    assert first.measured is not None and again.measured is not None
    assert again.measured.model is first.measured.model is not model
    assert len(again.table) == 4 and again.engine is not None  # two candidates, two kinds
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_compiled_row_is_judged_anew_by_its_fresh_process_peak() -> None:
    """A compiled row (measured in a fresh process, its verdict naming the peak's source)
    keeps its peak and source and is judged against the new budget; a failed row and an
    n/a row stay as they were."""
    model, idx, loss_fn = _gpt()
    ctx = measuring.Context(model, (idx,), loss_fn, 1000, True, None, None, False)
    rows = [Tried(object(), "compile", True, 1500, "fits (RSS-scaled)", "compile", {},
                  compile_seconds=20.0, time_ratio=0.9),
            Tried(None, "fad", True, None, "n/a: changes nothing", "fad", {}),
            Tried(None, "x", True, None, "failed: RuntimeError: boom", "x", {})]  # fmt: skip
    tried: list[Tried] = []
    measuring.revisit(rows, ctx, tried)
    assert [t.verdict for t in tried] == ["over budget (RSS-scaled)",
                                          *[t.verdict for t in rows[1:]]]  # fmt: skip
    assert tried[0].peak == 1500 and tried[0].compile_seconds == 20.0
    tried.clear()
    measuring.revisit(rows[:1], dataclasses.replace(ctx, budget=2000), tried)
    assert tried[0].verdict == "fits (RSS-scaled)"


@pytest.mark.slow
def test_a_lower_budget_where_the_earlier_choice_still_fits_keeps_its_timing(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """At 900 kB checkpoint (770 kB) was timed fastest against fragments=2 (681 kB); at
    800 kB it still fits, and every row that fits there fitted 900 kB and was timed against
    it: nothing is timed again, the choice and its seconds stand, and only its peak is
    re-measured (the plan's last step)."""
    model, idx, loss_fn = _gpt()
    monkeypatch.setattr(planner, "time_interleaved",
                        Clock({"checkpoint": [1.0] * 3, FRAG: [1.2] * 3}))  # fmt: skip
    first = leangrad.plan(model, idx, loss_fn, budget=900_000, repeats=3, engines=ENGINES)
    counted.clear()
    clock = Clock({})
    monkeypatch.setattr(planner, "time_interleaved", clock)
    again = leangrad.plan(model, idx, loss_fn, budget=800_000, repeats=3, engines=ENGINES,
                          reuse=first)  # fmt: skip
    assert clock.calls == [] and _real(counted) == {"checkpoint": 1}
    assert again.engine is first.engine and again.seconds == first.seconds == 1.0
    rows = {c.label: c for c in again.table}
    assert rows[FRAG].seconds == 1.2 and rows[FRAG].verdict == "fits"
    assert rows["checkpoint"].verdict.startswith("chosen")
