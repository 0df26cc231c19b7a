"""``leangrad.plan`` when the fastest candidates are within timing noise of each other
: only the contenders are timed again, interleaved and longer, and a tie that
remains is broken by a stated rule (lower peak, simpler engine, the planner's order) that
the chosen row, the message and the table report. The clock is a fake: every timing here
is given, none is measured or asserted."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch

import leangrad
import leangrad.planner._choice as pc
import leangrad.planner._plan as planner
from leangrad import zoo
from leangrad.measure import Timing
from leangrad.planner._measure import Tried

Spread = tuple[float, float, float]  # median, minimum, maximum


def _t(median: float, low: float | None = None, high: float | None = None) -> Timing:
    return Timing(median, median if low is None else low, median if high is None else high,
                  None, 3)  # fmt: skip


class FakeTimer:
    """Stands in for ``time_interleaved``: each label's timed calls are answered, in order,
    by the next of its given seconds (``repeats`` of them a call: the median, fastest and
    slowest of those), whatever the calls' pattern; every call is recorded (labels in the
    order given, repeats, warm-up); nothing runs."""

    def __init__(self, seconds: Mapping[str, Sequence[float]]) -> None:
        self.seconds = {k: list(v) for k, v in seconds.items()}
        self.used: dict[str, int] = dict.fromkeys(seconds, 0)
        self.calls: list[tuple[list[str], int, int]] = []

    def __call__(self, fns: Mapping[str, Callable[[], object]], *, repeats: int,
                 warmup: int, **_: object) -> dict[str, Timing]:  # fmt: skip
        self.calls.append((list(fns), repeats, warmup))
        out = {}
        for k in fns:
            got = self.seconds[k][self.used[k]: self.used[k] + repeats]
            assert len(got) == repeats, f"{k}: no more seconds given"
            self.used[k] += repeats
            out[k] = Timing(statistics.median(got), min(got), max(got), None, repeats)
        return out


def rounds(first: Spread, then: float | None = None, *, again: int = 6) -> list[float]:
    """A label's seconds: the first round's three repeats (the race's first: the fastest of
    the three, so a race never drops a row the test meant to keep), then ``again`` rounds at
    ``then``."""
    median, low, high = first
    return [low, median, high] + ([] if then is None else [then] * again)


def _row(label: str, peak: int, *, name: str | None = None, per_layer: bool = False) -> Tried:
    return Tried(object(), label, True, peak, "fits", name or label, {}, per_layer)


def _choose(timer: FakeTimer, rows: list[Tried], *, repeats: int = 3,
            scaled: Mapping[str, float] | None = None):  # type: ignore[no-untyped-def]
    scaled = scaled or {}
    fitting = [r.label for r in rows if r.label not in scaled]  # timed here
    steps: dict[str, Callable[[], object]] = {lb: (lambda: None) for lb in fitting}
    if scaled:
        steps["backprop"] = lambda: None  # the reference only
    return pc.choose(steps, fitting=fitting, scaled=scaled, reference="backprop",
                  rows=rows, repeats=repeats, timer=timer)  # fmt: skip


def test_within_noise_is_overlapping_spreads_or_a_close_median() -> None:
    leader = _t(1.00, 0.95, 1.05)
    assert pc.within_noise(_t(1.20, 1.04, 1.30), leader)  # spreads overlap, medians 20% apart
    assert pc.within_noise(_t(1 + pc.CLOSE, 1 + pc.CLOSE, 1.2), leader)  # the margin, inclusive
    assert not pc.within_noise(_t(1.12, 1.06, 1.20), leader)  # neither
    assert not pc.within_noise(_t(1.12), _t(1.00))  # one repeat: no spread, the margin alone


def test_contenders_are_the_fastest_and_at_most_a_few_within_noise() -> None:
    timings = {"a": _t(1.30), "b": _t(1.00, 0.9, 1.1), "c": _t(1.05), "d": _t(1.08),
               "e": _t(1.09), "f": _t(1.50, 1.05, 1.6)}  # fmt: skip
    near = pc.contenders(timings)
    assert near == ["b", "c", "d"][:pc.MOST_CONTENDERS] and len(near) == pc.MOST_CONTENDERS
    assert pc.contenders({"a": _t(1.0), "b": _t(2.0)}) == ["a"]


def test_a_clear_first_round_is_not_timed_again() -> None:
    timer = FakeTimer({"backprop": rounds((1.00, 0.98, 1.02)),
                       "checkpoint": rounds((1.30, 1.25, 1.35))})  # fmt: skip
    got = _choose(timer, [_row("backprop", 300), _row("checkpoint", 100)])
    # the race's round, then the first round's other two, rotated; no warm-up, no 2nd round
    assert timer.calls == [(["backprop", "checkpoint"], 1, 0), (["checkpoint", "backprop"], 1, 0),
                           (["backprop", "checkpoint"], 1, 0)]  # fmt: skip
    assert got.label == "backprop" and got.contenders == () and got.tie_break is None
    assert got.seconds == {"backprop": 1.00, "checkpoint": 1.30} and got.raced == {}


def test_only_the_contenders_are_timed_again_and_the_longer_round_decides() -> None:
    """Medians 8% apart with overlapping spreads (the first round ranked them wrongly):
    the two are timed again, interleaved, one round a call and no warm-up (they have just
    run), until each has max(5, 2 * repeats) rounds, the first round's 4 included; the
    clearly slower third is not; the medians over all those rounds pick the winner."""
    timer = FakeTimer({"chunked_ce": [0.97, 1.08, 1.08, 1.20] + [0.99] * 4,
                       "checkpoint+chunked_ce": [0.96, 1.00, 1.00, 1.10] + [1.11] * 4,
                       "checkpoint": [1.25, 1.30, 1.30, 1.35]})  # fmt: skip
    rows = [_row("chunked_ce", 280), _row("checkpoint+chunked_ce", 110), _row("checkpoint", 50)]
    got = _choose(timer, rows, repeats=4)
    again = max(pc.RETIME_REPEATS, 2 * 4) - 4
    assert [(sorted(c[0]), c[1], c[2]) for c in timer.calls] == [
        (sorted(timer.seconds), 1, 0)] * 4 + [
        (["checkpoint+chunked_ce", "chunked_ce"], 1, 0)] * again  # fmt: skip
    assert got.label == "chunked_ce" and got.tie_break is None
    assert got.contenders == ("checkpoint+chunked_ce", "chunked_ce")
    assert got.seconds == {"chunked_ce": 0.99,  # median of the 8: 0.97, 0.99 x4, 1.08 ...
                           "checkpoint+chunked_ce": pytest.approx((1.10 + 1.11) / 2),
                           "checkpoint": 1.30}  # fmt: skip


@pytest.mark.parametrize(("rows", "chosen", "rule"), [
    ([_row("chunked_ce", 280), _row("checkpoint+chunked_ce", 110)],
     "checkpoint+chunked_ce", "lower peak"),
    ([_row("checkpoint+bits", 100), _row("bits", 100)], "bits", "simpler engine"),
    ([_row("sgd per layer", 100, name="backprop", per_layer=True),
      _row("checkpoint", 100)], "checkpoint", "simpler engine"),
    ([_row("checkpoint(blocks=['b.0'])", 100, name="checkpoint"),
      _row("checkpoint", 100)], "checkpoint(blocks=['b.0'])", "the planner's order"),
])  # fmt: skip
def test_a_tie_that_remains_is_broken_by_the_stated_rule(rows: list[Tried], chosen: str,
                                                         rule: str) -> None:  # fmt: skip
    a, b = (r.label for r in rows)
    second_a, second_b = 1.00, 1.00 + pc.TIE / 2  # still within TIE after the longer round
    timer = FakeTimer({a: rounds((1.00, 0.9, 1.1), second_a),
                       b: rounds((1.05, 0.95, 1.15), second_b)})  # fmt: skip
    got = _choose(timer, rows)
    assert rule in pc.RULES and len(timer.calls) == 3 + 3  # the first round's 3, 3 more
    other = b if chosen == a else a
    ratio = (second_b / second_a) if other == b else (second_a / second_b)
    assert got.label == chosen
    assert got.tie_break == pc.WITHIN_NOISE.format(others=f"{other} ({ratio:.2f}×)", rule=rule)
    assert got.tie_break == f"within noise of {other} ({ratio:.2f}×): chose by {rule}"


def test_the_fastest_wins_outside_the_tie_margin_whatever_its_peak() -> None:
    timer = FakeTimer({"a": rounds((1.00, 0.9, 1.1), 1.00),
                       "b": rounds((1.02, 0.95, 1.15), 1.00 + 2 * pc.TIE)})  # fmt: skip
    got = _choose(timer, [_row("a", 900), _row("b", 100)])
    assert got.label == "a" and got.tie_break is None and got.contenders == ("a", "b")


def test_a_compiled_contender_is_rescaled_from_backprop_timed_beside_it() -> None:
    """A compiled row is not timed here: it contends with its ratio times backprop's
    timing, and backprop (here only the reference) is timed again beside the others."""
    rows = [_row("checkpoint", 100), _row("compile", 90)]
    timer = FakeTimer({"backprop": rounds((1.00, 0.9, 1.1), 1.20),
                       "checkpoint": rounds((0.82, 0.8, 0.84), 0.84)})  # fmt: skip
    got = _choose(timer, rows, scaled={"compile": 0.80})
    assert sorted(timer.calls[-1][0]) == ["backprop", "checkpoint"]  # the reference, not "compile"
    assert len(timer.calls) == 3 + 3
    backprop = (1.10 + 1.20) / 2  # the median of its 6 rounds: 0.9, 1.0, 1.1, 1.2 x3
    assert got.seconds["compile"] == pytest.approx(0.80 * backprop)
    assert "backprop" not in got.seconds  # only the reference: not a candidate
    assert got.label == "checkpoint" and got.tie_break is None


def _gpt():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = zoo.gpt(vocab=32, dim=32, layers=2, heads=2, context=16)
    idx = torch.randint(0, 32, (2, 16))
    tgt = torch.randint(0, 32, (2, 16))
    return model, idx, lambda out: zoo.GPT.loss(out, tgt)


@pytest.mark.slow
def test_plan_reports_the_tie_break_in_row_message_table_and_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:  # fmt: skip
    """Through ``leangrad.plan``: backprop and checkpoint stay within noise when timed
    again; checkpoint's lower peak decides, and the plan says so everywhere."""
    model, idx, loss_fn = _gpt()
    third = "checkpoint(blocks=['blocks.0'])"
    timer = FakeTimer({"backprop": [0.95, 1.05] + [1.00] * 5,  # repeats=2: medians 1.00,
                       "checkpoint": [1.04, 1.12] + [1.03] * 5,  # 1.08 (spreads overlap)
                       third: [1.40, 1.60]})  # fmt: skip
    monkeypatch.setattr(planner, "time_interleaved", timer)
    p = leangrad.plan(model, idx, loss_fn, budget=2**30, repeats=2,
                      engines=[("backprop", {}), ("checkpoint", {}),
                               ("checkpoint", {"blocks": ["blocks.0"]})])  # fmt: skip
    everyone = sorted(["backprop", "checkpoint", third])  # the race, then one more round
    assert [sorted(c[0]) for c in timer.calls] == [everyone] * 2 + [["backprop", "checkpoint"]] * 3
    rows = {c.label: c for c in p.table}
    assert rows["checkpoint"].peak_bytes < rows["backprop"].peak_bytes  # type: ignore[operator]
    note = "within noise of backprop (0.97×): chose by lower peak"
    assert p.engine is not None and p.engine.label == "checkpoint" and p.seconds == 1.03
    assert p.chosen is rows["checkpoint"] and p.tie_break == note
    assert rows["checkpoint"].verdict == "chosen" and rows["checkpoint"].tie_break == note
    assert rows["backprop"].tie_break is None and rows[third].seconds == 1.50
    assert f"s/step; {note}" in p.message  # then the re-check's note
    assert f"chosen — {note}" in str(p)
    path = p.save(tmp_path / "plan.json")
    assert leangrad.Plan.load(path).tie_break == note


def test_a_plan_without_a_tie_says_nothing_of_one(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:  # fmt: skip
    model, idx, loss_fn = _gpt()
    timer = FakeTimer({"backprop": [1.00], "checkpoint": [1.40]})
    monkeypatch.setattr(planner, "time_interleaved", timer)
    p = leangrad.plan(model, idx, loss_fn, budget=2**30, repeats=1,
                      engines=[("backprop", {}), ("checkpoint", {})])  # fmt: skip
    assert len(timer.calls) == 1 and p.engine is not None and p.engine.label == "backprop"
    assert p.tie_break is None and "within noise" not in str(p)
    doc = json.loads(p.save(tmp_path / "plan.json").read_text())
    assert all("tie_break" not in row for row in doc["table"])  # the files of before
