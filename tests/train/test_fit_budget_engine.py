"""``fit(budget=...)`` trains with the engine object the plan measured, deep-copying the
model at most once, and :attr:`leangrad.Plan.chosen` is the chosen row whatever
its verdict says ("chosen", "chosen (estimate)")."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
import leangrad.planner._plan
from leangrad import train
from leangrad.train import _fit
from train_cases import SMALL, assert_equal, weights

KW: dict[str, Any] = {**SMALL, "max_steps": 3, "optimizer": "sgd", "lr": 0.1}


def _spy(monkeypatch: pytest.MonkeyPatch) -> tuple[list[leangrad.Plan], list[Any], list[int]]:
    """Record the plans made, the engine each run trained with, and how many whole models
    were deep-copied (a top-level ``copy.deepcopy`` of a module with parameters; the
    engines' prepared copies pass a memo holding the model's tensors and are not counted)."""
    plans: list[leangrad.Plan] = []
    engines: list[Any] = []
    copies = [0]
    real_plan, real_init = leangrad.planner._plan.plan, _fit._Run.__init__
    real_deepcopy = copy.deepcopy

    def plan(*args: Any, **kwargs: Any) -> leangrad.Plan:
        plans.append(real_plan(*args, **kwargs))
        return plans[-1]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        engines.append(self.engine)

    def deepcopy(x: Any, memo: dict[int, Any] | None = None, _nil: Any = None) -> Any:
        if memo is None and isinstance(x, nn.Module) and any(True for _ in x.parameters()):
            copies[0] += 1
        return real_deepcopy(x, memo)

    monkeypatch.setattr(leangrad.planner._plan, "plan", plan)
    monkeypatch.setattr(_fit._Run, "__init__", init)
    monkeypatch.setattr(copy, "deepcopy", deepcopy)
    return plans, engines, copies


def test_budget_trains_the_measured_engine_and_copies_the_model_at_most_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plans, engines, copies = _spy(monkeypatch)
    res = train.fit("mlp", budget="1GiB", plan_engines=["checkpoint"], **KW)
    monkeypatch.undo()
    assert copies[0] <= 1, f"train --budget deep-copied the model {copies[0]} times"
    [p], [eng] = plans, engines
    assert p.chosen is not None and p.chosen.engine is p.engine
    assert eng is p.engine  # the very object measured, not one rebuilt by name
    assert (res.config.engine, res.config.engine_options) == (p.chosen.name, p.chosen.options)
    # its prepared copies were the plan's model's: the run's model gets its own, so the
    # weights are bit-equal to a run with an engine built by name
    again = train.fit("mlp", engine=p.chosen.name, engine_options=p.chosen.options,
                      step_per_layer=res.config.step_per_layer, **KW)  # fmt: skip
    assert_equal(weights(res.model), weights(again.model))
    assert res.steps == again.steps == 3


def test_a_per_layer_plan_gives_its_saving_without_measuring_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A budget only the per-layer step fits: the run's gradient-memory saving is the
    plan's two rows (no second measurement on two more deep copies), and equals what
    :func:`leangrad.train.measure_grad_memory` measures on its own copies."""
    plans, _, _ = _spy(monkeypatch)
    train.fit("mlp", budget="1GiB", plan_engines=["backprop"], **KW)
    rows = {c.per_layer: c.peak_bytes for c in plans[0].table}
    assert rows[True] is not None and rows[False] is not None and rows[True] < rows[False]
    monkeypatch.undo()
    plans, _, copies = _spy(monkeypatch)
    res = train.fit("mlp", budget=(rows[True] + rows[False]) // 2, plan_engines=["backprop"],
                    **KW)  # fmt: skip
    monkeypatch.undo()
    assert copies[0] <= 1, f"train --budget deep-copied the model {copies[0]} times"
    assert res.config.step_per_layer and plans[0].per_layer
    mem = res.grad_memory
    assert mem is not None and mem.saving_bytes == rows[False] - rows[True] > 0
    ds = train.load_data(KW["data"], **KW["data_options"])
    x, y = ds.x[: KW["batch_size"]], ds.y[: KW["batch_size"]]
    again = train.measure_grad_memory(res.model, leangrad.engine("backprop"), x,
                                      lambda out: F.cross_entropy(out, y),
                                      lambda ps: torch.optim.SGD(ps, lr=0.1))  # fmt: skip
    assert (mem.full_peak_bytes, mem.per_layer_peak_bytes, mem.grad_bytes) == (
        again.full_peak_bytes, again.per_layer_peak_bytes, again.grad_bytes)


def test_fit_with_a_plan_object_trains_its_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    model = leangrad.models.mlp(64, 16, 1, 10)
    ds = train.load_data("synthetic", n=160)
    x, y = ds.x[:32], ds.y[:32]
    p = leangrad.plan(model, x, lambda out: F.cross_entropy(out, y), budget=1 << 30,
                      engines=[("backprop", {}), ("checkpoint", {})], repeats=1)  # fmt: skip
    _, engines, _ = _spy(monkeypatch)
    rest = {k: v for k, v in KW.items() if k not in ("data", "data_options")}
    train.fit(model, ds, plan=p, **rest)
    assert p.chosen is not None and engines == [p.engine]


def _tiny() -> tuple[nn.Module, torch.Tensor, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))  # fmt: skip
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    return model, x, lambda out: F.cross_entropy(out, y)


def test_chosen_is_the_row_carrying_the_measured_engine_estimate_or_not(tmp_path: Path) -> None:
    model, x, loss_fn = _tiny()
    engines = [("backprop", {}), ("checkpoint", {})]
    for limit in (None, 0):  # 0: nothing may be allocated, every peak is an estimate
        p = leangrad.plan(model, x, loss_fn, budget=1 << 30, engines=engines, repeats=1,
                          allocate_limit=limit)  # fmt: skip
        row = p.chosen
        assert row is not None and row.engine is p.engine and row.engine is not None
        assert [c for c in p.table if c is row] == [row]  # one of the table's rows
        assert row.verdict == ("chosen" if limit is None else "chosen (estimate)")
        assert row.estimate is (limit == 0) and p.estimate is (limit == 0)
        back = leangrad.Plan.load(p.save(tmp_path / "plan.json"), model=model, inputs=x)
        assert back.chosen is not None and back.chosen.engine is back.engine
        assert back.chosen == row and back.table == p.table  # the engine is not compared
        assert back.engine is not None and back.engine.label == row.engine.label
    nothing = leangrad.plan(model, x, loss_fn, budget=1, engines=engines, repeats=1)
    assert nothing.chosen is None and nothing.engine is None


def test_a_chosen_row_must_carry_the_plans_engine() -> None:
    row = leangrad.planner._plan.Candidate("backprop", True, 10, 0.1, "chosen", "backprop", {})
    eng = leangrad.engine("backprop")
    with pytest.raises(ValueError, match="must carry the plan's engine"):
        leangrad.Plan(eng, 10, 0.1, True, 100, (row,), "chosen: backprop", chosen=row)
    built = leangrad.Plan(eng, 10, 0.1, True, 100, (row,), "chosen: backprop")
    assert built.chosen is not None and built.chosen.engine is eng  # by hand: its verdict
    assert built.table[0] is built.chosen
