"""``plan(within_budget=True)``: the plan itself stays within its budget, as planning inside
a run that has only that much must (:func:`leangrad.hf.attach`). No candidate runs whose
fake-tensor estimate is over the budget, and the exactness re-check steps
``loss.backward()`` on the largest slice of the batch whose step fits — which still
catches an engine that is wrong on this model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad.loss import per_example
from leangrad.measure import MemoryTracker, profile_step
from leangrad.planner._measure import UNESTIMATED
from test_plan_verify import _data, _Net

ENGINES = [("backprop", {}), ("checkpoint", {})]


def _plan_tracked(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  loss_fn: Callable[[torch.Tensor], torch.Tensor], **kw: object,
                  ) -> tuple[leangrad.Plan, int, int]:  # fmt: skip
    """The plan at 0.8 of backprop's peak, its budget, and the most bytes it held (the
    tracker's peak over the whole plan, model and batch included)."""
    full = profile_step(leangrad.engine("backprop"), model, x, loss_fn, repeats=0).total_bytes
    budget = int(0.8 * full)
    with MemoryTracker(baseline=(model, x, y)) as tracker:
        plan = leangrad.plan(model, x, loss_fn, budget=budget, repeats=1, engines=ENGINES,
                             **kw)  # type: ignore[arg-type]
    return plan, budget, tracker.report.baseline_bytes + tracker.report.peak_bytes


def _per_example(y: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return per_example(lambda out, t: F.cross_entropy(out, t), y)


def test_the_plan_holds_no_more_than_its_budget_and_checks_on_a_slice() -> None:
    model, x, y = _data(flip=False)
    plan, budget, held = _plan_tracked(model, x, y, _per_example(y), within_budget=True)
    assert plan.engine is not None and plan.engine.label == "checkpoint"
    assert held <= budget, (held, budget)
    assert "re-checked against loss.backward() on this model and the first 512 of the " \
        "batch's 1024 examples" in plan.message  # fmt: skip
    row = next(c for c in plan.table if c.label == "backprop")
    assert row.verdict == "over budget (estimate)"
    # the same plan without the option steps backprop for the re-check: over the budget
    plain, _, held_plain = _plan_tracked(model, x, y, _per_example(y))
    assert plain.engine is not None and plain.engine.label == "checkpoint"
    assert held_plain > budget


def test_the_check_on_a_slice_still_catches_a_wrong_engine() -> None:
    model, x, y = _data(flip=True)  # checkpointing's recomputation flips a sign here
    plan, budget, held = _plan_tracked(model, x, y, _per_example(y), within_budget=True)
    row = next(c for c in plan.table if c.label == "checkpoint")
    assert row.verdict.startswith("inexact: the gradient of blocks.0.lin.weight differs")
    assert plan.engine is None
    assert held <= budget


def test_a_loss_not_declared_per_example_is_not_checked_and_the_message_says_so() -> None:
    model, x, y = _data(flip=False)
    plan, budget, held = _plan_tracked(model, x, y, lambda o: F.cross_entropy(o, y),
                                       within_budget=True)  # fmt: skip
    assert plan.engine is not None and held <= budget
    assert "NOT re-checked against loss.backward(): its step on this batch" in plan.message
    assert "not declared per example (leangrad.loss.per_example)" in plan.message


class _ReadsValues(nn.Module):
    """A model whose forward reads a tensor's value: fake tensors cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _Net(depth=2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out * 2.0 if float(out.detach().sum()) > 0 else out


def test_a_candidate_fake_tensors_cannot_estimate_is_not_run() -> None:
    torch.manual_seed(0)
    model = _ReadsValues()
    x, y = torch.randn(64, 32, dtype=torch.float64), torch.randint(0, 2, (64,))
    plan = leangrad.plan(model, x, _per_example(y), budget=2**30, repeats=1, engines=ENGINES,
                         within_budget=True)  # fmt: skip
    assert plan.engine is None
    assert {c.verdict for c in plan.table} == {UNESTIMATED}


@pytest.mark.parametrize(("options", "match"), [
    ({"within_budget": "yes"}, "within_budget must be True or False"),
    ({"within_budget": True, "compile": True}, "within_budget must be False with compile=True"),
])  # fmt: skip
def test_bad_settings_raise(options: dict[str, object], match: str) -> None:
    model, x, y = _data(flip=False)
    with pytest.raises(ValueError, match=match):
        leangrad.plan(model, x, _per_example(y), budget=2**30,
                      **options)  # type: ignore[arg-type]
