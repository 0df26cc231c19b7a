"""Tied weights: GPT-2 ties its output layer to its token embedding. The zoo's
GPT with ``head.weight`` tied to ``tok.weight`` runs exactly under every engine that takes
any module, and under ``plan``; the tie survives the step and its gradient lands once, on
the user's Parameter, with ``on_grad`` called once per parameter with its final value.

Tolerance: exact engines 1e-10 relative in float64 (they differ in summation order only).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import leangrad
from leangrad import zoo
from leangrad.engines import engine_class

TOL = 1e-10


def _tied_gpt() -> tuple[nn.Module, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    torch.manual_seed(0)
    model = zoo.gpt(vocab=40, dim=16, layers=2, heads=2, context=16).double()
    model.head.weight = model.tok.weight
    x, loss_fn = zoo.batch("gpt", model, 3, length=8)
    return model, x, loss_fn


def _autograd(model: nn.Module, x: torch.Tensor, loss_fn: Callable) -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _any_module_engines() -> list[str]:
    model, _, _ = _tied_gpt()
    return [n for n in leangrad.available() if leangrad.engine(n).supports(model) is None]


@pytest.mark.slow
@pytest.mark.parametrize("name", _any_module_engines())
def test_tied_gpt_under_every_engine(name: str) -> None:
    model, x, loss_fn = _tied_gpt()
    want = _autograd(model, x, loss_fn)
    calls: dict[str, list[torch.Tensor]] = {}

    def on_grad(n: str, p: nn.Parameter) -> None:
        assert p.grad is not None
        calls.setdefault(n, []).append(p.grad.clone())

    leangrad.engine(name).backward(model, x, loss_fn, on_grad=on_grad)
    assert model.head.weight is model.tok.weight, "the tie must survive the step"
    assert isinstance(model.tok.weight, nn.Parameter)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(calls) == sorted(names)
    assert all(len(v) == 1 for v in calls.values()), {n: len(v) for n, v in calls.items()}
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        assert torch.equal(calls[n][0], p.grad), f"{n}: on_grad saw a partial gradient"
        if engine_class(name).exact:
            assert _rel(p.grad, want[n]) <= TOL, (n, _rel(p.grad, want[n]))


@pytest.mark.slow
def test_tied_gpt_under_plan() -> None:
    model, x, loss_fn = _tied_gpt()
    want = _autograd(model, x, loss_fn)
    free = leangrad.plan(model, x, loss_fn, budget=2**40, repeats=1)
    assert free.engine is not None and free.peak_bytes is not None
    # a budget just under the unconstrained choice's peak forces a leaner candidate
    tight = leangrad.plan(model, x, loss_fn, budget=free.peak_bytes - 1, repeats=1)
    assert model.head.weight is model.tok.weight
    assert all(p.grad is None for p in model.parameters()), "plan leaves .grad as it was"
    for chosen in (free, tight):
        if chosen.engine is None:
            continue
        m = copy.deepcopy(model)
        chosen.engine.backward(m, x, loss_fn)
        assert m.head.weight is m.tok.weight
        for n, p in m.named_parameters():
            assert p.grad is not None and _rel(p.grad, want[n]) <= TOL, n
    assert tight.engine is not None, tight.message


@pytest.mark.parametrize(
    "options",
    [{"levels": 2}, {"fragments": 2}, {"levels": 2, "fragments": 2},
     {"sequence_fragments": 2}, {"fragments": 2, "trace": True}],
    ids=str,
)  # fmt: skip
def test_tied_gpt_under_fragments_and_two_levels(options: dict[str, object]) -> None:
    """The recomputation options on the tied GPT: exact, the tie kept, one gradient."""
    model, x, loss_fn = _tied_gpt()
    want = _autograd(model, x, loss_fn)
    leangrad.engine("checkpoint", **options).backward(model, x, loss_fn)
    assert model.head.weight is model.tok.weight, "the tie must survive the step"
    for n, p in model.named_parameters():
        assert p.grad is not None and _rel(p.grad, want[n]) <= TOL, (n, options)
