"""Adding an engine is one module plus its registration: an engine defined here
alone, registered, is made by ``leangrad.engine``, keeps the contract of every engine
(tests/engines/test_contract.py), is among the planner's candidates through its own
``plan_candidates`` and is printed by ``leangrad.explain`` — with no other change."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad.engines._base import Engine, LossFn, OnGrad, PlanOffer, StepResult, forward_loss
from leangrad.engines._blocks import Blocks
from leangrad.engines._catalog import register, unregister
from leangrad.loss import per_example
from leangrad.planner._plan import candidates

from .test_contract import MODELS, check_backward_contract

NAME = "test_two_pass"
LINE = "test_two_pass: the loss's gradient by torch.autograd.grad, then written to .grad"


class TwoPass(Engine):
    """Autograd's gradients taken with ``torch.autograd.grad`` and written to ``.grad``
    afterwards (``on_grad`` once per parameter that got one)."""

    exact = True

    def __init__(self, *, retain: bool = False) -> None:
        super().__init__(retain=retain)
        self.retain = retain

    @classmethod
    def plan_candidates(cls, model: nn.Module, *, found: Blocks | None,
                        loss_fn: Callable[[Any], torch.Tensor] | None,
                        exact: bool) -> list[PlanOffer]:  # fmt: skip
        del model, found, loss_fn, exact
        return [PlanOffer(NAME, {}), PlanOffer(NAME, {"retain": True})]

    def explain_lines(self, model: nn.Module) -> list[str]:
        del model
        return [LINE]

    def _backward(self, model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: LossFn,
                  params: dict[str, nn.Parameter],
                  on_grad: OnGrad | None) -> StepResult:  # fmt: skip
        loss = forward_loss(self.label, model, inputs, loss_fn)
        leaves = list(params.values()) + [x for x in inputs if x.requires_grad]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, retain_graph=self.retain)
        for leaf, g in zip(leaves, grads, strict=True):
            if g is not None:
                leaf.grad = g if leaf.grad is None else leaf.grad + g
        if on_grad is not None:
            for name, p in params.items():
                if p.grad is not None:
                    on_grad(name, p)
        return self._result(loss)


@pytest.fixture
def registered() -> Iterator[type[Engine]]:
    cls = register(NAME)(TwoPass)
    try:
        yield cls
    finally:
        unregister(NAME)


@pytest.mark.usefixtures("registered")
def test_it_is_made_by_name_and_listed() -> None:
    eng = leangrad.engine(NAME, retain=True)
    assert isinstance(eng, TwoPass)
    assert eng.label == f"{NAME}(retain=True)"
    assert NAME in leangrad.available(exact=True)


@pytest.mark.usefixtures("registered")
@pytest.mark.parametrize("kind", ["generic", "subcnn", "revchain"])
@pytest.mark.parametrize("input_grad", [False, True])
def test_it_keeps_the_contract(kind: str, input_grad: bool) -> None:
    assert kind in MODELS
    check_backward_contract(NAME, {}, kind, input_grad=input_grad)


@pytest.mark.usefixtures("registered")
def test_it_is_among_the_planners_candidates() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    loss = per_example(F.cross_entropy, torch.zeros(2, dtype=torch.long))
    for exact in (True, False):
        got = candidates(model, exact=exact, loss_fn=loss)
        assert (NAME, {}) in got and (NAME, {"retain": True}) in got
        # an engine that names no place goes after the exact engines, before estimators
        names = [n for n, _ in got]
        assert names.index(NAME) > names.index("checkpoint")
        if not exact:
            assert names.index(NAME) < names.index("rad")


@pytest.mark.usefixtures("registered")
def test_explain_prints_it() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    text = str(leangrad.explain(NAME, model))
    assert text.splitlines() == [f"engine {NAME}", LINE]


def test_unregistered_at_teardown() -> None:
    assert NAME not in leangrad.available()
    with pytest.raises(leangrad.UnknownNameError, match=NAME):
        leangrad.engine(NAME)
