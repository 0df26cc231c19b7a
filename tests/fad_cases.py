"""Models and helpers shared by the fad tests (tests/fad/): element-wise chains written
the ordinary way."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Double(torch.autograd.Function):
    """x * 2 as a custom Function: an op the nested mode cannot see."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def,override]
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def,override]
        return g * 2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    return err / scale if scale > 0 else err


class Head(nn.Module):
    """Linear -> fn -> one Linear per output of fn, summed."""

    def __init__(self, fn, outputs: int = 1, width: int = 6) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.fn = fn
        self.inp = nn.Linear(5, width)
        self.outs = nn.ModuleList(nn.Linear(width, 3) for _ in range(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys = self.fn(self.inp(x))
        ys = ys if isinstance(ys, tuple) else (ys,)
        total = self.outs[0](ys[0])
        for lin, y in zip(self.outs[1:], ys[1:], strict=True):
            total = total + lin(y)
        return total


def swish(h: torch.Tensor) -> torch.Tensor:
    return h * torch.sigmoid(h)


def gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h.pow(3))))


class Branchy(nn.Module):
    """Two chains off one conv (multiple consumers of chain values), a two-source product
    that must stay with autograd, an in-place op inside a chain, a non-contiguous source."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.lin = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        a = swish(h)  # chain 1 (source h) ...
        b = torch.tanh(F.softplus(h))  # ... same source: joins chain 1
        c = a * b
        c.mul_(0.5)
        d = h.transpose(2, 3)  # non-contiguous source of chain 2
        e = gelu_tanh(d).transpose(2, 3)
        f = c * torch.sigmoid(e)  # two sources: c and e
        return self.lin((f + a).flatten(1))


class Acts(nn.Module):
    def __init__(self, act) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.lin1, self.lin2, self.act = nn.Linear(16, 32), nn.Linear(32, 4), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.act(self.lin1(x)))


class WritesSource(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        s = torch.sigmoid(h)
        h.mul_(2.0)  # written between the chain's two ops: the chain may not run early
        return (s * h).sum(1)


class InPlaceModuleBetween(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.relu = nn.Linear(3, 3), nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        s = torch.sigmoid(h)
        self.relu(h)  # an in-place module writes the source between the chain's ops
        return (s * h).sum(1)


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return swish(x)
        return x


class Untraceable(nn.Module):
    """A Linear, then swish only where the sum is positive: control flow on the data,
    which torch.fx cannot trace."""

    def __init__(self, features: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(features, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return swish(h) if h.sum() > 0 else h


class Lambda(nn.Module):
    """A module calling ``fn`` on its input."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class ResidualInPlace(nn.Module):
    """An nfad in-place op writing into a chain's output (``y += other``), then more chain."""

    def __init__(self, *, setitem: bool = True) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.setitem = setitem  # fx cannot trace item assignment

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = swish(self.a(x))
        y += self.b(x)
        if self.setitem:
            y[:, 0] = 0.0
        return self.c(torch.tanh(y) * y)
