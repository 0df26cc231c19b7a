"""SubmersiveConv2d and SubmersiveLinear (Moonwalk v2, Lemma 1): every rule against autograd.

float64, tight: ``vjp_input`` equals autograd's vjp (≤ 1e-12 relative), ``vijp``
inverts it on the row space (≤ 1e-10), both vijp paths agree, and
``forward_vjp_params`` equals autograd's gradients of the raw parameters.
float32, loose and stated: 8 chained vijps at default init lose ≤ 1e-5 relative
(parallel path; measured ~1e-7) and ≤ 1e-4 (wavefront; measured ~1e-6).
Each Lemma 1 violation raises ``LayerConditionError`` naming the condition.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leangrad._errors import UnknownNameError
from leangrad.layers._base import LayerConditionError, autograd_forward_vjp_params
from leangrad.layers._conv import SubmersiveConv2d, _size_ok
from leangrad.layers._linear import SubmersiveLinear

F64 = torch.float64
Cfg = tuple[int | tuple[int, int], int | tuple[int, int], int | tuple[int, int]]

# (kernel_size, stride, padding) → whether the fully parallel path is valid (s > k − 1 − p)
CONFIGS: dict[Cfg, bool] = {
    (3, 2, 1): True,  # section 6.2
    (2, 2, 0): True,
    (5, 3, 2): True,
    (1, 1, 0): True,
    (2, 2, 1): True,  # k ≤ 2p: some input sizes break n > s(n'−1)
    ((3, 1), (2, 1), (1, 0)): True,
    (3, 2, 0): False,
    (3, 1, 0): False,
    (5, 2, 1): False,
    (2, 1, 0): False,
    ((3, 2), (2, 1), (0, 0)): False,
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-300))


def _valid_sizes(k: int, s: int, p: int, hi: int = 11) -> list[int]:
    return [n for n in range(1, hi + 1) if _size_ok(n, k, s, p)]


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else v


def _randomise(layer: torch.nn.Module, gen: torch.Generator) -> None:
    """Move the raw parameters off their init (diagonal anywhere in (0.5, 1.5))."""
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def _check_conv(layer: SubmersiveConv2d, x: torch.Tensor, gen: torch.Generator) -> None:
    y = layer(x)
    h = torch.randn(y.shape, generator=gen, dtype=F64)
    res = layer.residual(x, y)
    assert isinstance(res, torch.Size) and tuple(res) == tuple(x.shape[-2:])
    h_in = layer.vjp_input(res, h)
    xg = x.detach().requires_grad_(True)
    (ref,) = torch.autograd.grad(layer(xg), xg, h)
    assert _rel(h_in, ref) <= 1e-12
    wave = layer.vijp(x, h_in, mode="wavefront")
    assert wave.shape == h.shape and _rel(wave, h) <= 1e-10
    if layer.parallel_vijp_valid:
        par = layer.vijp(x, h_in, mode="parallel")
        assert _rel(par, h) <= 1e-10 and _rel(par, wave) <= 1e-10
    assert torch.equal(layer.vijp(x, h_in), layer.vijp(x, h_in, mode="auto"))
    y2, grads = layer.forward_vjp_params(x, h)
    y_ref, grads_ref = autograd_forward_vjp_params(layer, x, h)
    assert torch.equal(y2, y_ref)
    assert grads.keys() == grads_ref.keys() == dict(layer.named_parameters()).keys()
    for name, g in grads.items():
        assert _rel(g, grads_ref[name]) <= 1e-12, name


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_conv_rules_match_autograd(data: st.DataObject) -> None:
    cfg = data.draw(st.sampled_from(list(CONFIGS)), label="k,s,p")
    (k1, k2), (s1, s2), (p1, p2) = (_pair(v) for v in cfg)
    c_in = data.draw(st.integers(1, 5), label="c_in")
    c_out = data.draw(st.integers(1, c_in), label="c_out")
    n1 = data.draw(st.sampled_from(_valid_sizes(k1, s1, p1)), label="n1")
    n2 = data.draw(st.sampled_from(_valid_sizes(k2, s2, p2)), label="n2")
    batch = data.draw(st.integers(1, 3), label="batch")
    bias = data.draw(st.booleans(), label="bias")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    layer = SubmersiveConv2d(c_in, c_out, *cfg, bias=bias, dtype=F64)
    _randomise(layer, gen)
    _check_conv(layer, torch.randn(batch, c_in, n1, n2, generator=gen, dtype=F64), gen)


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=str)
def test_conv_named_configs(cfg: Cfg) -> None:
    (k1, k2), (s1, s2), (p1, p2) = (_pair(v) for v in cfg)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    layer = SubmersiveConv2d(6, 4, *cfg, dtype=F64)
    assert layer.parallel_vijp_valid is CONFIGS[cfg]
    _randomise(layer, gen)
    n1, n2 = _valid_sizes(k1, s1, p1, 13)[-1], _valid_sizes(k2, s2, p2, 12)[-1]
    _check_conv(layer, torch.randn(2, 6, n1, n2, generator=gen, dtype=F64), gen)


def test_conv_weight_is_channel_triangular_at_the_centre_tap() -> None:
    """Lemma 1 (ii)–(iii) in PyTorch layout: ``w[c', c, p, p] = 0`` for ``c < c'``, and
    the diagonal stays in (0.5, 1.5) whatever the raw parameters."""
    layer = SubmersiveConv2d(7, 5, 5, stride=3, padding=2, dtype=F64)
    with torch.no_grad():
        layer.weight_raw.normal_(0, 10)
        layer.diag_raw.copy_(torch.tensor([-1e3, -2.0, 0.0, 2.0, 1e3]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # huge off-diagonals: ill-conditioned, checked below
        w = layer.weight()
    centre = w[:, :, 2, 2]
    c_out, c_in = centre.shape
    below = torch.tensor([[c < co for c in range(c_in)] for co in range(c_out)])
    assert torch.all(centre[below] == 0)
    diag = centre.diagonal()
    assert torch.all((diag >= 0.5) & (diag <= 1.5))
    assert torch.all(centre[:, c_out:] != 0) and torch.all(w[:, :, 0] != 0)  # rest is free


def test_vjp_input_restores_every_input_size() -> None:
    """Inputs of different sizes with the same output size: the residual (the input's
    spatial size) picks conv_transpose2d's output_padding."""
    layer = SubmersiveConv2d(3, 3, 3, stride=3, padding=1, dtype=F64)
    for n in (7, 8, 9):
        x = torch.randn(1, 3, n, n + 1, dtype=F64)
        y = layer(x)
        h = layer.vjp_input(layer.residual(x, y), torch.randn_like(y))
        assert h.shape == x.shape


def _chain_error(cfg: Cfg, n: int, *, depth: int = 8, c: int = 8) -> float:
    """float32 relative error of ``h_depth`` recovered from ``h_0`` by chained vijps."""
    torch.manual_seed(0)
    layers = [SubmersiveConv2d(c, c, *cfg, dtype=F64) for _ in range(depth)]
    sizes = [(n, n)]
    for layer in layers:
        sizes.append(layer.output_size(sizes[-1]))
    assert min(sizes[-1]) >= 1
    with torch.no_grad():
        top = torch.randn(2, c, *sizes[-1], dtype=F64)
        h = top
        for layer, size in zip(reversed(layers), reversed(sizes[:-1]), strict=True):
            h = layer.vjp_input(torch.Size(size), h)
        h = h.float()
        for layer in layers:
            h = copy.deepcopy(layer).float().vijp(None, h)
    return _rel(h.double(), top)


@pytest.mark.parametrize(
    ("cfg", "n", "bound"),
    [((3, 2, 1), 256, 1e-5), ((2, 2, 0), 256, 1e-5), ((3, 1, 0), 24, 1e-4), ((3, 2, 0), 511, 1e-4)],
    ids=["3x3s2p1-parallel", "2x2s2p0-parallel", "3x3s1p0-wavefront", "3x3s2p0-wavefront"],
)
def test_float32_chained_vijp_error_at_depth_8(cfg: Cfg, n: int, bound: float) -> None:
    """Moonwalk's Phase III in float32 at default init (measured: ~1e-7 parallel,
    ~1e-6 wavefront; docs/layers.md has the table)."""
    assert _chain_error(cfg, n) <= bound


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "condition"),
    [
        ((4, 4, 1, 2, 1), "Lemma 1 (i): kernel_size > padding"),
        ((4, 4, 3, 1, 1), "Lemma 1 (i): stride > padding"),  # 3x3/s1/p1 ("same") is not covered
        ((4, 4, 3, 2, 2), "Lemma 1 (i): stride > padding"),
        ((4, 4, (3, 3), (2, 1), (1, 1)), "Lemma 1 (i): stride > padding"),
        ((3, 4, 3, 2, 1), "Lemma 1 (ii): out_channels ≤ in_channels"),
    ],
)
def test_conv_construction_violations_raise(args: tuple, condition: str) -> None:
    with pytest.raises(LayerConditionError, match=re.escape(condition)) as info:
        SubmersiveConv2d(*args)
    assert "SubmersiveConv2d(" in str(info.value) and " use " in str(info.value)


@pytest.mark.parametrize(("cfg", "n", "fix"), [((2, 2, 1), 4, "3 or 5"), ((3, 3, 2), 6, "4 or 7")])
def test_conv_spatial_bound_violation_raises(cfg: Cfg, n: int, fix: str) -> None:
    """k ≤ 2p lets the last output's centre tap fall into the padding: for k=2, s=2,
    p=1 and n=4, n' = 3 and s(n'−1) = 4 = n; for k=3, s=3, p=2 and n=6, s(n'−1) = 6."""
    layer = SubmersiveConv2d(2, 2, *cfg, dtype=F64)
    x = torch.randn(1, 2, n, n + 1, dtype=F64)
    h = torch.randn(1, 2, n, n + 1, dtype=F64)
    for call in (lambda: layer(x), lambda: layer.vijp(x, h), lambda: layer.check(x)):
        with pytest.raises(LayerConditionError, match=re.escape("n > s(n'−1)")) as info:
            call()
        assert "spatial dimension 0" in str(info.value) and fix in str(info.value)
    layer(torch.randn(1, 2, n + 1, n + 1, dtype=F64))  # n + 1 is fine


def test_conv_bad_input_shape_and_modes_raise() -> None:
    layer = SubmersiveConv2d(3, 2, 3, stride=2, padding=0)
    with pytest.raises(
        LayerConditionError, match=re.escape("needs an input of shape (N, 3, H, W)")
    ):
        layer(torch.randn(1, 4, 8, 8))
    with pytest.raises(LayerConditionError, match="smaller than the kernel"):
        layer(torch.randn(1, 3, 2, 8))
    with pytest.raises(LayerConditionError, match=re.escape("stride > kernel_size − 1 − padding")):
        layer.vijp(None, torch.randn(1, 3, 9, 9), mode="parallel")
    with pytest.raises(UnknownNameError, match="known vijp_modes: auto, parallel, wavefront"):
        layer.vijp(None, torch.randn(1, 3, 9, 9), mode="serial")
    with pytest.raises(UnknownNameError, match="vijp_mode"):
        SubmersiveConv2d(3, 2, 3, stride=2, vijp_mode="fast")


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_near_singular_centre_warns(dtype: torch.dtype) -> None:
    layer = SubmersiveConv2d(16, 16, 3, stride=2, padding=1, dtype=dtype)
    h = torch.randn(1, 16, 8, 8, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # default init is well-conditioned: no warning
        layer.check()
        layer.vijp(None, h)
    with torch.no_grad():
        layer.weight_raw.mul_(1e3)
        layer.diag_raw.fill_(-30.0)  # diagonal at its floor 0.5, off-diagonals ~100
    for call in (layer.check, lambda: layer.vijp(None, h)):
        with pytest.warns(RuntimeWarning, match=r"SubmersiveConv2d\(16, 16.*ill-conditioned"):
            call()


# -- SubmersiveLinear --------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    n_in=st.integers(1, 7),
    data=st.data(),
    lead=st.sampled_from([(3,), (2, 3), (1,)]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_rules_match_autograd(
    n_in: int, data: st.DataObject, lead: tuple[int, ...], bias: bool, seed: int
) -> None:
    n_out = data.draw(st.integers(1, n_in), label="n_out")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    layer = SubmersiveLinear(n_in, n_out, bias=bias, dtype=F64)
    _randomise(layer, gen)
    x = torch.randn(*lead, n_in, generator=gen, dtype=F64)
    y = layer(x)
    h = torch.randn(y.shape, generator=gen, dtype=F64)
    assert layer.residual(x, y) is None
    h_in = layer.vjp_input(None, h)
    xg = x.detach().requires_grad_(True)
    (ref,) = torch.autograd.grad(layer(xg), xg, h)
    assert _rel(h_in, ref) <= 1e-12
    assert _rel(layer.vijp(x, h_in), h) <= 1e-10
    y2, grads = layer.forward_vjp_params(x, h)
    y_ref, grads_ref = autograd_forward_vjp_params(layer, x, h)
    assert torch.equal(y2, y_ref) and grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        assert _rel(g, grads_ref[name]) <= 1e-12, name
    w = layer.weight()
    assert torch.all(torch.tril(w[:, :n_out], diagonal=-1) == 0)
    assert torch.all((w.diagonal() >= 0.5) & (w.diagonal() <= 1.5))


def test_linear_violations() -> None:
    with pytest.raises(LayerConditionError, match=re.escape("out_features ≤ in_features")) as info:
        SubmersiveLinear(3, 5)
    assert "SubmersiveLinear(in_features=3, out_features=5" in str(info.value)
    layer = SubmersiveLinear(6, 4)
    with pytest.raises(LayerConditionError, match=re.escape("input of shape (..., 6)")):
        layer(torch.randn(2, 5))
    with torch.no_grad():
        layer.weight_raw.mul_(1e4)
    with pytest.warns(RuntimeWarning, match=r"SubmersiveLinear\(in_features=6.*ill-conditioned"):
        layer.vijp(None, torch.randn(2, 6))


def test_frozen_parameters_get_no_gradient() -> None:
    conv = SubmersiveConv2d(3, 3, 3, stride=2, padding=1, bias=False)
    conv.diag_raw.requires_grad_(False)
    x = torch.randn(1, 3, 8, 8)
    _, grads = conv.forward_vjp_params(x, torch.randn_like(conv(x)))
    assert set(grads) == {"weight_raw"}
    lin = SubmersiveLinear(4, 4, bias=False)
    _, grads = lin.forward_vjp_params(torch.randn(2, 4), torch.randn(2, 4))
    assert set(grads) == {"weight_raw", "diag_raw"}
