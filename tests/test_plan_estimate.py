"""``leangrad.plan`` where a step cannot be allocated here: fake-tensor estimates
(:func:`leangrad.measure.estimate_step`), labelled, untimed; budgets written as sizes;
near-equal candidates timed again. Behaviour by bytes and by calls, never by time."""

from __future__ import annotations

import collections
import copy
import functools
import re

import pytest
import torch
import torch.nn.functional as F

import leangrad
import leangrad.planner._measure as measuring
import leangrad.planner._plan as planner
from leangrad import zoo
from leangrad._sizes import BAD_BYTES, parse_bytes
from leangrad.measure import estimate_step, profile_step
from leangrad.measure._timer import Timing
from leangrad.planner._measure import ESTIMATED
from leangrad.planner._plan import BAD_SETTING, NOT_TIMED
from shared_models import tiny_gpt_step

_gpt = tiny_gpt_step


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1e9") == 10**9 and parse_bytes(4096) == 4096
    with pytest.raises(ValueError, match=re.escape(BAD_BYTES.format(value="two gigs"))):
        parse_bytes("two gigs")


@pytest.mark.parametrize("name", ["backprop", "checkpoint", "checkpoint+fad", "bits"])
def test_estimate_step_equals_the_real_tracker_and_leaves_the_model_alone(name: str) -> None:
    model, idx, loss_fn = _gpt()
    before = copy.deepcopy(model.state_dict())
    est = estimate_step(leangrad.engine(name), model, idx, loss_fn)
    real = profile_step(leangrad.engine(name), model, idx, loss_fn, repeats=0)
    assert est.estimate and not real.estimate and est.seconds is None
    assert est.peak_bytes == real.peak_bytes and est.baseline_bytes == real.baseline_bytes
    assert est.kept_bytes == real.kept_bytes
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) and not isinstance(v, torch._subclasses.FakeTensor)


@pytest.mark.slow
def test_plan_estimates_every_candidate_when_backprop_cannot_be_allocated() -> None:
    """allocate_limit=0: nothing is run for real; every row is an estimate equal to the
    real plan's measured peak, nothing is timed, the chosen row says so."""
    model, idx, loss_fn = _gpt()
    full = profile_step(leangrad.engine("backprop"), model, idx, loss_fn, repeats=0)
    budget = full.baseline_bytes + full.peak_bytes // 2
    real = leangrad.plan(model, idx, loss_fn, budget=budget, repeats=1)
    est = leangrad.plan(model, idx, loss_fn, budget=budget, repeats=1, allocate_limit=0)
    measured = [c for c in est.table if c.peak_bytes is not None]
    assert measured and all(c.estimate and c.seconds is None for c in measured)
    assert all(ESTIMATED in c.verdict for c in measured)
    real_peaks = {c.label: c.peak_bytes for c in real.table}
    for c in measured:
        assert c.peak_bytes == real_peaks[c.label], c.label
    assert est.engine is not None and est.estimate and est.seconds is None
    assert est.peak_bytes is not None and est.peak_bytes <= budget
    assert est.remeasured_peak_bytes is None and NOT_TIMED in est.message
    first_fitting = est.chosen
    assert first_fitting is not None and first_fitting.verdict == "chosen (estimate)"
    assert all(not c.verdict.startswith("fits") for c in est.table[: est.table.index(
        first_fitting)])  # the first fitting row in the planner's order  # fmt: skip
    assert "~" in str(est)
    assert all(p.grad is None for p in model.parameters())


def test_a_partial_loss_brings_its_targets_in_as_they_are() -> None:
    """A loss given as functools.partial(F.cross_entropy, target=y) (no closure): its
    target is made fake before the step, so the estimate equals the real tracker's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    x, y = torch.randn(32, 16), torch.randint(0, 5, (32,))
    loss_fn = functools.partial(F.cross_entropy, target=y)
    est = estimate_step(leangrad.engine("backprop"), model, x, loss_fn)
    real = profile_step(leangrad.engine("backprop"), model, x, loss_fn, repeats=0)
    assert (est.peak_bytes, est.kept_bytes) == (real.peak_bytes, real.kept_bytes)


def test_a_candidate_that_runs_out_of_memory_is_estimated(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model, idx, loss_fn = _gpt()
    real_profile = measuring.profile_step

    def oom_for_backprop(step, *args, **kwargs):  # type: ignore[no-untyped-def]
        if step.label == "backprop":
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 999999999999 bytes")  # fmt: skip
        return real_profile(step, *args, **kwargs)

    monkeypatch.setattr(measuring, "profile_step", oom_for_backprop)
    p = leangrad.plan(model, idx, loss_fn, budget=2**30, repeats=1,
                      engines=[("backprop", {}), ("checkpoint", {})])  # fmt: skip
    rows = {c.label: c for c in p.table}
    assert rows["backprop"].estimate and rows["backprop"].verdict == f"fits ({ESTIMATED})"
    assert not rows["checkpoint"].estimate and rows["checkpoint"].verdict == "chosen"
    expected = estimate_step(leangrad.engine("backprop"), model, idx, loss_fn).total_bytes
    assert rows["backprop"].peak_bytes == expected


def test_other_errors_are_not_taken_for_running_out_of_memory(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model, idx, loss_fn = _gpt()

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(measuring, "profile_step", broken)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        leangrad.plan(model, idx, loss_fn, budget=2**30, engines=[("backprop", {})])


@pytest.mark.slow
def test_near_equal_candidates_are_timed_again_longer(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Medians within 5% of the fastest get a second, longer round that decides (one
    timed round a call: the race and the first round's second, then three more for the
    two within noise; their medians are over all five)."""
    model, idx, loss_fn = _gpt()
    calls: list[tuple[list[str], int]] = []
    third = "checkpoint(blocks=['blocks.0'])"
    first = {"backprop": 1.00, "checkpoint": 1.03, third: 1.50}
    second = {"backprop": 1.10, "checkpoint": 1.00}

    def fake_timing(fns, *, repeats, warmup, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((sorted(fns), repeats))
        table = first if len(fns) == 3 else second  # the first round's, or the second's
        return {k: Timing(table[k], table[k], table[k], None, repeats) for k in fns}

    monkeypatch.setattr(planner, "time_interleaved", fake_timing)
    p = leangrad.plan(model, idx, loss_fn, budget=2**30, repeats=2,
                      engines=[("backprop", {}), ("checkpoint", {}),
                               ("checkpoint", {"blocks": ["blocks.0"]})])  # fmt: skip
    assert calls == [(sorted(["backprop", "checkpoint", third]), 1)] * 2 + [
        (["backprop", "checkpoint"], 1)] * 3  # fmt: skip
    assert p.engine is not None and p.engine.label == "checkpoint" and p.seconds == 1.00
    assert {c.label: c.seconds for c in p.table}[third] == 1.50


def test_a_transform_that_changes_nothing_is_not_offered() -> None:
    """The zoo GPT's only activation is nn.GELU (PyTorch's fused built-in, left alone) and
    it has no ReLU or dropout: fad and bits change nothing, so the plan does not offer
    them under a name that claims they do."""
    model, idx, loss_fn = _gpt()
    p = leangrad.plan(model, idx, loss_fn, budget=2**30, repeats=1,
                      engines=[("fad", {}), ("checkpoint+bits", {}), ("checkpoint", {})])
    rows = {c.label: c for c in p.table}
    assert rows["fad"].verdict.startswith("n/a: fad change(s) nothing on this model")
    assert rows["checkpoint+bits"].verdict.startswith("n/a: bits change(s) nothing")
    assert rows["fad"].peak_bytes is None and rows["checkpoint"].verdict == "chosen"


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"repeats": 0}, BAD_SETTING.format(name="repeats", want="an int >= 1", value=0)),
    ({"allocate_limit": -1},
     BAD_SETTING.format(name="allocate_limit", want="an int >= 0", value=-1)),
    ({"allocate_limit": 1.5},
     BAD_SETTING.format(name="allocate_limit", want="an int >= 0", value=1.5)),
])  # fmt: skip
def test_plan_refuses_nonsense_settings_before_measuring(kwargs: dict, fragment: str) -> None:
    model, idx, loss_fn = _gpt()
    with pytest.raises(ValueError, match=re.escape(fragment)):
        leangrad.plan(model, idx, loss_fn, budget=2**30, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize(("cell", "dtype", "stepwise"), [
    ("gru", torch.float32, True), ("lstm", torch.float32, False), ("lstm", torch.float64, True),
])  # fmt: skip
def test_no_estimate_screens_where_fake_tensors_run_an_rnn_step_by_step(
    counted: collections.Counter[tuple[str, str]], cell: str, dtype: torch.dtype,
    stepwise: bool,
) -> None:  # fmt: skip
    """``nn.GRU`` (and ``nn.LSTM`` in float64) has no fused CPU kernel, so fake tensors run
    it one time step at a time: :func:`~leangrad.planner._measure.stepwise_on_fake` names it,
    and the plan estimates no candidate (only backprop, once, asking whether anything can
    be allocated), stepping them for real instead; a float32 LSTM runs one fused op on fake
    tensors too, and each candidate is estimated first."""
    torch.manual_seed(0)
    model = zoo.rnn_lm(cell, vocab=32, embed=16, hidden=32).to(dtype)
    idx = torch.randint(0, 32, (4, 24))
    assert (measuring.stepwise_on_fake(model) == "rnn") is stepwise

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), idx.flatten())

    full = profile_step(leangrad.engine("backprop"), model, idx, loss_fn, repeats=0)
    engines = [("backprop", {}), ("checkpoint", {"time_chunks": 4})]
    p = leangrad.plan(model, idx, loss_fn, budget=full.baseline_bytes + full.peak_bytes // 3,
                      repeats=1, engines=engines)  # fmt: skip
    fake = {lb: n for (lb, kind), n in counted.items() if kind == "fake" and n}
    backprop = {c.label: c for c in p.table}["backprop"]
    assert backprop.verdict.startswith("over budget")
    if stepwise:  # measured for real (first step far over: one step)
        assert not backprop.estimate and counted[("backprop", "real")] == 1
        assert fake == {"backprop": 1}
    else:  # estimated to screen it (then run for real where the estimate is low)
        assert fake["backprop"] == 2 and fake["checkpoint(time_chunks=4)"] == 1
