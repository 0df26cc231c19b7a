"""Tests of leangrad.fad primitives, ready activations and fad.elementwise.

The oracle is plain autograd on the same expression (STYLE.md, micrograd habit):
float64 gradients must agree to 1e-12 relative (max-abs-normalised), float32 to
1e-5. What is saved for backward is asserted in bytes (saved_tensors_hooks).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import leangrad.fad as fad
from fad_chains import random_chain
from leangrad.fad import _errors as E
from leangrad.fad._primitives import PRIMITIVES, Dual, lookup
from leangrad.measure import MemoryTracker, saved_tensor_bytes

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    return err / scale if scale > 0 else err


def grads(fn, x: torch.Tensor, seed: int = 1):  # type: ignore[no-untyped-def]
    """Outputs and d(sum_i <g_i, out_i>)/dx for random cotangents g_i."""
    x = x.detach().requires_grad_()
    out = fn(x)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    cots = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
    (g,) = torch.autograd.grad(outs, x, cots)
    return [o.detach() for o in outs], g


def composite_swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def composite_mish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tanh(F.softplus(x))


def composite_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


ACTIVATIONS = {
    "swish": (fad.Swish, F.silu),
    "mish": (fad.Mish, F.mish),
    "gelu": (fad.GELU, F.gelu),
    "gelu_tanh": (lambda: fad.GELU(approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_matches_autograd(name: str, dtype: torch.dtype) -> None:
    make, ref = ACTIVATIONS[name]
    x = torch.randn(7, 11, dtype=dtype) * 3
    (y,), g = grads(make(), x)
    (yr,), gr = grads(ref, x)
    assert rel(y, yr) < TOL[dtype]
    assert rel(g, gr) < TOL[dtype]


def test_activation_noncontiguous_input_and_saturation() -> None:
    base = torch.randn(9, 6, dtype=torch.float64) * 30  # softplus threshold, tanh saturation
    x = base.t()[::2]
    assert not x.is_contiguous()
    for make, ref in ACTIVATIONS.values():
        (y,), g = grads(make(), x)
        (yr,), gr = grads(ref, x)
        assert rel(y, yr) < 1e-12 and rel(g, gr) < 1e-12


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_every_primitive_rule_matches_autograd(name: str) -> None:
    prim = PRIMITIVES[name]
    x = torch.rand(5, 4, dtype=torch.float64) + 0.5  # in every op's domain
    if prim.arity == 1:

        def fn(t: torch.Tensor) -> torch.Tensor:
            return prim.plain(t)

        def fad_fn(t: torch.Tensor) -> torch.Tensor:
            return prim.rule(Dual(t, 1.0)).value

        rule = prim.rule(Dual(x, 1.0))
    else:

        def fn(t: torch.Tensor) -> torch.Tensor:
            return prim.plain(t, torch.sin(t))

        rule = prim.rule(Dual(x, 1.0), Dual(torch.sin(x), torch.cos(x)))
    (yr,), _ = grads(fn, x)
    # derivative of the whole op w.r.t. x, element-wise, as a vjp with ones
    xg = x.detach().requires_grad_()
    (dr,) = torch.autograd.grad(fn(xg), xg, torch.ones_like(x))
    d = rule.deriv if isinstance(rule.deriv, torch.Tensor) else torch.full_like(x, rule.deriv)
    assert rel(rule.value, yr) < 1e-12
    assert rel(d, dr) < 1e-12, name


@pytest.mark.parametrize("seed", range(12))
def test_random_chains_elementwise(seed: int) -> None:
    chain = random_chain(seed, length=7)
    x = torch.randn(6, 5, dtype=torch.float64)
    ys, g = grads(fad.elementwise(chain.fn), x)
    yrs, gr = grads(chain.fn, x)
    assert len(ys) == chain.outputs
    for y, yr in zip(ys, yrs, strict=True):
        assert rel(y, yr) < 1e-12, chain.text
    assert rel(g, gr) < 1e-12, chain.text


def test_elementwise_branches_inplace_constants() -> None:
    mask = (torch.rand(4, 1, dtype=torch.float64) > 0.5).to(torch.float64)  # broadcasts, no grad

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x.sigmoid()
        t = torch.tanh(x)  # a second branch off the source
        u = s * t + mask * x
        u.mul_(2.0)  # in place on a chain value
        u += s
        return u, t.exp()

    x = torch.randn(4, 3, dtype=torch.float64)
    ys, g = grads(fad.elementwise(fn), x)
    yrs, gr = grads(fn, x)
    assert all(rel(a, b) < 1e-12 for a, b in zip(ys, yrs, strict=True))
    assert rel(g, gr) < 1e-12


def _saved(fn, x: torch.Tensor) -> int:  # type: ignore[no-untyped-def]
    x = (x * 1).requires_grad_()  # a fresh intermediate, as inside a network
    with saved_tensor_bytes() as s:
        out = fn(x)
    del out
    return s.bytes


@pytest.mark.parametrize(
    ("make", "composite", "eager_tensors"),
    [
        (fad.Swish, composite_swish, 2),  # x and sigmoid(x) (paper eq. 1)
        (fad.Mish, composite_mish, 2),  # x and tanh(softplus(x))
        (lambda: fad.GELU(approximate="tanh"), composite_gelu_tanh, 4),
        (lambda: fad.elementwise(composite_mish), composite_mish, 2),
    ],
)
def test_saves_one_tensor_where_autograd_saves_several(make, composite, eager_tensors) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(64, 32)
    one = x.numel() * x.element_size()
    assert _saved(composite, x) == eager_tensors * one
    assert _saved(make(), x) == one


@pytest.mark.parametrize("make", [fad.Swish, fad.Mish, lambda: fad.GELU(approximate="tanh")])
def test_fused_forward_reuses_its_temporaries(make) -> None:  # type: ignore[no-untyped-def]
    """Tracker-measured: the fused forward never holds more than three tensors of the
    input's size (temporaries are overwritten in place once dead), and keeps two: the
    output and the derivative. Eager autograd keeps its intermediates instead."""
    x = torch.randn(64, 256, requires_grad=True)
    one = x.numel() * x.element_size()
    with MemoryTracker(baseline=x) as tracker:
        y = make()(x)
        kept = tracker.current_bytes()
    assert kept == 2 * one
    assert tracker.report.peak_bytes <= 3 * one + 64  # + a one-element ones() for d = 1
    del y


def test_linear_chain_saves_nothing() -> None:
    # d(2x + 1)/dx is the constant 2: no tensor is kept at all
    assert _saved(fad.elementwise(lambda x: 2 * x + 1), torch.randn(8, 8)) == 0
    _, g = grads(fad.elementwise(lambda x: 2 * x + 1), torch.randn(3, dtype=torch.float64))
    assert torch.equal(g, 2 * grads(lambda x: x, torch.randn(3, dtype=torch.float64), seed=1)[1])


def test_lookup_covers_call_styles() -> None:
    assert lookup(torch.sigmoid).prim.name == "sigmoid"
    assert lookup(torch.Tensor.__rsub__).reverse
    assert lookup(torch.Tensor.mul_).inplace
    assert lookup(F.softplus).prim.name == "softplus"
    assert lookup(torch.matmul) is None


# -- bad input ------------------------------------------------------------------------------
def test_elementwise_rejects_non_elementwise_op() -> None:
    act = fad.elementwise(lambda x: torch.sigmoid(x).cumsum(0))
    with pytest.raises(fad.FadOpError, match=r"operator 'cumsum' is not a FAD-compatible"):
        act(torch.randn(3, requires_grad=True))


def test_elementwise_rejects_two_source_binary() -> None:
    w = torch.randn(3, requires_grad=True)
    act = fad.elementwise(lambda x: x * w)
    with pytest.raises(fad.FadOpError, match=r"binary operator 'mul' mixes the source tensor"):
        act(torch.randn(3, requires_grad=True))
    wide = torch.randn(2, 3)
    with pytest.raises(fad.FadOpError, match=r"shape \(2, 3\) widens \(3,\)"):
        fad.elementwise(lambda x: x + wide)(torch.randn(3, requires_grad=True))


def test_elementwise_rejects_inplace_on_input() -> None:
    with pytest.raises(fad.FadOpError, match=r"in-place operator 'mul_' writes into the"):
        fad.elementwise(lambda x: x.mul_(2))(torch.randn(3, requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_dtype_without_rule(dtype: torch.dtype) -> None:
    x = torch.ones(3, dtype=dtype)
    msg = f"operator 'sigmoid' has no forward-mode rule for dtype {dtype}"
    with pytest.raises(fad.FadDtypeError, match=msg):
        fad.Swish()(x)
    with pytest.raises(fad.FadDtypeError, match=f"no forward-mode rule for dtype {dtype}"):
        fad.elementwise(composite_swish)(x)


def test_gelu_rejects_unknown_approximation() -> None:
    with pytest.raises(ValueError, match="GELU approximate must be 'none' or 'tanh', got 'erf'"):
        fad.GELU(approximate="erf")


def test_error_messages_are_constants() -> None:
    assert "fad.nested()" in E.UNTRACEABLE
    assert "{op" in E.NOT_ELEMENTWISE and "{op" in E.TWO_SOURCES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_half_precision_within_rounding(name: str, dtype: torch.dtype) -> None:
    """Low precision: FAD's gradient is as close to the float64 one as eager autograd's is
    (both round every intermediate; tolerance 8 machine epsilons of the dtype)."""
    make, ref = ACTIVATIONS[name]
    x = torch.randn(32, 16, dtype=torch.float64) * 3
    _, g64 = grads(ref, x)
    _, g = grads(make(), x.to(dtype))
    _, ge = grads(ref, x.to(dtype))
    eps = torch.finfo(dtype).eps
    assert rel(g.double(), g64) < 8 * eps
    assert rel(ge.double(), g64) < 8 * eps
