"""The contract of every engine: ``engine.backward(model, inputs, loss_fn)`` leaves the
model, its buffers, the RNG streams, the inputs and every ``.grad`` exactly as
``loss_fn(model(*inputs)).backward()`` would — or raises an error naming the condition.

One parametrized test over every registered engine (and its option variants) × every
model it supports, each model in training mode with BatchNorm running statistics, dropout
and a parameter the loss never uses. A new engine gets this test for free: it is listed
by ``leangrad.available()``.

Tolerances: exact engines 1e-10 relative (float64; they differ only in summation order);
buffers to 1e-12 (counters exactly: one update per step) and RNG states exactly.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import _errors as E
from leangrad import models
from leangrad.engines import engine_class
from leangrad.highway import GRULayer, HighwayNet
from leangrad.layers import AdditiveCoupling, LeakyReLU, SpaceToDepth, Tanh

DT = torch.float64
TOL = 1e-10

# Option variants worth a contract check of their own (different code paths).
VARIANTS: dict[str, list[dict[str, object]]] = {
    "checkpoint": [{}, {"segments": 2}],
    "forward": [{"chunk_size": 7}],
    "projforward": [{"samples": 3, "chunk_size": 2, "seed": 0}],
    "moonwalk": [
        {},
        {"segments": 2},
        {"mode": "pure", "chunk_size": 7},
        {"stem_chunks": 1},
        {"fragment": "full"},
    ],
    "highway": [{"k": 10}],  # k >= L - 1: exact (Theorem 2)
}


def _stem() -> nn.Module:
    """A stem with a trainable conv, training-mode BatchNorm and dropout."""
    return nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.Dropout(0.25))


def _generic() -> tuple[nn.Module, tuple[int, ...]]:
    m = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3),
    )  # fmt: skip
    return m, (5, 4)


def _subcnn() -> tuple[nn.Module, tuple[int, ...]]:
    m = models.submersive_cnn(2, 3, depth=2, classes=3)
    m.stem = _stem()
    return m, (3, 2, 8, 8)


def _subcnn_paramfree_stem() -> tuple[nn.Module, tuple[int, ...]]:
    """Moonwalk's h1-seed path: a stem without trainable parameters (but with statistics)."""
    m = models.submersive_cnn(2, 3, depth=2, classes=3)
    m.stem = nn.Sequential(models.RepeatChannels(3), nn.BatchNorm2d(3, affine=False))
    return m, (3, 2, 8, 8)


def _revchain() -> tuple[nn.Module, tuple[int, ...]]:
    def f() -> nn.Module:
        return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 2, 1))

    m = leangrad.Chain(
        AdditiveCoupling(f()), LeakyReLU(0.2), SpaceToDepth(2),
        AdditiveCoupling(nn.Sequential(nn.Conv2d(8, 8, 1), nn.Tanh())), Tanh(),
        stem=nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4), nn.Dropout(0.25)),
        head=nn.Sequential(nn.Flatten(), nn.Linear(16 * 2 * 2, 3)),
    )  # fmt: skip
    return m, (3, 2, 4, 4)


class _StepHead(nn.Module):
    """Read a GRU at every step: (steps, batch, H) -> (steps * batch, classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h).flatten(0, 1)


def _highway() -> tuple[nn.Module, tuple[int, ...]]:
    stem = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.25))
    return HighwayNet(stem, [GRULayer(5, 5)], _StepHead()), (6, 2, 4)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[int, ...]]]] = {
    "generic": _generic,
    "subcnn": _subcnn,
    "subcnn_paramfree_stem": _subcnn_paramfree_stem,
    "revchain": _revchain,
    "highway": _highway,
}


def _build(kind: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, Callable]:  # type: ignore[type-arg]
    torch.manual_seed(seed)
    model, shape = MODELS[kind]()
    model = model.to(DT).train()
    # A parameter the loss never uses: autograd leaves its .grad None.
    model.register_parameter("unused", nn.Parameter(torch.randn(3, dtype=DT)))
    x = torch.randn(*shape, dtype=DT)
    n_out = x.shape[0] * (x.shape[1] if kind == "highway" else 1)
    y = torch.randint(0, 3, (n_out,))
    return model, x, lambda out: F.cross_entropy(out, y)


def _configs() -> list[object]:
    out = []
    for name in leangrad.available():
        for opts in VARIANTS.get(name, [{}]):
            for kind in MODELS:
                model, _, _ = _build(kind)
                if leangrad.engine(name, **opts).supports(model) is None:
                    label = ",".join(f"{k}={v}" for k, v in opts.items())
                    out.append(pytest.param(name, opts, kind, id=f"{name}({label})-{kind}"))
    return out


CONFIGS = _configs()


def test_every_engine_has_a_contract_case() -> None:
    assert {p.values[0] for p in CONFIGS} == set(leangrad.available())


def _exact(name: str, opts: dict[str, object]) -> bool:
    return engine_class(name).exact or (name == "highway" and opts.get("k", 0) >= 5)


def _reference(model: nn.Module, x: torch.Tensor, loss_fn: Callable, seed: int):  # type: ignore[no-untyped-def, type-arg]
    """What plain autograd does: grads (None kept), buffers, RNG state, input grad."""
    torch.manual_seed(seed)
    loss = loss_fn(model(x))
    loss.backward()
    return (
        {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        {n: b.clone() for n, b in model.named_buffers()},
        torch.get_rng_state(),
        None if x.grad is None else x.grad.clone(),
    )


def _prefill(model: nn.Module) -> None:
    """One used parameter starts with a gradient (accumulation), the rest with None."""
    first = next(model.parameters())
    first.grad = torch.full_like(first, 0.5)


@pytest.mark.parametrize(("name", "opts", "kind"), CONFIGS)
@pytest.mark.parametrize("input_grad", [False, True], ids=["x", "x_requires_grad"])
def test_engine_keeps_the_backward_contract(
    name: str, opts: dict[str, object], kind: str, input_grad: bool
) -> None:
    model, x, loss_fn = _build(kind)
    ref_model = copy.deepcopy(model)
    _prefill(model)
    _prefill(ref_model)
    xr = x.clone().requires_grad_(input_grad)
    ref_grads, ref_bufs, ref_rng, ref_xgrad = _reference(ref_model, xr, loss_fn, seed=7)

    xe = x.clone().requires_grad_(input_grad)
    eng = leangrad.engine(name, **opts)
    torch.manual_seed(7)
    if input_grad and not eng.input_gradients:
        with pytest.raises(E.EngineInputError, match="input gradient"):
            eng.backward(model, xe, loss_fn)
        return
    eng.backward(model, xe, loss_fn)

    for n, p in model.named_parameters():
        ref = ref_grads[n]
        assert (p.grad is None) == (ref is None), f"{n}: .grad None-ness differs from autograd"
        if ref is not None and _exact(name, opts):
            torch.testing.assert_close(p.grad, ref, rtol=TOL, atol=TOL, msg=n)
    for n, b in model.named_buffers():
        # Integer counters equal; statistics equal up to the reduction order of a
        # vmapped forward (forward-mode engines), ~1e-16.
        torch.testing.assert_close(b, ref_bufs[n], rtol=1e-12, atol=1e-14, msg=n)
    assert torch.equal(torch.get_rng_state(), ref_rng), "the RNG stream advanced differently"
    if input_grad:
        assert xe.grad is not None, "an input with requires_grad=True got no .grad"
        if _exact(name, opts):
            torch.testing.assert_close(xe.grad, ref_xgrad, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(("name", "opts", "kind"), CONFIGS)
@pytest.mark.parametrize(
    "loss_fn",
    [lambda out: out.detach().sum(), lambda out: torch.tensor(1.0, dtype=DT)],
    ids=["detached", "constant"],
)
def test_loss_independent_of_the_model_raises(
    name: str, opts: dict[str, object], kind: str, loss_fn: Callable  # type: ignore[type-arg]
) -> None:
    """The same error, for every engine, and nothing written to any .grad or buffer."""
    model, x, _ = _build(kind)
    bufs = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.raises(E.EngineInputError, match=re.escape(E.LOSS_NO_GRAD)):
        leangrad.engine(name, **opts).backward(model, x, loss_fn)
    assert all(p.grad is None for p in model.parameters())
    del bufs  # buffers may have advanced: the forward ran before the loss was seen


@pytest.mark.parametrize(("name", "opts", "kind"), CONFIGS)
def test_empty_batch_is_refused(name: str, opts: dict[str, object], kind: str) -> None:
    model, x, loss_fn = _build(kind)
    empty = x[:, :0] if kind == "highway" else x[:0]
    with pytest.raises(E.EngineInputError, match="empty batch"):
        leangrad.engine(name, **opts).backward(model, empty, loss_fn)
