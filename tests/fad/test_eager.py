"""Tests of fad.nested, the eager mode (paper section IV): the state machine's sequence of
states, gradients equal to autograd's (float64, 1e-12), what is saved, fallbacks, and that a
fad tensor escaping the mode fails loudly instead of giving a wrong gradient."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad.fad as fad
from fad_cases import (
    Acts,
    Branchy,
    DataDependent,
    Double,
    Head,
    InPlaceModuleBetween,
    ResidualInPlace,
    WritesSource,
    gelu_tanh,
    rel,
    swish,
)  # fmt: skip
from fad_chains import random_chain
from leangrad.measure import saved_tensor_bytes


def nested_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    with fad.nested():
        loss = model(x).square().sum()
    return list(torch.autograd.grad(loss, [*model.parameters(), x]))


def plain_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    return list(torch.autograd.grad(model(x).square().sum(), [*model.parameters(), x]))


def assert_same(model: nn.Module, x: torch.Tensor, tol: float = 1e-12, what: str = "") -> None:
    for a, b in zip(nested_grads(model, x), plain_grads(model, x), strict=True):
        assert rel(a, b) < tol, what


def test_state_machine_sequence_for_swish() -> None:
    torch.manual_seed(0)
    model, x = Acts(swish), torch.randn(2, 16)
    with fad.nested(trace=True) as stats:
        model(x).sum()
    # Fig. 5: NN (linear), NY starts the chain, YY continues it, YN ends it (post-process)
    assert stats.trace == [("NN", "linear"), ("NY", "sigmoid"), ("YY", "mul"),
                           ("YN", "linear"), ("NN", "sum")]  # fmt: skip
    assert stats.attached == 1


@pytest.mark.parametrize("seed", range(10))
def test_random_chains_nested(seed: int) -> None:
    chain = random_chain(seed + 200, length=8)
    torch.manual_seed(seed)
    model = Head(chain.fn, chain.outputs).double()
    assert_same(model, torch.randn(4, 5, dtype=torch.float64), what=chain.text)


def test_branches_inplace_noncontiguous_and_float32() -> None:
    torch.manual_seed(0)
    model = Branchy()
    assert_same(model, torch.randn(3, 2, 5, 5), tol=1e-5)
    assert_same(model.double(), torch.randn(3, 2, 5, 5, dtype=torch.float64))


@pytest.mark.parametrize("make", [WritesSource, InPlaceModuleBetween])
def test_write_into_a_source_between_chain_ops(make) -> None:  # type: ignore[no-untyped-def]
    assert_same(make().double(), torch.randn(2, 3, dtype=torch.float64))


def test_untraceable_model_runs_eagerly() -> None:
    x = torch.randn(3, 4, dtype=torch.float64)
    for sign in (1, -1):  # both branches of the data-dependent `if`
        xs = (x.abs() * sign).requires_grad_()
        with fad.nested() as stats:
            out = DataDependent()(xs).square().sum()
        (g,) = torch.autograd.grad(out, xs)
        (gr,) = torch.autograd.grad(DataDependent()(xs).square().sum(), xs)
        assert rel(g, gr) < 1e-12
        assert stats.states["YY"] == (2 if sign > 0 else 0)  # mul, square: one chain


@pytest.mark.parametrize(("act", "eager_tensors"), [(swish, 2), (gelu_tanh, 4)])
def test_nested_saves_one_tensor_per_chain(act, eager_tensors: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Acts(act)
    x = torch.randn(64, 16)
    one = 64 * 32 * 4
    with saved_tensor_bytes(x, *model.parameters()) as eager:
        out = model(x)
    del out
    with saved_tensor_bytes(x, *model.parameters()) as fadb, fad.nested():
        out = model(x)
    del out
    assert eager.bytes == (eager_tensors + 1) * one
    assert fadb.bytes == 2 * one  # the derivative + lin2's input


def test_constant_scale_chain_saves_nothing() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with saved_tensor_bytes(x, *lin.parameters()) as s, fad.nested():
        out = F.softmax(lin(x) / 4.0, dim=-1)  # d(h / 4)/dh = 0.25: a float, no tensor
    assert s.bytes == out.numel() * 4  # softmax's output only
    (g,) = torch.autograd.grad(out[:, 0].sum(), lin.weight)
    (gr,) = torch.autograd.grad(F.softmax(lin(x) / 4.0, dim=-1)[:, 0].sum(), lin.weight)
    assert rel(g, gr) < 1e-6


def test_fad_tensor_escaping_the_block_fails_loudly() -> None:
    x = torch.randn(5, requires_grad=True)
    with fad.nested():
        y = swish(x * 1)  # the chain's value never meets a non-element-wise op inside
    with pytest.raises(fad.FadError, match=r"used for a gradient after the `with fad.nested\(\)`"):
        y.sum().backward()


def test_custom_function_consumer_fails_loudly_not_wrongly() -> None:
    x = torch.randn(5, requires_grad=True)
    with fad.nested():
        loss = Double.apply(swish(x * 1)).sum()  # Function.apply is invisible to the mode
    with pytest.raises(fad.FadError, match="was never attached"):
        loss.backward()


def test_complex_chain_falls_back_with_warning() -> None:
    z = torch.randn(4, dtype=torch.complex128, requires_grad=True)
    msg = r"fad: the element-wise chain \['exp'\] cannot be nested \(no forward-mode rule"
    with pytest.warns(UserWarning, match=msg), fad.nested() as stats:
        out = (z * torch.exp(z)).abs().sum()
    assert stats.fallbacks and stats.attached == 0
    (g,) = torch.autograd.grad(out, z)
    (gr,) = torch.autograd.grad((z * torch.exp(z)).abs().sum(), z)
    assert rel(g, gr) < 1e-12


def test_no_chain_without_grad() -> None:
    with torch.no_grad(), fad.nested() as stats:
        y = swish(torch.randn(3))
    assert stats.states == {} and not y.requires_grad


def test_inplace_write_into_chain_output() -> None:
    assert_same(ResidualInPlace().double(), torch.randn(3, 4, dtype=torch.float64))


COMPOSITES = {
    "swish": swish,
    "gelu_tanh": gelu_tanh,
    "gelu_erf": lambda h: 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0))),
    "mish": lambda h: h * torch.tanh(F.softplus(h)),
}


@pytest.mark.parametrize("name", list(COMPOSITES))
def test_every_activation_in_both_modes(name: str) -> None:
    torch.manual_seed(0)
    model = Acts(COMPOSITES[name]).double()
    x = torch.randn(5, 16, dtype=torch.float64) * 3
    ref = plain_grads(model, x)
    nested_model = fad.nest(model)
    assert [len(r.ops) > 1 for r in nested_model.fad_regions] == [True]
    for got in (plain_grads(nested_model, x), nested_grads(model, x)):
        for a, b in zip(got, ref, strict=True):
            assert rel(a, b) < 1e-12


@pytest.mark.parametrize("kind", ["mlp", "cnn", "conv", "rnn"])
def test_library_models_in_both_modes(kind: str) -> None:
    """The shared test problems: whatever chains they have (or none), gradients stay exact."""
    from helpers import make_problem, reference_grads

    prob = make_problem(kind, torch.float64, seed=3)
    _, ref = reference_grads(prob.model, prob.inputs, prob.loss_fn)
    nested_model = fad.nest(prob.model)
    _, got = reference_grads(nested_model, prob.inputs, prob.loss_fn)
    with fad.nested():
        loss = prob.loss_fn(prob.model(*prob.inputs))
    eager = dict(zip(ref, torch.autograd.grad(loss, list(prob.model.parameters())), strict=True))
    for name, r in ref.items():
        assert rel(got[name], r) < 1e-12 and rel(eager[name], r) < 1e-12, name
