"""Tests of fad.nest, the torch.fx pass (paper section III-B): which sub-graphs it fuses,
that gradients equal autograd's (float64, 1e-12), what it saves, and its errors/fallbacks."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad.fad as fad
from leangrad.fad._testing import random_chain
from leangrad.measure import saved_tensor_bytes


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


def grads_of(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    loss = model(x).square().sum()
    return list(torch.autograd.grad(loss, [*model.parameters(), x]))


def assert_same_grads(model: nn.Module, nested: nn.Module, x: torch.Tensor, what: str = "") -> None:
    ref, got = grads_of(model, x), grads_of(nested, x)
    assert len(ref) == len(got)
    for a, b in zip(got, ref, strict=True):
        assert rel(a, b) < 1e-12, what


@pytest.mark.parametrize("seed", range(16))
def test_random_chains_nest(seed: int) -> None:
    chain = random_chain(seed + 100, length=8)
    torch.manual_seed(seed)
    model = Head(chain.fn, chain.outputs).double()
    nested = fad.nest(model)
    fused = [r for r in nested.fad_regions if r.name is not None]
    assert fused, chain.text
    assert_same_grads(model, nested, torch.randn(4, 5, dtype=torch.float64), chain.text)


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


def test_branches_multiple_consumers_inplace_noncontiguous() -> None:
    torch.manual_seed(0)
    model = Branchy().double()
    nested = fad.nest(model)
    fused = {r.source: r for r in nested.fad_regions if r.name is not None}
    assert set(fused) == {"conv", "transpose"}
    assert fused["conv"].outputs == 2  # c (into the two-source product) and a (into f + a)
    assert "softplus" in fused["conv"].ops and "mul" in fused["conv"].ops
    assert len(fad.fused_chains(nested)) == 2
    assert_same_grads(model, nested, torch.randn(3, 2, 5, 5, dtype=torch.float64))
    # the two-source product stays: its sigmoid is a lone primitive left to autograd
    assert any(r.skipped and r.ops == ("sigmoid",) for r in nested.fad_regions)


class Acts(nn.Module):
    def __init__(self, act) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.lin1, self.lin2, self.act = nn.Linear(16, 32), nn.Linear(32, 4), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.act(self.lin1(x)))


@pytest.mark.parametrize(
    ("act", "eager_tensors"),
    [(swish, 2), (lambda h: h * torch.tanh(F.softplus(h)), 2), (gelu_tanh, 4)],
)
def test_nest_saves_one_tensor_per_chain(act, eager_tensors: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Acts(act)
    nested = fad.nest(model)
    x = torch.randn(64, 16)
    one = 64 * 32 * 4
    counts = []
    for m in (model, nested):
        with saved_tensor_bytes(x, *m.parameters()) as s:
            out = m(x)
        counts.append(s.bytes)
        del out
    # both save lin2's input (the activation output); eager adds its intermediates
    assert counts[0] == (eager_tensors + 1) * one
    assert counts[1] == (1 + 1) * one


def test_nest_maps_activation_modules() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Softplus(beta=2.0), nn.Tanh(), nn.Linear(4, 2))
    nested = fad.nest(model.double())
    (region,) = nested.fad_regions
    assert region.ops == ("softplus", "tanh") and region.name is not None
    assert_same_grads(model, nested, torch.randn(3, 4, dtype=torch.float64))


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


@pytest.mark.parametrize("make", [WritesSource, InPlaceModuleBetween])
def test_chain_with_a_write_in_between_is_left_to_autograd(make) -> None:  # type: ignore[no-untyped-def]
    model = make().double()
    nested = fad.nest(model)
    (region,) = nested.fad_regions
    assert region.name is None
    assert region.skipped == "another node may write in place while the chain runs"
    assert_same_grads(model, nested, torch.randn(2, 3, dtype=torch.float64))


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return swish(x)
        return x


def test_untraceable_model_points_to_eager_mode() -> None:
    with pytest.raises(fad.FadTraceError) as info:
        fad.nest(DataDependent())
    msg = str(info.value)
    assert msg.startswith("fad.nest: torch.fx cannot trace DataDependent (")
    assert "`with leangrad.fad.nested(): loss = loss_fn(model(x))`" in msg
    with pytest.raises(fad.FadTraceError, match="'Proxy' object does not support item assign"):
        fad.nest(ResidualInPlace())


class ComplexChain(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return (z * torch.exp(z)).abs()


def test_dtype_without_rule_falls_back_with_warning() -> None:
    nested = fad.nest(ComplexChain())
    z = torch.randn(5, dtype=torch.complex128, requires_grad=True)
    msg = (r"fad: the element-wise chain \['exp', 'mul', 'abs'\] cannot be nested "
           r"\(no forward-mode rule for dtype torch.complex128\)")  # fmt: skip
    with pytest.warns(UserWarning, match=msg):
        (g,) = torch.autograd.grad(nested(z).sum(), z)
    (gr,) = torch.autograd.grad(ComplexChain()(z).sum(), z)
    assert rel(g, gr) < 1e-12


def test_no_warning_for_float_chains() -> None:
    nested = fad.nest(Acts(swish))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nested(torch.randn(2, 16)).sum().backward()


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


def test_inplace_write_into_chain_output() -> None:
    model = ResidualInPlace(setitem=False).double()
    nested = fad.nest(model)
    assert any(r.name is not None for r in nested.fad_regions)
    assert_same_grads(model, nested, torch.randn(3, 4, dtype=torch.float64))
