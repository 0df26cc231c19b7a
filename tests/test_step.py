"""``leangrad._step.Step``: the training step as one value. Its steps equal a
hand-written autograd loop bit for bit in float64, whole and per layer, with backprop and
checkpointing; its optimizer state persists across steps; it is what the planner measures."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import _step, train
from leangrad._errors import OptionError
from leangrad.measure import profile_step

STEPS = 3


def _adam(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(ps, lr=1e-2)


def _sgd(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()  # fmt: skip


def _batch() -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=g)
    return x, lambda out: F.cross_entropy(out, y)


def _by_hand(model: nn.Module, x: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor],
             *, per_layer: bool) -> list[torch.Tensor]:  # fmt: skip
    """``STEPS`` plain autograd steps: one Adam (or one Adam per parameter), zero_grad,
    backward, step; the losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    opts = [_adam([p]) for p in params] if per_layer else [_adam(params)]
    losses = []
    for _ in range(STEPS):
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss = loss_fn(model(x))
        loss.backward()
        for o in opts:
            o.step()
        losses.append(loss.detach())
    return losses


CASES = [("backprop", {}), ("checkpoint", {"segments": 2})]


@pytest.mark.parametrize("per_layer", [False, True], ids=["whole", "per-layer"])
@pytest.mark.parametrize(("name", "opts"), CASES, ids=[c[0] for c in CASES])
def test_step_equals_a_hand_written_autograd_step_bit_for_bit(name, opts, per_layer) -> None:
    """Three steps of ``Step(engine, Adam, per_layer=)`` give the same losses and weights, bit
    for bit in float64, as autograd with the optimizer after backward (per layer: one Adam
    per parameter, which is what stepping inside ``on_grad`` is); no gradient is left."""
    x, loss_fn = _batch()
    ref = _model()
    want = _by_hand(ref, x, loss_fn, per_layer=per_layer)
    model = _model()
    step = _step.Step(leangrad.engine(name, **opts), _adam, per_layer=per_layer, loss=loss_fn)
    got = [step.run(model, x).loss for _ in range(STEPS)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for (k, u), v in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(u, v), k
    assert all(p.grad is None for p in model.parameters())
    made = step.made
    states = made.optimizers.values() if isinstance(made, train.PerLayerOptimizer) else [made]
    assert all(s["step"] == STEPS for o in states for s in o.state.values())  # type: ignore[union-attr]


def test_per_layer_step_equals_the_whole_step_with_sgd() -> None:
    """SGD per parameter inside ``on_grad`` and SGD after backward: the same weights."""
    x, loss_fn = _batch()
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    models = [_model(), _model()]
    for model, per_layer in zip(models, (False, True), strict=True):
        step = _step.Step(leangrad.engine("backprop"), sgd, per_layer=per_layer)
        for _ in range(STEPS):
            step.run(model, x, loss=loss_fn)
    for u, v in zip(models[0].state_dict().values(), models[1].state_dict().values(), strict=True):
        assert torch.equal(u, v)


def test_without_an_optimizer_the_step_is_the_engines_backward() -> None:
    """No optimizer: gradients are left in ``.grad``, equal to autograd's; the weights stay."""
    x, loss_fn = _batch()
    ref, model = _model(), _model()
    loss_fn(ref(x)).backward()
    res = _step.Step(leangrad.engine("checkpoint", segments=2)).run(model, x, loss=loss_fn)
    assert res.engine == "checkpoint(segments=2)"
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), k  # type: ignore[arg-type]
    for u, v in zip(model.state_dict().values(), _model().state_dict().values(), strict=True):
        assert torch.equal(u, v)


def test_autocast_runs_the_engine_under_torch_autocast() -> None:
    """``autocast=torch.bfloat16``: the same step as autograd under ``torch.autocast``."""
    x, loss_fn = _batch()
    ref, model = _model().float(), _model().float()
    xf = x.float()
    opt = _adam(list(ref.parameters()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(ref(xf))
    loss.backward()
    opt.step()
    step = _step.Step(leangrad.engine("backprop"), _adam, autocast=torch.bfloat16)
    res = step.run(model, xf, loss=loss_fn)
    assert torch.equal(res.loss, loss.detach())
    for u, v in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(u, v)


def test_optimizer_is_made_per_model_and_fresh_forgets_it() -> None:
    x, loss_fn = _batch()
    a, b = _model(), _model()
    step = _step.Step(leangrad.engine("backprop"), _adam, loss=loss_fn)
    assert step.made is None
    step.run(a, x)
    first = step.made
    step.run(a, x)
    assert step.made is first
    step.run(b, x)  # another model: its own optimizer over its parameters
    assert step.made is not first
    assert step.fresh().made is None and step.fresh() == step


def test_label_exact_and_refusals() -> None:
    eng = leangrad.engine("checkpoint", segments=2)
    assert _step.Step(eng).label == "checkpoint(segments=2)"
    per_layer = _step.Step(eng, _adam, per_layer=True)
    assert per_layer.label == "checkpoint(segments=2)" + _step.PER_LAYER
    assert _step.Step(eng).exact is True and per_layer.engine is eng
    with pytest.raises(OptionError) as err:
        _step.Step(eng, per_layer=True)
    assert str(err.value) == _step.PER_LAYER_WITHOUT_OPTIMIZER
    with pytest.raises(OptionError) as err:
        _step.Step(eng, autocast=torch.int8)
    assert str(err.value) == _step.BAD_AUTOCAST.format(value=torch.int8)
    with pytest.raises(OptionError) as err:
        _step.Step(eng).run(_model(), _batch()[0])
    assert str(err.value) == _step.NO_LOSS


def test_profile_step_measures_a_step_and_the_planner_uses_it() -> None:
    """The planner's step is a :class:`Step`; with an optimizer, ``backward`` (what
    ``profile_step`` calls) keeps nothing: it drops the loss before the optimizer steps;
    the profiled steps train the model (which is why the planner steps a copy), and leave
    no gradient."""
    assert train.PerLayerOptimizer is _step.PerLayerOptimizer
    x, loss_fn = _batch()
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = _step.Step(leangrad.engine("backprop"), _adam, per_layer=True)
    assert step.backward(_model(), x, loss_fn) is None
    prof = profile_step(step.fresh(), model, x, loss_fn, repeats=0)
    assert prof.engine == "backprop" + _step.PER_LAYER and prof.peak_bytes > 0
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


class _Halving:
    """A stand-in reducer (one process has nothing to combine): it halves each gradient it
    is handed, as an average over two processes whose other half is zero would, records the
    order, and passes the parameter on to ``then``."""

    def __init__(self, then: Callable[[str, nn.Parameter], None] | None) -> None:
        self.then, self.seen, self.finished = then, [], []  # type: ignore[var-annotated]

    def on_grad(self, name: str, p: nn.Parameter) -> None:
        self.seen.append(name)
        assert p.grad is not None
        p.grad.mul_(0.5)
        if self.then is not None:
            self.then(name, p)

    def finish(self, params=()) -> None:  # type: ignore[no-untyped-def]
        for name, p in params:
            self.finished.append(name)
            if p.grad is not None and name not in self.seen:
                self.on_grad(name, p)


@pytest.mark.parametrize("per_layer", [False, True], ids=["whole", "per-layer"])
@pytest.mark.parametrize("engine", ["backprop", "checkpoint"])
def test_a_reducer_sees_every_gradient_before_the_optimizer(engine: str, per_layer: bool) -> None:
    """``Step(reduce=...)``: the engine hands each gradient to the reducer, whose ``finish``
    gets every trainable parameter, and the optimizer steps on what it left: equal to a
    hand-written loop on half the loss."""
    made: list[_Halving] = []

    def reduce(then: Callable[[str, nn.Parameter], None] | None) -> _Halving:
        made.append(_Halving(then))
        return made[-1]

    x, loss_fn = _batch()
    model = _model()
    step = _step.Step(leangrad.engine(engine), _sgd, per_layer=per_layer, reduce=reduce)
    for _ in range(STEPS):
        step.run(model, x, loss=loss_fn)
    ref = _model()  # SGD on half the loss: the halved gradients, stepped
    opt = _sgd(list(ref.parameters()))
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        (0.5 * loss_fn(ref(x))).backward()
        opt.step()
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    [reducer] = made  # made once, with the optimizer, and kept across steps
    names = [n for n, _ in model.named_parameters()]
    assert reducer.finished == names * STEPS
    assert sorted(set(reducer.seen)) == sorted(names)
    assert all(p.grad is None for p in model.parameters())


def test_optimizer_for_makes_the_optimizer_before_the_first_step() -> None:
    model = _model()
    step = _step.Step(leangrad.engine("backprop"), _adam, per_layer=True)
    opt = step.optimizer_for(model)
    assert isinstance(opt, _step.PerLayerOptimizer) and step.made is opt
    x, loss_fn = _batch()
    step.run(model, x, loss=loss_fn)
    assert step.made is opt  # the same one stepped
