"""Small models that reach one module by more than one path, shared by the engine tests of
shared use, fragments on shared modules and aliased blocks (one home for each model)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from leangrad import zoo


class CallsTwice(nn.Module):
    """Written the ordinary way, calling one submodule twice, no repeated container: the fx
    graph split finds its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        x = torch.tanh(self.b(x))
        x = torch.sin(torch.tanh(self.a(x)) * 2)
        return self.c(x)


class SharedMLP(nn.Module):
    """The tied GPT (output layer = token embedding) whose second block holds the first
    one's MLP, which also runs once more after the blocks (outside every block) under the
    name ``extra``."""

    def __init__(self, dt: torch.dtype = torch.float64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g = zoo.gpt(vocab=12, dim=8, layers=3, heads=2, context=8).to(dt)
        self.g.head.weight = self.g.tok.weight
        self.g.blocks[1].mlp = self.g.blocks[0].mlp
        self.extra = self.g.blocks[0].mlp

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        g = self.g
        x = g.tok(idx) + g.pos[: idx.shape[1]]
        for block in g.blocks:
            x = block(x)
        return g.head(g.ln_f(x + self.extra(x)))


class SharedList(nn.Module):
    """A ModuleList holding one block twice (``block``, ``other``, ``block``), run twice
    through a second name for the whole list (``again``), then a Linear head."""

    def __init__(self, block: nn.Module, other: nn.Module, width: int, classes: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([block, other, block])
        self.again = self.layers
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in [*self.layers, *self.again]:
            x = layer(x)
        return self.head(x)


def beside_autograd(model: nn.Module, x: torch.Tensor,
                    loss_fn: Callable[[torch.Tensor], torch.Tensor], step: Callable[[], Any],
                    ) -> tuple[Any, torch.Tensor, nn.Module]:  # fmt: skip
    """``step()`` (an engine's backward on ``model``) beside ``loss_fn(model(x)).backward()``
    on a deep copy (which keeps the sharing), both from RNG seed 0; asserts the user's
    Parameters and module tree are left as they were (no stand-in, no swapped module).
    Returns the step's result, autograd's loss, and the copy (its ``.grad`` and buffers
    are autograd's)."""
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)
    torch.manual_seed(0)
    want_loss = loss_fn(ref(x))
    want_loss.backward()
    params = [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)]
    mods = [(n, id(m)) for n, m in model.named_modules(remove_duplicate=False)]
    torch.manual_seed(0)
    res = step()
    assert [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)] == params
    assert [(n, id(m)) for n, m in model.named_modules(remove_duplicate=False)] == mods
    assert all(type(p) is nn.Parameter for p in model.parameters()), "a stand-in was left"
    return res, want_loss, ref


def tiny_gpt_step() -> tuple[nn.Module, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """The planner tests' GPT (4 layers, width 32, 4 × 32 tokens) and its loss, seeded."""
    torch.manual_seed(0)
    model = zoo.gpt(vocab=32, dim=32, layers=4, heads=2, context=32)
    idx = torch.randint(0, 32, (4, 32))
    tgt = torch.randint(0, 32, (4, 32))
    return model, idx, lambda out: zoo.GPT.loss(out, tgt)
