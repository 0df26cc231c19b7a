"""Invertible chain layers (``leangrad.layers._invertible``) and bit packing (``_bits``).

Every rule is held to autograd on random shapes: ``vjp_input`` to autograd's vjp,
``vijp`` to the inverse of ``vjp_input``, ``inverse`` to the inverse of
``forward``, ``forward_vjp_params`` to autograd's parameter gradients; float64
tightly, float32 loosely. Residual sizes are asserted in bytes.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from leangrad.layers._base import ChainLayer, LayerConditionError
from leangrad.layers._bits import PackedBits, pack_bits, unpack_bits
from leangrad.layers._invertible import AdditiveCoupling, LeakyReLU, SpaceToDepth, Tanh
from leangrad.measure import MemoryTracker

FEW = settings(max_examples=12, deadline=None)
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
"""vjp_input against autograd: float64 agrees to rounding; float32 loosely."""
ROUND_TRIP_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
KINDS = ("leaky", "tanh", "space", "coupling", "coupling_bn")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` (absolute when ``b`` is 0)."""
    scale = float(b.norm())
    return float((a - b).norm()) / (scale if scale > 0 else 1.0)


def conv_f(channels: int, hidden: int, *, batchnorm: bool) -> nn.Sequential:
    """Conv-ReLU-Conv (optionally Conv-BN-ReLU-Conv, BN in eval with random statistics)."""
    mid: list[nn.Module] = [nn.BatchNorm2d(hidden)] if batchnorm else []
    f = nn.Sequential(
        nn.Conv2d(channels, hidden, 3, padding=1),
        *mid,
        nn.ReLU(),
        nn.Conv2d(hidden, channels, 3, padding=1),
    )
    if batchnorm:
        bn = f[1]
        assert isinstance(bn, nn.BatchNorm2d)
        with torch.no_grad():
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.normal_()
            bn.bias.normal_()
        f.eval()
    return f


def make_layer(kind: str, channels: int, *, slope: float = 0.1) -> ChainLayer:
    if kind == "leaky":
        return LeakyReLU(slope)
    if kind == "tanh":
        return Tanh()
    if kind == "space":
        return SpaceToDepth(2)
    return AdditiveCoupling(conv_f(channels // 2, 3, batchnorm=kind == "coupling_bn"))


@st.composite
def cases(draw: st.DrawFn, kinds: tuple[str, ...] = KINDS) -> tuple[ChainLayer, torch.Tensor]:
    """A layer (float64) and an input ``(N, C, H, W)`` it accepts."""
    kind = draw(st.sampled_from(kinds), label="kind")
    n = draw(st.integers(1, 3), label="batch")
    c = 2 * draw(st.integers(1, 3), label="half_channels")
    h = 2 * draw(st.integers(1, 3), label="half_height")
    w = 2 * draw(st.integers(1, 3), label="half_width")
    slope = draw(st.floats(0.01, 3.0), label="slope")
    torch.manual_seed(draw(st.integers(0, 2**16), label="seed"))
    layer = make_layer(kind, c, slope=slope).double()
    x = torch.randn(n, c, h, w, dtype=torch.float64)
    return layer, x


def autograd_vjp(layer: nn.Module, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    xg = x.detach().requires_grad_(True)
    (g,) = torch.autograd.grad(layer(xg), xg, h)
    return g


# --------------------------------------------------------------------------- bits
@given(
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=4),
    p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_pack_bits_round_trip(shape: list[int], p: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=gen) < p
    packed = pack_bits(mask)
    assert isinstance(packed, PackedBits)
    assert packed.data.dtype == torch.uint8
    assert packed.shape == mask.shape
    assert packed.nbytes == math.ceil(mask.numel() / 8)
    assert packed.data.untyped_storage().nbytes() == math.ceil(mask.numel() / 8)
    out = unpack_bits(packed)
    assert out.dtype == torch.bool
    assert out.shape == mask.shape
    assert torch.equal(out, mask)


def test_pack_bits_layout_and_edge_cases() -> None:
    # element 8k + j is bit j of byte k; the tail is zero-padded
    mask = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 0, 1], dtype=torch.bool)
    assert pack_bits(mask).data.tolist() == [0b1000_0001, 0b10]
    assert pack_bits(torch.ones(8, dtype=torch.bool)).data.tolist() == [255]
    # non-contiguous masks are packed in their logical row-major order
    m = torch.rand(5, 7) > 0.5
    assert torch.equal(unpack_bits(pack_bits(m.t())), m.t())
    # 0-dim and empty
    scalar = torch.tensor(True)
    assert torch.equal(unpack_bits(pack_bits(scalar)), scalar)
    empty = torch.zeros(0, 3, dtype=torch.bool)
    assert pack_bits(empty).nbytes == 0
    assert unpack_bits(pack_bits(empty)).shape == (0, 3)


def test_pack_bits_errors() -> None:
    with pytest.raises(TypeError, match=r"bool mask, got dtype torch.float32"):
        pack_bits(torch.zeros(3))
    with pytest.raises(ValueError, match=r"3 bytes cannot hold shape \(9,\)"):
        unpack_bits(PackedBits(torch.zeros(3, dtype=torch.uint8), torch.Size([9])))


# --------------------------------------------------------------------------- rules vs autograd
@pytest.mark.parametrize("cls", [LeakyReLU, Tanh, SpaceToDepth, AdditiveCoupling])
def test_declares_invertible_and_submersive(cls: type[ChainLayer]) -> None:
    assert cls.invertible and cls.submersive


@given(case=cases(), dtype=st.sampled_from([torch.float64, torch.float32]))
@FEW
def test_vjp_input_matches_autograd(
    case: tuple[ChainLayer, torch.Tensor], dtype: torch.dtype
) -> None:
    layer, x = case
    layer, x = layer.to(dtype), x.to(dtype)
    y = layer(x)
    h = torch.randn_like(y)
    got = layer.vjp_input(layer.residual(x, y), h)
    assert rel_err(got, autograd_vjp(layer, x, h)) <= TOL[dtype]


@given(case=cases(), dtype=st.sampled_from([torch.float64, torch.float32]))
@FEW
def test_vijp_inverts_vjp_input(case: tuple[ChainLayer, torch.Tensor], dtype: torch.dtype) -> None:
    """Moonwalk v2 eq. (9): vijp recovers the output cotangent from the input cotangent."""
    layer, x = case
    layer, x = layer.to(dtype), x.to(dtype)
    y = layer(x)
    h = torch.randn_like(y)
    h_in = layer.vjp_input(layer.residual(x, y), h)
    assert rel_err(layer.vijp(x, h_in), h) <= ROUND_TRIP_TOL[dtype]


@given(case=cases())
@FEW
def test_inverse_of_forward(case: tuple[ChainLayer, torch.Tensor]) -> None:
    layer, x = case
    x = x.clamp(-3, 3)  # atanh loses ~ eps / (1 − tanh²) relative accuracy
    back = layer.inverse(layer(x))
    assert back.shape == x.shape
    assert rel_err(back, x) <= 1e-10


@given(case=cases())
@FEW
def test_forward_vjp_params_matches_autograd(case: tuple[ChainLayer, torch.Tensor]) -> None:
    layer, x = case
    y_ref = layer(x)
    h = torch.randn_like(y_ref)
    y, grads = layer.forward_vjp_params(x, h)
    assert not y.requires_grad
    assert torch.equal(y, y_ref.detach())
    params = {n: p for n, p in layer.named_parameters() if p.requires_grad}
    assert grads.keys() == params.keys()
    if params:
        ref = torch.autograd.grad(layer(x), list(params.values()), h)
        for (name, g_ref), g in zip(zip(params, ref, strict=True), grads.values(), strict=True):
            assert rel_err(g, g_ref) <= 1e-12, name


@pytest.mark.parametrize("batchnorm", [False, True], ids=["conv_relu_conv", "with_bn_eval"])
def test_coupling_param_names_and_grads(batchnorm: bool) -> None:
    torch.manual_seed(0)
    layer = AdditiveCoupling(conv_f(2, 5, batchnorm=batchnorm)).double()
    x = torch.randn(2, 4, 6, 4, dtype=torch.float64)
    h = torch.randn_like(x)
    _, grads = layer.forward_vjp_params(x, h)
    last = 3 if batchnorm else 2  # Conv, [BN], ReLU, Conv
    names = [f"F.{i}.{p}" for i in (0, last) for p in ("weight", "bias")]
    names += ["F.1.weight", "F.1.bias"] if batchnorm else []
    assert sorted(grads) == sorted(names)
    loss = (layer(x) * h).sum()
    for name, p in layer.named_parameters():
        (g,) = torch.autograd.grad(loss, p, retain_graph=True)
        assert rel_err(grads[name], g) <= 1e-12, name


def test_moonwalk_sweep_over_a_chain() -> None:
    """Algorithm 1 (v1; v2 eqs. (8)–(10)) over these layers equals backprop's gradients."""
    torch.manual_seed(1)
    chain = nn.Sequential(
        AdditiveCoupling(conv_f(1, 3, batchnorm=False)),
        LeakyReLU(0.2),
        SpaceToDepth(2),
        AdditiveCoupling(conv_f(4, 3, batchnorm=True)),
        Tanh(),
    ).double()
    x0 = torch.randn(2, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    target = torch.randn(2, 8, 2, 2, dtype=torch.float64)
    loss = ((chain(x0) - target) ** 2).sum()
    params = dict(chain.named_parameters())
    ref = torch.autograd.grad(loss, [x0, *params.values()])
    h, x = ref[0], x0.detach()  # h_0, the input cotangent
    got: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(chain):
        assert isinstance(layer, ChainLayer)
        h = layer.vijp(x, h)  # h_i (v2 eq. (9))
        x, g = layer.forward_vjp_params(x, h)  # x_i, g_i (v2 eq. (10))
        got.update({f"{i}.{n}": t for n, t in g.items()})
    assert got.keys() == params.keys()
    for name, g_ref in zip(params, ref[1:], strict=True):
        assert rel_err(got[name], g_ref) <= 1e-9, name


# --------------------------------------------------------------------------- residual sizes
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (8,), (1, 1, 3)])
def test_leaky_relu_residual_is_one_bit_per_element(shape: tuple[int, ...]) -> None:
    layer = LeakyReLU()
    x = torch.randn(shape, dtype=torch.float64)
    y = layer(x)
    expected = math.ceil(x.numel() / 8)
    with MemoryTracker(baseline=(x, y)) as tracker:
        res = layer.residual(x, y)
    assert res.data.untyped_storage().nbytes() == expected
    assert tracker.report.end_bytes == expected  # nothing else stays alive


def test_coupling_residual_is_half_the_input() -> None:
    layer = AdditiveCoupling(conv_f(3, 2, batchnorm=False)).double()
    x = torch.randn(1, 6, 4, 4, dtype=torch.float64)  # batch 1: x1 is a contiguous view
    res = layer.residual(x, layer(x))
    assert res.untyped_storage().nbytes() == x.untyped_storage().nbytes() // 2


def test_space_to_depth_stores_nothing_and_is_pixel_unshuffle() -> None:
    layer = SpaceToDepth(2)
    x = torch.arange(2 * 3 * 4 * 6, dtype=torch.float64).reshape(2, 3, 4, 6)
    y = layer(x)
    assert y.shape == (2, 12, 2, 3)
    assert layer.residual(x, y) is None
    assert torch.equal(y[0, 1, 0, 0], x[0, 0, 0, 1])  # channel c·4 + i·2 + j ← (c, i, j)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("slope", [0.0, -0.1, float("nan"), float("inf")])
def test_leaky_relu_slope_must_be_positive(slope: float) -> None:
    with pytest.raises(LayerConditionError, match=r"is not invertible.*finite number > 0"):
        LeakyReLU(slope)


def test_coupling_odd_channel_count() -> None:
    layer = AdditiveCoupling(nn.Identity())
    x = torch.randn(2, 3, 4, 4)
    msg = r"3 channels along dim 1, an odd number.*use an even channel count"
    with pytest.raises(LayerConditionError, match=msg):
        layer.check(x)
    with pytest.raises(LayerConditionError, match=msg):
        layer(x)


def test_coupling_f_must_keep_the_shape() -> None:
    layer = AdditiveCoupling(nn.Conv2d(2, 2, 3))  # no padding: 4x4 -> 2x2
    x = torch.randn(1, 4, 4, 4)
    msg = re.escape("F maps (1, 2, 4, 4) to (1, 2, 2, 2); make F keep the shape")
    with pytest.raises(LayerConditionError, match=msg):
        layer.check(x)
    with pytest.raises(LayerConditionError, match=msg):
        layer(x)


def test_coupling_check_reports_a_failing_f() -> None:
    layer = AdditiveCoupling(nn.Conv2d(3, 3, 3, padding=1))  # x1 has 2 channels, not 3
    with pytest.raises(LayerConditionError, match=r"F failed on x1 of shape \(1, 2, 4, 4\)"):
        layer.check(torch.randn(1, 4, 4, 4))
    with pytest.raises(LayerConditionError, match=r"needs an nn.Module, got builtin_function"):
        AdditiveCoupling(torch.tanh)  # type: ignore[arg-type]


def test_coupling_warns_once_about_training_batchnorm() -> None:
    f = conv_f(1, 2, batchnorm=True).double().train()
    layer = AdditiveCoupling(f)
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    stats = f[1].running_mean.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer.check(x)  # checking runs F without moving the statistics
        assert torch.equal(f[1].running_mean, stats)
        y = layer(x)
        h = torch.randn_like(y)
        h_in = layer.vjp_input(layer.residual(x, y), h)
        layer.vijp(x, h_in)
        layer.inverse(y)
    bn_warnings = [w for w in caught if "BatchNorm in training mode (F.1)" in str(w.message)]
    assert len(bn_warnings) == 1
    assert "more than once per step" in str(bn_warnings[0].message)
    # still exact: batch statistics are the same on every recomputation
    assert rel_err(h_in, autograd_vjp(layer, x, h)) <= 1e-12


@pytest.mark.parametrize("shape", [(1, 3, 5, 4), (2, 1, 4, 7)])
def test_space_to_depth_needs_divisible_spatial_size(shape: tuple[int, ...]) -> None:
    layer = SpaceToDepth(2)
    h, w = shape[-2:]
    msg = rf"spatial size H×W = {h}×{w} is not divisible by the block size 2; pad or crop"
    with pytest.raises(LayerConditionError, match=msg):
        layer.check(torch.zeros(shape))
    with pytest.raises(LayerConditionError, match=msg):
        layer(torch.zeros(shape))
    with pytest.raises(LayerConditionError, match=r"block_size must be a positive int"):
        SpaceToDepth(0)
    with pytest.raises(LayerConditionError, match=r"needs an input of shape \(\.\.\., C, H, W\)"):
        layer(torch.zeros(4, 4))


@pytest.mark.parametrize(("dtype", "big"), [(torch.float64, 30.0), (torch.float32, 12.0)])
def test_tanh_saturation_raises(dtype: torch.dtype, big: float) -> None:
    layer = Tanh()
    x = torch.tensor([0.5, -big, big, 1.0], dtype=dtype)
    with pytest.raises(LayerConditionError, match=r"Tanh\(\): tanh saturated in vijp: 2 of 4"):
        layer.vijp(x, torch.ones_like(x))
    with pytest.raises(LayerConditionError, match=r"lower the learning rate.*or use LeakyReLU"):
        layer.vijp(x, torch.ones_like(x))
    with pytest.raises(LayerConditionError, match=r"saturated in inverse: 2 of 4 .*\|y\| ≥ 1"):
        layer.inverse(layer(x))
    ok = torch.tensor([0.5, -3.0], dtype=dtype)
    assert torch.isfinite(layer.vijp(ok, torch.ones_like(ok))).all()


@pytest.mark.parametrize("kind", KINDS)
def test_rules_run_on_fake_tensors(kind: str) -> None:
    """Shape-only runs (leangrad.measure.estimate_memory) skip the value checks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        layer = make_layer(kind, 4)
        x = torch.randn(2, 4, 6, 6)
        y = layer(x)
        assert layer.vjp_input(layer.residual(x, y), y).shape == x.shape
        assert layer.vijp(x, x).shape == y.shape
        assert layer.inverse(y).shape == x.shape
        assert layer.forward_vjp_params(x, y)[0].shape == y.shape
