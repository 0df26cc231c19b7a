"""The plan calls exact only what it re-checked on the user's model: one step of the chosen
engine beside ``loss.backward()`` (:mod:`leangrad.planner._verify`). A row whose step differs
is shown ``inexact: <why>`` and never chosen under ``exact=True``."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad.measure import profile_step
from leangrad.planner._verify import exact_why


class _Flip(nn.Module):
    """A block whose forward depends on how often it ran since the model's forward began:
    a recomputation (checkpointing) runs it a second time, with the other sign — no probe
    of leangrad's sees it, only the gradient does."""

    def __init__(self, dim: int, flip: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.calls = 0
        self.flip = flip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        sign = -1.0 if self.flip and self.calls > 1 else 1.0
        return x + torch.tanh(self.lin(x)) * sign


class _Net(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 12, flip: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Flip(dim, flip) for _ in range(depth))
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            b.calls = 0
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _data(flip: bool = True) -> tuple[_Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(1024, 32, dtype=torch.float64)
    return _Net(flip=flip).double(), x, torch.randint(0, 2, (1024,))


def test_exact_why_names_what_differs_and_leaves_the_model_as_it_was() -> None:
    model, x, y = _data()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    why = exact_why(leangrad.engine("checkpoint"), model, (x,), lambda o: F.cross_entropy(o, y))
    assert why is not None and why.startswith("the gradient of blocks.0.lin.weight differs")
    assert exact_why(leangrad.engine("backprop"), model, (x,),
                     lambda o: F.cross_entropy(o, y)) is None  # fmt: skip
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    for n, v in model.state_dict().items():
        assert torch.equal(v, before[n]), n


def test_a_row_that_fails_the_check_is_inexact_and_not_chosen() -> None:
    model, x, y = _data()

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    full = profile_step(leangrad.engine("backprop"), model, x, loss_fn, repeats=0).total_bytes
    plan = leangrad.plan(model, x, loss_fn, budget=int(0.8 * full), repeats=1,
                         engines=[("backprop", {}), ("checkpoint", {})])  # fmt: skip
    row = next(c for c in plan.table if c.label == "checkpoint")
    assert row.verdict.startswith("inexact: the gradient of blocks.0.lin.weight differs")
    assert plan.engine is None  # backprop is over budget, and nothing else is exact here
    assert "1 fitting row(s) did not leave what loss.backward() leaves" in plan.message


def test_a_chosen_engine_that_passes_says_it_was_rechecked() -> None:
    model, x, y = _data(flip=False)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    full = profile_step(leangrad.engine("backprop"), model, x, loss_fn, repeats=0).total_bytes
    plan = leangrad.plan(model, x, loss_fn, budget=int(0.8 * full), repeats=1,
                         engines=[("backprop", {}), ("checkpoint", {})])  # fmt: skip
    assert plan.engine is not None and plan.engine.label == "checkpoint"
    assert "re-checked against loss.backward() on this model" in plan.message
