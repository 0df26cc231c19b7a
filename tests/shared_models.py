"""Small models that reach one module by more than one path, shared by the engine tests of
shared use, fragments on shared modules and aliased blocks (one home for each model)."""

from __future__ import annotations

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
