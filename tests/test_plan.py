"""``leangrad.measure.profile_step`` and ``leangrad.plan``: what a step costs, and the
fastest engine that fits a budget. Behaviour by bytes (the tracker), never by time."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

import leangrad
from leangrad import zoo
from leangrad.measure import MemoryTracker, grads_of, profile_step
from leangrad.planner._plan import BAD_BUDGET, candidates
from leangrad_bench._report import fmt_bytes


def _gpt():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = zoo.gpt(vocab=32, dim=32, layers=4, heads=2, context=32)  # > 20k parameters
    idx = torch.randint(0, 32, (4, 32))
    tgt = torch.randint(0, 32, (4, 32))
    return model, idx, lambda out: zoo.GPT.loss(out, tgt)


def _bn_mlp():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(8, 3))  # fmt: skip
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    return model, x, lambda out: F.cross_entropy(out, y)


def test_profile_step_leaves_no_trace() -> None:
    model, x, loss_fn = _bn_mlp()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = copy.deepcopy(model)
    rng = torch.get_rng_state()
    prof = profile_step(leangrad.engine("checkpoint"), model, x, loss_fn, repeats=2)
    assert prof.engine == "checkpoint" and prof.seconds is not None and prof.seconds > 0
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert all(p.grad is None for p in list(model.parameters())[1:])
    for b, r in zip(model.buffers(), before.buffers(), strict=True):
        assert torch.equal(b, r)
    assert torch.equal(torch.get_rng_state(), rng)


def test_profile_step_peak_is_the_trackers_and_compares_gradients() -> None:
    model, idx, loss_fn = _gpt()
    ref_model = copy.deepcopy(model)
    loss_fn(ref_model(idx)).backward()
    ref = grads_of(ref_model)
    prof = profile_step(leangrad.engine("backprop"), model, idx, loss_fn, repeats=0,
                        reference=ref)  # fmt: skip
    with MemoryTracker(baseline=(model, idx)) as tracker:
        loss_fn(model(idx)).backward()
    model.zero_grad(set_to_none=True)
    assert prof.peak_bytes == tracker.report.peak_bytes
    assert prof.seconds is None
    assert prof.grad_max_rel_err == 0.0 and prof.grad_cosine == pytest.approx(1.0)
    assert prof.kept_bytes is not None and 0 < prof.kept_bytes <= prof.peak_bytes


@pytest.mark.slow
def test_plan_fits_half_of_backprops_step_memory_exactly() -> None:
    model, idx, loss_fn = _gpt()
    prof = profile_step(leangrad.engine("backprop"), model, idx, loss_fn, repeats=0)
    full = prof.total_bytes
    assert full == prof.baseline_bytes + prof.peak_bytes and prof.baseline_bytes > 0
    budget = prof.baseline_bytes + prof.peak_bytes // 2  # half of what the step allocates
    p = leangrad.plan(model, idx, loss_fn, budget=budget, repeats=1)
    assert p.engine is not None and p.exact
    assert p.peak_bytes is not None and p.peak_bytes <= budget < full
    assert p.remeasured_peak_bytes is not None
    assert abs(p.remeasured_peak_bytes - p.peak_bytes) <= 0.05 * p.peak_bytes  # predicted
    rows = {c.label: c for c in p.table}
    # twice the budget on its fake-tensor estimate: not run (test_plan_racing.py)
    assert rows["backprop"].verdict == "over budget (estimate)"
    assert rows["backprop"].peak_bytes == full  # the estimate is the tracker's peak
    assert sum(c.verdict == "chosen" for c in p.table) == 1
    assert "chosen: " in str(p) and "backprop" in str(p)
    # the plan's engine is an engine: exact gradients on the user's model
    ref_model = copy.deepcopy(model)
    loss_fn(ref_model(idx)).backward()
    p.engine.backward(model, idx, loss_fn)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_plan_says_when_nothing_fits_and_names_the_smallest_peak() -> None:
    model, idx, loss_fn = _gpt()
    p = leangrad.plan(model, idx, loss_fn, budget=1024, repeats=1)
    assert p.engine is None and p.peak_bytes is None
    smallest = min(c.peak_bytes for c in p.table if c.peak_bytes is not None)
    assert p.message.startswith("nothing fits 1 KiB: the smallest peak found is")
    assert fmt_bytes(smallest) in p.message
    assert all(c.verdict in ("over budget", "over budget (estimate)")
               or c.verdict.startswith("n/a") for c in p.table)  # fmt: skip


def test_plan_adds_estimators_only_when_asked() -> None:
    model, _, _ = _gpt()
    exact = {n for n, _ in candidates(model, exact=True)}
    inexact = {n for n, _ in candidates(model, exact=False)}
    assert "rad" not in exact and "rad" in inexact
    assert {"backprop", "checkpoint", "fad", "checkpoint+fad"} <= exact


@pytest.mark.slow
def test_plan_on_a_chain_tries_moonwalk() -> None:
    torch.manual_seed(0)
    model = leangrad.models.submersive_cnn(2, 3, depth=2, classes=3)
    x, y = torch.randn(4, 2, 8, 8), torch.randint(0, 3, (4,))
    p = leangrad.plan(model, x, lambda out: F.cross_entropy(out, y), budget=2**30, repeats=1)
    labels = [c.label for c in p.table]
    assert "moonwalk" in labels and p.engine is not None


@pytest.mark.parametrize("budget", [0, -5, 1.5, True, "1GiB"])
def test_plan_refuses_a_bad_budget(budget: object) -> None:
    model, idx, loss_fn = _gpt()
    with pytest.raises(ValueError, match=re.escape(BAD_BUDGET.format(value=budget))):
        leangrad.plan(model, idx, loss_fn, budget=budget)  # type: ignore[arg-type]


@pytest.mark.slow
def test_fit_with_a_budget_trains_with_the_planned_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    res = leangrad.train.fit("mlp", "digits", budget="64MiB", max_steps=3, progress=True,
                             plots=False)  # fmt: skip
    out = capsys.readouterr().out
    assert "chosen: " in out and res.steps == 3
    assert res.config.engine in leangrad.available() or "+" in res.config.engine


@pytest.mark.slow
def test_fit_with_a_budget_nothing_fits_or_engine_options_given() -> None:
    with pytest.raises(leangrad.EngineInputError, match="nothing fits 1 KiB"):
        leangrad.train.fit("mlp", "digits", budget=1024, max_steps=1, progress=False,
                           plots=False)  # fmt: skip
    with pytest.raises(leangrad.EngineInputError, match="budget= chooses the engine"):
        leangrad.train.fit("mlp", "digits", budget="64MiB", engine_options={"segments": 2},
                           max_steps=1, progress=False, plots=False)  # fmt: skip


@pytest.mark.slow
def test_plan_suite_runs_side_by_side_and_renders(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The plan suite on tiny models: per budget a leangrad, a PyTorch-eager and a
    torch.compile row, each within the budget when it fits; the smallest peak per side; the
    plan's prediction beside its fresh-process RSS; a report that says what it omits."""
    import json

    from leangrad_bench import run_suite
    from leangrad_bench._plan_suite import NOT_MEASURED, render

    suite = tmp_path / "tiny-plan.toml"
    suite.write_text(
        'runner = "leangrad_bench._plan_suite:run_plan_suite"\n'
        "[settings]\nrepeats = 1\nfractions = [0.75, 0.35]\nsegments = [2]\n"
        "compile_budgets = [1.0]\n"
        "[settings.models]\n"
        # > 20k parameters each, so the planner's last resort (forward) is not tried
        "mlp = { features = 8, width = 128, layers = 3, batch = 64 }\n"
    )
    records = json.loads(run_suite(str(suite), out=tmp_path, quick=True,
                                   progress=False).read_text())  # fmt: skip
    sides = ("leangrad", "pytorch", "compile")
    assert {(r["series"], r["sweep"], r["x"], r["engine"]) for r in records} == {
        ("mlp", "fraction", f, side) for f in (0.75, 0.35) for side in sides
    } | {("mlp", "smallest", None, side) for side in sides}
    for r in records:
        if r["sweep"] == "fraction" and r["fits"]:
            assert r["baseline_bytes"] + r["peak_bytes"] <= r["budget_bytes"] * 1.01
            assert r["time_vs_backprop"] > 0
        if r["engine"] == "leangrad" and r["sweep"] == "fraction" and r["fits"]:
            assert r["remeasured_bytes"] == r["predicted_bytes"]  # the tracker is exact
            assert r["rss_bytes"] > 0 and r["rss_backprop_bytes"] > 0
    small = {r["engine"]: r for r in records if r["sweep"] == "smallest"}
    assert all(s["peak_bytes"] > 0 and s["choice"] for s in small.values())
    text = "\n".join(render("tiny-plan", records, tmp_path))
    assert NOT_MEASURED in text and "| torch.compile | RSS peak |" in text
    assert "Smallest step peak each side reaches" in text


def _deep_mlp():  # type: ignore[no-untyped-def]
    """Wide enough that checkpointing leaves gradients as the largest part of the peak."""
    torch.manual_seed(0)
    w = 64
    layers = [torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU()) for _ in range(6)]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(w, 3))
    x, y = torch.randn(16, w), torch.randint(0, 3, (16,))
    return model, x, lambda out: F.cross_entropy(out, y)


def _sgd(ps):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


@pytest.mark.slow
def test_plan_with_an_optimizer_steps_per_layer_below_every_full_step() -> None:
    """Per-layer steps free each gradient once used: the plan reaches a budget no
    candidate with the optimizer stepped after backward fits, and leaves the user's model,
    gradients and parameters as they were (the steps ran on a copy)."""
    model, x, loss_fn = _deep_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    probe = leangrad.plan(model, x, loss_fn, budget=2**40, optimizer=_sgd, repeats=1)
    full = [c for c in probe.table if not c.per_layer and c.peak_bytes is not None]
    per_layer = [c for c in probe.table if c.per_layer and c.peak_bytes is not None]
    assert len(full) == len(per_layer) > 0
    assert all(c.label.endswith(", step per layer") for c in per_layer)
    budget = min(c.peak_bytes for c in full) - 1  # type: ignore[type-var]
    assert min(c.peak_bytes for c in per_layer) <= budget  # type: ignore[type-var, operator]
    p = leangrad.plan(model, x, loss_fn, budget=budget, optimizer=_sgd, repeats=1)
    assert p.engine is not None and p.per_layer and p.exact
    assert p.peak_bytes is not None and p.peak_bytes <= budget
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b) and b.grad is None
    # following Plan.per_layer's recipe trains exactly like backward + optimizer.step()
    ref = copy.deepcopy(model)
    opt = _sgd(list(ref.parameters()))
    plo = leangrad.train.PerLayerOptimizer(dict(model.named_parameters()), _sgd)
    for _ in range(2):
        loss_fn(ref(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        p.engine.backward(model, x, loss_fn, on_grad=plo.on_grad)
        plo.finish()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert a.grad is None


def test_plan_with_an_optimizer_refuses_a_model_it_cannot_copy() -> None:
    model, x, loss_fn = _deep_mlp()

    class NoCopy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.inner(h)

        def __deepcopy__(self, memo: dict) -> NoCopy:  # type: ignore[type-arg]
            raise TypeError("holds a file handle")

    with pytest.raises(leangrad.LeangradError, match=r"cannot be copied \(holds a file handle\)"):
        leangrad.plan(NoCopy(), x, loss_fn, budget=2**40, optimizer=_sgd)


class _Breaks(leangrad.engines.Engine):
    """A candidate that fails with a non-leangrad error (a model it cannot handle)."""

    name = "_plan_test_breaks"

    def _backward(self, model, inputs, loss_fn, params, on_grad):  # type: ignore[no-untyped-def]
        raise TypeError("forward() got an unexpected keyword argument 'attention_mask'")


def test_plan_records_a_failing_candidate_and_goes_on() -> None:
    model, x, loss_fn = _bn_mlp()
    leangrad.engines.register(_Breaks.name)(_Breaks)
    try:
        plan = leangrad.plan(model, x, loss_fn, budget=2**30, repeats=1,
                             engines=[(_Breaks.name, {}), ("backprop", {})])  # fmt: skip
    finally:
        from leangrad.engines._registry import _REGISTRY

        del _REGISTRY[_Breaks.name]
    rows = {c.label: c for c in plan.table}
    assert rows[_Breaks.name].verdict == (
        "failed: TypeError: forward() got an unexpected keyword argument 'attention_mask'")
    assert rows[_Breaks.name].peak_bytes is None
    assert plan.engine is not None and plan.engine.name == "backprop"


def test_plan_raises_when_backprop_itself_fails() -> None:
    model, x, _ = _bn_mlp()

    def bad_loss(out: torch.Tensor) -> torch.Tensor:
        return out.logits.sum()  # type: ignore[attr-defined, no-any-return]

    with pytest.raises(AttributeError, match="logits"):
        leangrad.plan(model, x, bad_loss, budget=2**30, repeats=1)


@pytest.mark.slow
def test_plan_offers_the_loss_without_logits_where_they_dominate() -> None:
    """A GPT whose vocabulary dwarfs its width: only cross-entropy that never computes the
    logits fits ¼ of backprop's step peak; the plan finds it, and the chosen step is exact.
    A model without a vocabulary-sized output is not offered it."""
    torch.manual_seed(0)
    model = zoo.gpt(vocab=8192, dim=16, layers=2, heads=2, context=32)
    x = torch.randint(0, 8192, (4, 32))
    y = torch.randint(0, 8192, (4, 32))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    names = [n for n, _ in candidates(model)]
    assert "chunked_ce" in names and "checkpoint+chunked_ce" in names
    assert not any("chunked_ce" in n for n, _ in candidates(zoo.gpt(vocab=64, dim=16)))
    bp = profile_step(leangrad.engine("backprop"), model, (x,), loss_fn, repeats=0)
    plan = leangrad.plan(model, (x,), loss_fn, budget=bp.baseline_bytes + bp.peak_bytes // 4,
                         repeats=1)  # fmt: skip
    assert plan.engine is not None and "chunked_ce" in plan.engine.label, str(plan)
    fitting = [c.label for c in plan.table if c.verdict.startswith(("fits", "chosen"))]
    assert fitting and all("chunked_ce" in label for label in fitting)
    want = grads_of_backprop(model, x, loss_fn)
    model.zero_grad(set_to_none=True)
    plan.engine.backward(model, (x,), loss_fn)
    for n, p in model.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6)


def grads_of_backprop(model: torch.nn.Module, x: torch.Tensor,
                      loss_fn: object) -> dict[str, torch.Tensor]:  # fmt: skip
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()  # type: ignore[operator]
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out
