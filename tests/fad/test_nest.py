"""Tests of fad.nest, the torch.fx pass (paper section III-B): which sub-graphs it fuses,
that gradients equal autograd's (float64, 1e-12), what it saves, and its errors/fallbacks."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fad_cases as cases
import leangrad.fad as fad
from fad_chains import random_chain
from leangrad.measure import saved_tensor_bytes


def grads_of(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    loss = model(x).square().sum()
    return list(torch.autograd.grad(loss, [*model.parameters(), x]))


def assert_same_grads(model: nn.Module, nested: nn.Module, x: torch.Tensor, what: str = "") -> None:
    ref, got = grads_of(model, x), grads_of(nested, x)
    assert len(ref) == len(got)
    for a, b in zip(got, ref, strict=True):
        assert cases.rel(a, b) < 1e-12, what


@pytest.mark.parametrize("seed", range(16))
def test_random_chains_nest(seed: int) -> None:
    chain = random_chain(seed + 100, length=8)
    torch.manual_seed(seed)
    model = cases.Head(chain.fn, chain.outputs).double()
    nested = fad.nest(model)
    fused = [r for r in nested.fad_regions if r.name is not None]
    assert fused, chain.text
    assert_same_grads(model, nested, torch.randn(4, 5, dtype=torch.float64), chain.text)


def test_branches_multiple_consumers_inplace_noncontiguous() -> None:
    torch.manual_seed(0)
    model = cases.Branchy().double()
    nested = fad.nest(model, builtins=False)  # every chain nested (gelu_tanh is F.gelu's)
    fused = {r.source: r for r in nested.fad_regions if r.name is not None}
    assert set(fused) == {"conv", "transpose"}
    assert fused["conv"].outputs == 2  # c (into the two-source product) and a (into f + a)
    assert "softplus" in fused["conv"].ops and "mul" in fused["conv"].ops
    assert len(fad.fused_chains(nested)) == 2
    assert_same_grads(model, nested, torch.randn(3, 2, 5, 5, dtype=torch.float64))
    # the two-source product stays: its sigmoid is a lone primitive left to autograd
    assert any(r.skipped and r.ops == ("sigmoid",) for r in nested.fad_regions)


@pytest.mark.parametrize(
    ("act", "eager_tensors"),
    [(cases.swish, 2), (lambda h: h * torch.tanh(F.softplus(h)), 2), (cases.gelu_tanh, 4)],
)
def test_nest_saves_one_tensor_per_chain(act, eager_tensors: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = cases.Acts(act)
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


@pytest.mark.parametrize("make", [cases.WritesSource, cases.InPlaceModuleBetween])
def test_chain_with_a_write_in_between_is_left_to_autograd(make) -> None:  # type: ignore[no-untyped-def]
    model = make().double()
    nested = fad.nest(model)
    (region,) = nested.fad_regions
    assert region.name is None
    assert region.skipped == "another node may write in place while the chain runs"
    assert_same_grads(model, nested, torch.randn(2, 3, dtype=torch.float64))


def test_untraceable_model_points_to_eager_mode() -> None:
    with pytest.raises(fad.FadTraceError) as info:
        fad.nest(cases.DataDependent())
    msg = str(info.value)
    assert msg.startswith("fad.nest: torch.fx cannot trace DataDependent (")
    assert "`with leangrad.fad.nested(): loss = loss_fn(model(x))`" in msg
    with pytest.raises(fad.FadTraceError, match="'Proxy' object does not support item assign"):
        fad.nest(cases.ResidualInPlace())


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
    assert cases.rel(g, gr) < 1e-12


def test_no_warning_for_float_chains() -> None:
    nested = fad.nest(cases.Acts(cases.swish))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nested(torch.randn(2, 16)).sum().backward()


def test_inplace_write_into_chain_output() -> None:
    model = cases.ResidualInPlace(setitem=False).double()
    nested = fad.nest(model)
    assert any(r.name is not None for r in nested.fad_regions)
    assert_same_grads(model, nested, torch.randn(3, 4, dtype=torch.float64))


class _Act(nn.Module):
    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.lin, self.fn = nn.Linear(6, 6), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.lin(x))


_SQ2PI = math.sqrt(2 / math.pi)


@pytest.mark.parametrize(
    ("fn", "builtin"),
    [
        (lambda h: h * torch.sigmoid(h), "F.silu"),
        (lambda h: torch.sigmoid(h) * h, "F.silu"),
        (lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2))), "F.gelu"),
        (
            lambda h: h * 0.5 * (1.0 + torch.tanh(_SQ2PI * (h + 0.044715 * h**3))),
            "F.gelu(approximate='tanh')",
        ),
        (lambda h: h * torch.tanh(F.softplus(h)), None),  # Mish: FAD beats PyTorch's CPU Mish
        (lambda h: torch.relu(h) * torch.sigmoid(h), None),  # equals silu for h > 0 only
        (lambda h: h * torch.sigmoid(1.001 * h), None),  # close to silu, not silu
    ],
)
def test_chains_that_are_a_builtin_run_by_it(fn, builtin) -> None:  # type: ignore[no-untyped-def]
    """A chain computing exactly PyTorch's fused kernel calls it (same bytes, faster); every
    other chain is nested; gradients equal autograd's either way (float64)."""
    torch.manual_seed(0)
    model = _Act(fn).double()
    nested = fad.nest(model)
    (region,) = [r for r in nested.fad_regions if r.skipped is None]
    assert region.builtin == builtin
    assert (region.name is None) == (builtin is not None)
    assert len(fad.fused_chains(nested)) == (0 if builtin else 1)
    assert_same_grads(model, nested, torch.randn(5, 6, dtype=torch.float64))
    kept = fad.nest(model, builtins=False)
    assert all(r.builtin is None for r in kept.fad_regions) and fad.fused_chains(kept)
