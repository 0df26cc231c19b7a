"""Bad input to the library — layers, transforms, measurement, engines, the planner —
gives an error that names the input and the fix (asserted by type and text), or the
result autograd gives (asserted by value). CLI errors: test_cli_errors.py."""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import leangrad
from fad_cases import Lambda, Untraceable
from leangrad import _errors as E
from leangrad import fad, rad
from leangrad import layers as L
from leangrad.fad import FadDtypeError, FadOpError
from leangrad.layers import LayerConditionError
from leangrad.measure import (
    MemoryBudgetExceeded,
    MemoryTracker,
    compare_grads,
    estimate_memory,
    estimator_stats,
    time_interleaved,
)
from leangrad.measure._memory import BAD_BUDGET, ENTERED_TWICE, EXITED_OUT_OF_ORDER, NOT_ENTERED
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
    ("leaky relu slope str", lambda: L.LeakyReLU("0.1"), LayerConditionError,
     "LeakyReLU(negative_slope='0.1') is not invertible"),
    ("leaky relu int input", lambda: L.LeakyReLU(0.1)(torch.ones(3, dtype=torch.long)),
     LayerConditionError, "needs a floating-point input, got dtype torch.int64"),
    ("subconv channels str", lambda: L.SubmersiveConv2d("3", 3, 3), LayerConditionError,
     "SubmersiveConv2d: in_channels must be a positive int, got '3'"),
    ("subconv channels 0", lambda: L.SubmersiveConv2d(3, 0, 3), LayerConditionError,
     "out_channels must be a positive int, got 0"),
    ("subconv kernel bool", lambda: L.SubmersiveConv2d(3, 3, True), LayerConditionError,
     "kernel_size must be an int ≥ 0 or a pair"),
    ("subconv float64 input", lambda: _sub()(torch.randn(2, 3, 8, 8, dtype=torch.float64)),
     LayerConditionError, "has torch.float32 parameters but got an input of dtype torch.float64"),
    ("frag1d channels str", lambda: L.FragmentalConv1d("3", 3), LayerConditionError,
     "channels must be a positive int, got '3'"),
    ("frag2d float64 input", lambda: L.FragmentalConv2d(3, 3)(
        torch.randn(2, 3, 8, 8, dtype=torch.float64)), LayerConditionError,
     "cast the input, e.g. x.to(torch.float32)"),
    ("sublinear features 4.7", lambda: L.SubmersiveLinear(4.7, 3), LayerConditionError,
     "SubmersiveLinear: in_features must be a positive int, got 4.7"),
    ("sublinear int input", lambda: L.SubmersiveLinear(4, 3)(torch.ones(2, 4, dtype=torch.long)),
     LayerConditionError, "needs a floating-point input, got dtype torch.int64"),
    ("space-to-depth inverse channels", lambda: L.SpaceToDepth(2).inverse(torch.randn(2, 3, 4, 4)),
     LayerConditionError, "its channel count 3 is not divisible by block_size² = 4"),
    ("coupling split_dim str", lambda: L.AdditiveCoupling(nn.Identity(), split_dim="1"),
     LayerConditionError, "split_dim must be an int"),
    ("coupling F for all channels", lambda: L.AdditiveCoupling(nn.Conv2d(2, 2, 1))(
        torch.randn(2, 2, 4, 4)), LayerConditionError, "F failed on x1 of shape (2, 1, 4, 4)"),
    ("swap dim out of range", lambda: L.SwapHalves(dim=4)(torch.randn(2, 4)), LayerConditionError,
     "swaps halves along dim 4, but the input has shape (2, 4)"),
    ("chain of a function", lambda: L.Chain(lambda x: x), E.EngineInputError,
     "Chain: layer 0 is a function, not an nn.Module"),
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
    ("rad seed str", lambda: rad.RandLinear(3, 4, seed="3"), RadInputError,
     "seed must be an int or None, got '3'"),
    ("randomize seed float", lambda: rad.randomize(nn.Sequential(nn.Linear(2, 2)), seed=1.5),
     RadInputError, "seed must be an int or None, got 1.5"),
    ("rad replace str", lambda: rad.RandConv2d(3, 4, 3, replace="no"), RadInputError,
     "replace must be True or False, got 'no'"),
    ("rad linear features", lambda: rad.RandLinear(3, 4)(torch.randn(2, 5)), RadInputError,
     "RandLinear: needs an input of shape (..., 3), got shape (2, 5)"),
    ("rad conv rank", lambda: rad.RandConv2d(3, 4, 3)(torch.randn(2, 3)), RadInputError,
     "RandConv2d: needs an input of shape (N, 3, H, W) or (3, H, W), got shape (2, 3)"),
    ("rad conv channels", lambda: rad.RandConv2d(3, 4, 3)(torch.randn(2, 5, 8, 8)),
     RadInputError, "got shape (2, 5, 8, 8)"),
    ("rad conv padding same", lambda: rad.RandConv2d(3, 4, 3, padding="same"), RadInputError,
     "RandConv2d: cannot use padding='same' (only numeric padding)"),
    ("rad conv unbatched different", lambda: rad.RandConv2d(3, 4, 3)(torch.randn(3, 8, 8)),
     RadInputError, "needs a batch dimension"),
    ("rad rnn nonlinearity", lambda: rad.RandRNNCell(3, 4, nonlinearity="gelu"), RadInputError,
     "unknown nonlinearity 'gelu'; known nonlinearities: tanh, relu"),
    ("rad rnn hidden size", lambda: rad.RandRNNCell(3, 4)(torch.randn(2, 3), torch.randn(2, 5)),
     RadInputError, "RandRNNCell: needs an input of shape (..., 4), got shape (2, 5)"),
    ("rad pool rank", lambda: rad.LeanAvgPool2d(2)(torch.randn(2, 3)), RadInputError,
     "LeanAvgPool2d: needs an input of shape (N, C, H, W) or (C, H, W), got shape (2, 3)"),
    ("rand_linear spec", lambda: rad.rand_linear(torch.randn(2, 3), torch.randn(4, 3), None,
                                                 spec=0.5, seed=1),  # type: ignore[arg-type]
     RadInputError, "spec must be a SampleSpec, got float"),
    ("rad engine fraction", lambda: leangrad.engine("rad", fraction=2.0), RadInputError,
     "fraction must be a number in (0, 1]"),
    # fad: operators and dtypes
    ("fad matmul", lambda: fad.elementwise(lambda x: x @ x)(torch.randn(3, 3)), FadOpError,
     "operator 'matmul' is not a FAD-compatible element-wise primitive"),
    ("fad int dtype", lambda: fad.elementwise(lambda x: x * 2)(torch.ones(3, dtype=torch.long)),
     FadDtypeError, "no forward-mode rule for dtype torch.int64"),
    ("fad two sources", lambda: fad.elementwise(lambda x: x * _W)(torch.randn(3)), FadOpError,
     "binary operator 'mul' mixes the source tensor with a second source"),
    ("fad widening constant", lambda: fad.elementwise(lambda x: x * torch.ones(2, 3))(
        torch.randn(3)), FadOpError, "the other operand's shape (2, 3) widens (3,)"),
    ("fad in-place on input", lambda: fad.elementwise(lambda x: x.mul_(2))(torch.randn(3)),
     FadOpError, "in-place operator 'mul_' writes into the function's input"),
    ("fad reduction", lambda: fad.elementwise(lambda x: x.sum())(torch.randn(3)), FadOpError,
     "operator 'sum' is not a FAD-compatible element-wise primitive"),
    ("fad constant output", lambda: fad.elementwise(lambda x: torch.ones(3))(torch.randn(3)),
     FadOpError, "it returned a tensor that does not depend on it"),
    ("fad not a function", lambda: fad.elementwise(3), FadOpError,  # type: ignore[arg-type]
     "fad.elementwise needs a function of one tensor, got int"),
    ("fad list input", lambda: fad.elementwise(torch.sigmoid)([1.0]), FadOpError,
     "the input must be a tensor, got list"),
    ("fad escaped chain", lambda: _escaped_chain(), fad.FadError,
     "was used for a gradient after the `with fad.nested()` block ended"),
    ("fad engine mode", lambda: leangrad.engine("fad", mode="lazy"), ValueError,
     "fad mode must be 'auto', 'fx' or 'eager'"),
    ("fad fx on untraceable", lambda: leangrad.engine("fad", mode="fx").backward(
        Untraceable(), torch.randn(2, 3), lambda o: o.sum()), E.LeangradError,
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
    ("compare empty", lambda: compare_grads({}, {}), ValueError,
     "compare_grads: no gradients to compare"),
    ("compare None grad", lambda: compare_grads({"w": None}, {"w": torch.ones(1)}),  # type: ignore[dict-item]
     TypeError, "compare_grads: gradient 'w' is NoneType, not a tensor; use grads_of(model)"),
    ("estimator draws", lambda: estimator_stats(lambda: {}, {}, draws=1), ValueError,
     "draws must be an int >= 2 to estimate a variance, got 1"),
    ("estimator draws float", lambda: estimator_stats(lambda: {}, {}, draws=2.5),  # type: ignore[arg-type]
     ValueError, "got 2.5"),
    ("estimator empty exact", lambda: estimator_stats(lambda: {}, {}, draws=2), ValueError,
     "estimator_stats: no gradients to compare"),
    ("estimator draw names", lambda: estimator_stats(lambda: {"v": torch.ones(3)},
                                                     {"w": torch.ones(3)}, draws=2),
     KeyError, "draw() returned gradients named ['v'], but exact has ['w']"),
    ("estimator draw shape", lambda: estimator_stats(lambda: {"w": torch.ones(3, 2)},
                                                     {"w": torch.ones(2, 3)}, draws=2),
     ValueError, "gradient 'w' has shape (3, 2) but its reference has shape (2, 3)"),
    ("timer repeats", lambda: time_interleaved({"a": lambda: None}, repeats=0), ValueError,
     "repeats must be an int >= 1, got 0"),
    ("timer repeats float", lambda: time_interleaved({"a": lambda: None}, repeats=2.5),  # type: ignore[arg-type]
     ValueError, "repeats must be an int >= 1, got 2.5"),
    ("timer warmup", lambda: time_interleaved({"a": lambda: None}, warmup=-1), ValueError,
     "warmup must be an int >= 0, got -1"),
    ("timer threads", lambda: time_interleaved({"a": lambda: None}, threads=0), ValueError,
     "threads must be an int >= 1, got 0"),
    ("timer nothing", lambda: time_interleaved({}), ValueError,
     "needs at least one function to time"),
    ("timer not callable", lambda: time_interleaved({"a": 3}), TypeError,  # type: ignore[dict-item]
     "fns['a'] must be a zero-argument callable, got int"),
    ("estimate build", lambda: estimate_memory(lambda: nn.Linear(3, 2), lambda m, x: None),
     E.EngineInputError, "build() must return a (model, inputs) pair"),
    ("estimate not callable", lambda: estimate_memory(3, lambda m, x: None),  # type: ignore[arg-type]
     E.EngineInputError, "build must be a callable, got int"),
    ("estimate reads values", lambda: estimate_memory(
        lambda: (nn.Linear(3, 2), torch.randn(4, 3)), lambda m, x: m(x).sum().item()),
     E.EngineInputError, "the step read a tensor value or made a data-dependent shape"),
    ("tracker device", lambda: MemoryTracker(device="gpu"), ValueError,
     "device 'gpu' cannot be tracked: not a torch device"),
    ("tracker exit without enter", lambda: MemoryTracker().__exit__(None, None, None),
     E.LeangradError, NOT_ENTERED),
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


_W = torch.randn(3, requires_grad=True)


def _escaped_chain() -> None:
    x = torch.randn(3, requires_grad=True)
    with fad.nested():
        y = x * torch.sigmoid(x)
    y.sum().backward()  # outside the block, never through a non-element-wise op


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


# (id, the layer after the chain, train mode): writes by inplace= (keyword or position),
# by a trailing-underscore function, and through a view or a detached alias of the chain value
SAME_AS_AUTOGRAD: list[tuple[str, Callable[[], nn.Module], bool]] = [
    ("ReLU", lambda: nn.ReLU(inplace=True), True),
    ("LeakyReLU", lambda: nn.LeakyReLU(0.1, inplace=True), True),
    ("Hardtanh", lambda: nn.Hardtanh(inplace=True), True),
    ("ELU", lambda: nn.ELU(inplace=True), True),
    ("Dropout-train", lambda: nn.Dropout(0.3, inplace=True), True),
    ("Dropout-eval", lambda: nn.Dropout(0.3, inplace=True), False),
    ("relu-keyword", lambda: Lambda(lambda x: F.relu(x, inplace=True)), True),
    ("threshold-positional", lambda: Lambda(lambda x: F.threshold(x, 0.1, 0.0, True)), True),
    ("relu_", lambda: Lambda(F.relu_), True),
    ("hardswish", lambda: Lambda(lambda x: F.hardswish(x, inplace=True)), True),
    ("silu", lambda: Lambda(lambda x: F.silu(x, inplace=True)), True),
    ("dropout1d-positional", lambda: Lambda(lambda x: F.dropout1d(x, 0.3, True, True)), True),
    ("clamp_", lambda: Lambda(lambda x: x.clamp_(-0.1, 0.5)), True),
    ("view-then-relu_", lambda: Lambda(lambda x: x.view(-1).relu_().view(x.shape)), True),
    ("detach-then-relu_", lambda: Lambda(lambda x: (x.detach().relu_(), x)[1]), True),
]  # fmt: skip


@pytest.mark.parametrize(("act", "train"), [c[1:] for c in SAME_AS_AUTOGRAD],
                         ids=[c[0] for c in SAME_AS_AUTOGRAD])  # fmt: skip
@pytest.mark.parametrize("mode", ["nested", "nest"])
def test_fad_accepts_inplace_activations_after_a_fused_chain(
    act: Callable[[], nn.Module], train: bool, mode: str
) -> None:
    """``nn.ReLU(inplace=True)`` (and the others that write through an ``inplace=`` argument,
    by keyword or by position, a ``relu_``, or a view of the chain's value) after a fused
    chain: autograd's gradient, float64, the same dropout mask from the same seed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), _Swish(), act(), nn.Linear(5, 2)).double()
    model.train(train)
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


# --- the tracker: every path leaves torch's dispatch stack as it found it -----------------


def _stack_depth() -> int:
    return len(_get_current_dispatch_mode_stack())


def test_a_budget_exceeded_mid_step_and_an_exception_leave_no_mode() -> None:
    depth = _stack_depth()
    with pytest.raises(MemoryBudgetExceeded), MemoryTracker(budget_bytes=100):
        torch.ones(1000)
    assert _stack_depth() == depth
    with pytest.raises(KeyError), MemoryTracker():
        raise KeyError("the step failed")
    assert _stack_depth() == depth
    assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))


def test_trackers_exited_out_of_order_pop_their_own_modes() -> None:
    """Exiting an outer tracker while an inner one is active exits the inner one first
    (it gets its report) and then says so; nothing stays pushed."""
    depth = _stack_depth()
    outer, inner = MemoryTracker(), MemoryTracker()
    outer.__enter__()
    inner.__enter__()
    y = torch.ones(1000)
    with pytest.raises(E.LeangradError, match=re.escape(EXITED_OUT_OF_ORDER.format(count=1))):
        outer.__exit__(None, None, None)
    assert _stack_depth() == depth
    assert inner.report.peak_bytes >= y.numel() * 4 and outer.report.peak_bytes >= y.numel() * 4
    with pytest.raises(E.LeangradError, match=re.escape(NOT_ENTERED)):
        inner.__exit__(None, None, None)  # already exited: not a second report


def test_a_tracker_can_be_entered_again_after_it_exited() -> None:
    tracker = MemoryTracker(budget_bytes=np.int64(10**9))  # numpy ints are ints
    assert tracker.budget_bytes == 10**9
    with tracker:
        torch.ones(10)
    with tracker:
        y = torch.ones(1000)
    assert tracker.report.peak_bytes >= y.numel() * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the message without CUDA")
def test_a_cuda_tracker_without_cuda_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="device 'cuda' cannot be tracked: CUDA is not available"):
        MemoryTracker(device="cuda")


# --- gradient statistics: a NaN is never a reassuring number ------------------------------


def test_a_nan_draw_makes_every_estimator_statistic_nan() -> None:
    """``se > 0`` is False for NaN, so z used to read 0 ("unbiased") after a NaN draw."""
    draws = iter([torch.tensor([1.0, 2.0]), torch.tensor([math.nan, 2.0]), torch.ones(2)])
    st = estimator_stats(lambda: {"w": next(draws)}, {"w": torch.ones(2)}, draws=3)
    stats = (st.rel_bias, st.variance, st.z_mean_square, st.max_abs_z, st.mean_cosine)
    assert all(math.isnan(v) for v in stats), st


def test_the_worst_parameter_is_the_nan_one() -> None:
    ref = {"a": torch.ones(2), "b": torch.ones(2)}
    cmp = compare_grads({"a": torch.full((2,), 9.0), "b": torch.tensor([1.0, math.nan])}, ref)
    assert cmp.worst_param == "b"


# --- rad: settings that take effect, inputs autograd accepts ------------------------------


def test_randomize_again_changes_the_gradients() -> None:
    """A second call's fraction is what the layers use: fraction 1 after 0.1 gives autograd's
    gradient exactly, and 0.1 after 1 no longer does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    exact = copy.deepcopy(model)
    x = torch.randn(5, 8, dtype=torch.float64)
    exact(x).square().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rad.randomize(model, fraction=0.1, seed=0)
        report = rad.randomize(model, fraction=1.0, seed=0)
    assert report.fraction == 1.0 and all(m.spec.fraction == 1.0 for m in model
                                           if isinstance(m, rad.RandLinear))  # fmt: skip
    model(x).square().sum().backward()
    for p, r in zip(model.parameters(), exact.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-12, atol=1e-12)
    model.zero_grad()
    rad.randomize(model, fraction=0.1, seed=0)
    model(x).square().sum().backward()
    assert not torch.allclose(model[0].weight.grad, exact[0].weight.grad)


def test_randomize_a_randomized_root_takes_the_new_settings() -> None:
    layer = rad.RandLinear(3, 2, fraction=0.5)
    report = rad.randomize(layer, fraction=0.25, mode="project")
    assert (layer.spec.fraction, layer.spec.mode) == (0.25, "project")
    assert report.swapped == {"<root>": "RandLinear (settings replaced)"}
    assert report.left_exact == []


@pytest.mark.parametrize("mode", ["different", "same", "project"])
def test_rad_layers_on_an_empty_batch_give_autograds_zero_gradient(mode: str) -> None:
    """A batch of 0 rows used to fail inside the sampler (torch.cat of no parts)."""
    lin, conv = rad.RandLinear(3, 4, mode=mode), rad.RandConv2d(3, 4, 3, mode=mode)
    (lin(torch.randn(0, 3)).sum() + conv(torch.randn(0, 3, 8, 8)).sum()).backward()
    for p in (*lin.parameters(), *conv.parameters()):
        assert p.grad is not None and not p.grad.any()


def test_leaky_relu_checks_its_dtype_and_stays_traceable() -> None:
    """The integer-input check skips fx Proxies: fad.nest can still trace the layer."""
    gm = torch.fx.symbolic_trace(L.LeakyReLU(0.1))
    x = torch.randn(5)
    assert torch.equal(gm(x), L.LeakyReLU(0.1)(x))
