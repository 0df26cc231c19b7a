"""Bad input to the library — layers, transforms, measurement, engines, the planner —
gives an error that names the input and the fix (asserted by type and text), or the
result autograd gives (asserted by value). CLI errors: test_cli_errors.py."""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import leangrad
from leangrad import _errors as E
from leangrad import fad, rad
from leangrad import layers as L
from leangrad.fad import FadDtypeError, FadOpError
from leangrad.layers import LayerConditionError
from leangrad.measure import (
    MemoryBudgetExceeded,
    MemoryTracker,
    compare_grads,
    estimator_stats,
    time_interleaved,
)
from leangrad.measure._memory import BAD_BUDGET, ENTERED_TWICE
from leangrad.rad import RadInputError


def _sub() -> L.SubmersiveConv2d:
    return L.SubmersiveConv2d(3, 3, 3, stride=2, padding=1)


# (callable, error type, a fragment of the message)
RAISES: list[tuple[str, Callable[[], object], type[BaseException], str]] = [
    # layers: shapes, channels and dtypes named, not a raw conv error
    ("subconv rank", lambda: _sub()(torch.randn(2, 3, 8)), LayerConditionError,
     "needs an input of shape (N, 3, H, W), got shape (2, 3, 8)"),
    ("subconv channels", lambda: _sub()(torch.randn(2, 4, 8, 8)), LayerConditionError,
     "got shape (2, 4, 8, 8)"),
    ("subconv dtype", lambda: _sub()(torch.ones(2, 3, 8, 8, dtype=torch.long)),
     LayerConditionError, "needs a floating-point input, got dtype torch.int64"),
    ("frag1d rank", lambda: L.FragmentalConv1d(3, 3)(torch.randn(2, 3, 8, 8)),
     LayerConditionError, "needs an input of shape (N, 3, L), got shape (2, 3, 8, 8)"),
    ("frag1d channels", lambda: L.FragmentalConv1d(3, 3)(torch.randn(2, 4, 8)),
     LayerConditionError, "got shape (2, 4, 8)"),
    ("frag1d dtype", lambda: L.FragmentalConv1d(3, 3)(torch.ones(2, 3, 8, dtype=torch.int32)),
     LayerConditionError, "needs a floating-point input, got dtype torch.int32"),
    ("frag2d rank", lambda: L.FragmentalConv2d(3, 3)(torch.randn(2, 3, 8)),
     LayerConditionError, "needs an input of shape (N, 3, H, W), got shape (2, 3, 8)"),
    ("frag1d kernel 0", lambda: L.FragmentalConv1d(3, 0), LayerConditionError,
     "kernel_size must be a positive int"),
    ("frag1d even kernel", lambda: L.FragmentalConv1d(3, 2), LayerConditionError, "2"),
    ("space-to-depth odd", lambda: L.SpaceToDepth(2)(torch.randn(2, 3, 5, 5)),
     LayerConditionError, "5×5 is not divisible by the block size 2"),
    ("space-to-depth block 0", lambda: L.SpaceToDepth(0), LayerConditionError, "0"),
    ("coupling odd channels", lambda: L.AdditiveCoupling(nn.Conv2d(1, 1, 1))(
        torch.randn(2, 3, 4, 4)), LayerConditionError, "an odd number"),
    ("leaky relu slope 0", lambda: L.LeakyReLU(0.0), LayerConditionError, "is not invertible"),
    ("leaky relu slope nan", lambda: L.LeakyReLU(math.nan), LayerConditionError,
     "finite number > 0"),
    # rad: fractions and modes
    ("rad fraction 0", lambda: rad.RandLinear(3, 4, fraction=0.0), RadInputError,
     "fraction must be a number in (0, 1], got 0.0"),
    ("rad fraction 1.5", lambda: rad.RandLinear(3, 4, fraction=1.5), RadInputError,
     "got 1.5"),
    ("rad fraction nan", lambda: rad.RandLinear(3, 4, fraction=math.nan), RadInputError,
     "got nan"),
    ("rad mode", lambda: rad.RandLinear(3, 4, mode="weird"), RadInputError,
     "unknown mode 'weird'; known modes: different, same, project"),
    ("randomize fraction", lambda: rad.randomize(nn.Sequential(nn.Linear(2, 2)), fraction=0),
     RadInputError, "fraction must be a number in (0, 1]"),
    ("randomize root", lambda: rad.randomize(nn.Linear(2, 2)), RadInputError,
     "the model itself is a Linear; wrap it"),
    ("rad engine fraction", lambda: leangrad.engine("rad", fraction=2.0), RadInputError,
     "fraction must be a number in (0, 1]"),
    # fad: operators and dtypes
    ("fad matmul", lambda: fad.elementwise(lambda x: x @ x)(torch.randn(3, 3)), FadOpError,
     "operator 'matmul' is not a FAD-compatible element-wise primitive"),
    ("fad int dtype", lambda: fad.elementwise(lambda x: x * 2)(torch.ones(3, dtype=torch.long)),
     FadDtypeError, "no forward-mode rule for dtype torch.int64"),
    ("fad engine mode", lambda: leangrad.engine("fad", mode="lazy"), ValueError,
     "fad mode must be 'auto', 'fx' or 'eager'"),
    ("fad fx on untraceable", lambda: leangrad.engine("fad", mode="fx").backward(
        _Untraceable(), torch.randn(2, 3), lambda o: o.sum()), E.LeangradError,
     "torch.fx cannot trace"),
    # measure
    ("tracker budget 0", lambda: MemoryTracker(budget_bytes=0), ValueError,
     BAD_BUDGET.format(value=0)),
    ("tracker budget negative", lambda: MemoryTracker(budget_bytes=-5), ValueError,
     BAD_BUDGET.format(value=-5)),
    ("tracker budget float", lambda: MemoryTracker(budget_bytes=1.5), ValueError,
     BAD_BUDGET.format(value=1.5)),
    ("tracker budget bool", lambda: MemoryTracker(budget_bytes=True), ValueError,
     BAD_BUDGET.format(value=True)),
    ("tracker budget str", lambda: MemoryTracker(budget_bytes="1GiB"), ValueError,
     BAD_BUDGET.format(value="1GiB")),
    ("compare shapes", lambda: compare_grads({"w": torch.ones(2, 3)}, {"w": torch.ones(3, 2)}),
     ValueError, "gradient 'w' has shape (2, 3) but its reference has shape (3, 2)"),
    ("compare names", lambda: compare_grads({"a": torch.ones(1)}, {"b": torch.ones(1)}),
     KeyError, "gradient names differ"),
    ("estimator draws", lambda: estimator_stats(lambda: {}, {}, draws=1), ValueError,
     "draws must be at least 2"),
    ("timer repeats", lambda: time_interleaved({"a": lambda: None}, repeats=0), ValueError,
     "repeats must be at least 1, got 0"),
    ("timer reference", lambda: time_interleaved({"a": lambda: None}, reference="b"), KeyError,
     "reference 'b' is not among the timed functions"),
    # engines, blocks and the planner
    ("moonwalk mode", lambda: leangrad.engine("moonwalk", mode="x"), ValueError,
     "mode must be 'mixed' or 'pure', got 'x'"),
    ("moonwalk stem_chunks", lambda: leangrad.engine("moonwalk", stem_chunks=0), ValueError,
     "stem_chunks must be a positive int, got 0"),
    ("highway k", lambda: leangrad.engine("highway", k=-1), E.LeangradError,
     "k must be an int >= 0"),
    ("forward chunk", lambda: leangrad.engine("forward", chunk_size=0), ValueError,
     "chunk_size must be a positive int, got 0"),
    ("checkpoint segments", lambda: leangrad.engine("checkpoint", segments="cbrt"), ValueError,
     "segments must be a positive int, 'sqrt', 'auto' or None"),
    ("no blocks", lambda: leangrad.blocks(nn.Linear(2, 2)), E.EngineInputError,
     "found no repeated blocks in Linear"),
    ("unknown engine option", lambda: leangrad.engine("backprop", segments=2),
     E.UnknownNameError, "engine 'backprop' has no option 'segments'"),
    ("engine empty batch", lambda: leangrad.engine("backprop").backward(
        nn.Linear(3, 2), torch.randn(0, 3), lambda o: o.sum()), E.EngineInputError,
     "input 0 is empty (shape (0, 3))"),
    ("engine int input", lambda: leangrad.engine("backprop").backward(
        nn.Linear(3, 2), torch.ones(2, 3, dtype=torch.long), lambda o: o.sum()),
     E.EngineInputError, "the model's forward failed on inputs of shapes [(2, 3)]"),
    ("engine wrong dtype", lambda: leangrad.engine("checkpoint").backward(
        nn.Sequential(nn.Linear(3, 2)), torch.ones(2, 3, dtype=torch.float64),
        lambda o: o.sum()), E.EngineInputError, "cast the inputs with .to(torch.float32)"),
    ("forward nan input", lambda: leangrad.engine("forward").backward(
        nn.Linear(3, 2), torch.tensor([[math.nan, 0.0, 1.0]]), lambda o: o.sum()),
     E.EngineInputError, "input 0 holds NaN or Inf"),
    ("forward input grad", lambda: leangrad.engine("forward").backward(
        nn.Linear(3, 2), torch.randn(2, 3, requires_grad=True), lambda o: o.sum()),
     E.EngineInputError, "does not compute input gradients, but input 0 has requires_grad"),
    ("plan budget", lambda: leangrad.plan(nn.Linear(2, 2), torch.randn(2, 2),
                                          lambda o: o.sum(), budget=0), ValueError,
     "budget must be a positive number of bytes"),
]  # fmt: skip


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * torch.sigmoid(h) if h.sum() > 0 else h


@pytest.mark.parametrize(("name", "call", "error", "fragment"), RAISES,
                         ids=[r[0] for r in RAISES])  # fmt: skip
def test_bad_input_names_the_input_and_the_fix(
    name: str, call: Callable[[], object], error: type[BaseException], fragment: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=re.escape(fragment)):
            call()


def test_enough_cases() -> None:
    assert len(RAISES) + len(SAME_AS_AUTOGRAD) >= 40


# --- where the right answer is autograd's -----------------------------------------------


class _Swish(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


SAME_AS_AUTOGRAD = [
    nn.ReLU(inplace=True), nn.LeakyReLU(0.1, inplace=True), nn.Hardtanh(inplace=True),
    nn.ELU(inplace=True), nn.Dropout(0.3, inplace=True),
]  # fmt: skip


@pytest.mark.parametrize("act", SAME_AS_AUTOGRAD, ids=lambda a: type(a).__name__)
@pytest.mark.parametrize("mode", ["nested", "nest"])
def test_fad_accepts_inplace_activations_after_a_fused_chain(act: nn.Module, mode: str) -> None:
    """``nn.ReLU(inplace=True)`` (and the others that write through an ``inplace=`` argument,
    by keyword or by position) after a fused chain: autograd's gradient, float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), _Swish(), copy.deepcopy(act),
                          nn.Linear(5, 2)).double()  # fmt: skip
    x = torch.randn(6, 4, dtype=torch.float64)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    ref(x).square().sum().backward()
    torch.manual_seed(1)
    if mode == "nested":
        with fad.nested():
            loss = model(x).square().sum()
        loss.backward()
    else:
        fad.nest(model)(x).square().sum().backward()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-10, atol=1e-12)


def test_a_failed_tracker_enter_leaves_torch_usable() -> None:
    x = torch.randn(1000)
    with pytest.raises(MemoryBudgetExceeded), MemoryTracker(baseline=(x,), budget_bytes=10):
        pass
    assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))  # no mode left pushed


def test_entering_a_tracker_twice_is_an_error_and_the_outer_one_still_reports() -> None:
    tracker = MemoryTracker()
    with tracker:
        with pytest.raises(E.LeangradError, match=re.escape(ENTERED_TWICE)), tracker:
            pass
        y = torch.ones(1000)
    assert tracker.report.peak_bytes >= y.numel() * 4
    assert torch.equal(torch.ones(1) * 2, torch.full((1,), 2.0))


def test_a_nan_gradient_is_never_reported_as_close() -> None:
    ref = {"w": torch.tensor([1.0, 2.0])}
    cmp = compare_grads({"w": torch.tensor([1.0, math.nan])}, ref)
    assert math.isnan(cmp.cosine) and math.isnan(cmp.max_rel_err)
    assert math.isnan(cmp.per_param["w"][1])
    cmp = compare_grads({"w": torch.tensor([math.inf, 2.0])}, ref)
    assert math.isnan(cmp.cosine)


def test_randomize_again_applies_the_new_settings() -> None:
    """A second call with another fraction used to keep the old one while its report
    claimed the new one: the layers now take the new settings and the report says so."""
    model = leangrad.models.mlp(4, 6, 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rad.randomize(model, fraction=0.5)
        again = rad.randomize(model, fraction=0.2, mode="same", seed=3)
    specs = [m.spec for m in model.modules() if isinstance(m, rad.RandLinear)]
    assert len(specs) == 3 and all(s.fraction == 0.2 and s.mode == "same" for s in specs)
    assert again.fraction == 0.2 and all("settings replaced" in v for v in again.swapped.values())
    # the same settings twice: still one layer deep (no double wrapping)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rad.randomize(model, fraction=0.2, mode="same", seed=3)
    assert sum(isinstance(m, rad.RandLinear) for m in model.modules()) == 3
