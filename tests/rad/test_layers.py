"""RAD layers: exact at fraction 1, unbiased below it, and what they save (by bytes)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leangrad import rad
from leangrad.measure import MemoryTracker, estimator_stats, saved_tensor_bytes

MODES = ("different", "same", "project")

# Unbiasedness tolerance. For an unbiased estimator each coordinate's
# z = (mean - exact) / (sd / sqrt(N)) is ~ N(0, 1) for large N (CLT), so the
# mean of z^2 over coordinates is ~1 (correlated coordinates widen its spread,
# they do not move its centre). We accept 0.3 < mean z^2 < 1.6 (the lower bound
# only guards the variance estimate; correlated coordinates spread it) and |z| below
# the Bonferroni bound for 1e-3 family-wise error over all coordinates (~5 for
# a few thousand coordinates; rounded up to 6 for the t-tails at N = 400).
# The power check below shows a 5% bias is rejected by the same test.
Z2_LOW, Z2_HIGH, Z_MAX = 0.3, 1.6, 6.0


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return _grads(model)


def _mlp(d: int = 20, h: int = 16, c: int = 5) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, c))


def _cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(4, 3),
    )  # fmt: skip


def _pair(build, fraction: float, mode: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    exact = build().to(dtype)
    model = copy.deepcopy(exact)
    rad.randomize(model, fraction=fraction, mode=mode, seed=1)
    return exact, model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_fraction_one_is_exact_float64(kind: str, mode: str) -> None:
    exact, model = _pair(_mlp if kind == "mlp" else _cnn, 1.0, mode, torch.float64)
    x = torch.randn(6, 20, dtype=torch.float64) if kind == "mlp" else torch.randn(
        6, 2, 8, 8, dtype=torch.float64
    )
    y = torch.randint(3, (6,))
    ref, got = _step(exact, x, y), _step(model, x, y)
    for n in ref:
        assert (got[n] - ref[n]).abs().max().item() <= 1e-12 * max(1.0, ref[n].abs().max().item())


@pytest.mark.parametrize("mode", MODES)
def test_fraction_one_float32_and_input_grad_exact_below_one(mode: str) -> None:
    exact, model = _pair(_cnn, 1.0, mode, torch.float32)
    x = torch.randn(4, 2, 8, 8)
    y = torch.randint(3, (4,))
    ref, got = _step(exact, x, y), _step(model, x, y)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6)
    # input gradients need only the weights, kept anyway: exact at any fraction
    exact, model = _pair(_mlp, 0.1, mode, torch.float64)
    xs = torch.randn(5, 20, dtype=torch.float64, requires_grad=True)
    x2 = xs.detach().clone().requires_grad_()
    F.cross_entropy(exact(xs), y[:4].repeat(2)[:5]).backward()
    F.cross_entropy(model(x2), y[:4].repeat(2)[:5]).backward()
    torch.testing.assert_close(x2.grad, xs.grad, rtol=1e-12, atol=1e-14)


def _unbiased(build, x, y, mode: str, fraction: float, draws: int, replace: bool = False):  # type: ignore[no-untyped-def]
    exact, model = _pair(build, fraction, mode, torch.float64)
    if replace:
        rad.randomize(model, fraction=fraction, mode=mode, replace=True, seed=3)
    ref = _step(exact, x, y)
    return ref, estimator_stats(lambda: _step(model, x, y), ref, draws=draws)


@pytest.mark.parametrize("mode", MODES)
def test_mlp_gradients_unbiased(mode: str) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(16, 20, dtype=torch.float64), torch.randint(5, (16,))
    ref, st = _unbiased(_mlp, x, y, mode, 0.25, 400)
    assert Z2_LOW < st.z_mean_square < Z2_HIGH, st
    assert st.max_abs_z < Z_MAX, st
    assert st.mean_cosine < 0.999  # the estimator really is random

    # power: the same test, against a reference 5% off, rejects it
    _, model = _pair(_mlp, 0.25, mode, torch.float64)
    biased = {n: 1.05 * g for n, g in ref.items()}
    st_b = estimator_stats(lambda: _step(model, x, y), biased, draws=400)
    assert st_b.z_mean_square > Z2_HIGH, st_b


@pytest.mark.parametrize("mode", MODES)
def test_cnn_gradients_unbiased(mode: str) -> None:
    torch.manual_seed(2)
    x, y = torch.randn(6, 2, 8, 8, dtype=torch.float64), torch.randint(3, (6,))
    _, st = _unbiased(_cnn, x, y, mode, 0.25, 300)
    assert Z2_LOW < st.z_mean_square < Z2_HIGH, st
    assert st.max_abs_z < Z_MAX, st


def test_with_replacement_unbiased_and_not_exact() -> None:
    torch.manual_seed(3)
    x, y = torch.randn(16, 20, dtype=torch.float64), torch.randint(5, (16,))
    _, st = _unbiased(_mlp, x, y, "different", 0.25, 400, replace=True)
    assert Z2_LOW < st.z_mean_square < Z2_HIGH, st
    assert st.max_abs_z < Z_MAX, st


def _paper_mlp() -> nn.Sequential:
    """Appendix A's MNIST net: 784-300-300-300-10 with ReLU."""
    return nn.Sequential(
        nn.Linear(784, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(),
        nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 10),
    )  # fmt: skip


def _forward_saved(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """(bytes autograd saves, live bytes the tracker sees after the forward), params excluded.

    The input batch is copied inside the tracked region, so the tracker counts it
    exactly when something keeps it for backward (backprop's first Linear does).
    """
    with MemoryTracker(baseline=(model, x, y)) as tracker:
        with saved_tensor_bytes(*model.parameters(), y) as saved:
            loss = F.cross_entropy(model(x.clone()), y)
        live = tracker.current_bytes()
        loss.backward()
    return saved.bytes, live


@pytest.mark.parametrize("mode", MODES)
def test_saved_bytes_at_fraction_tenth(mode: str) -> None:
    torch.manual_seed(0)
    exact = _paper_mlp()
    model = copy.deepcopy(exact)
    rad.randomize(model, fraction=0.1, mode=mode, seed=0)
    x, y = torch.rand(150, 784), torch.randint(10, (150,))
    saved_exact, live_exact = _forward_saved(exact, x, y)
    saved_rad, live_rad = _forward_saved(model, x, y)
    # the paper's accounting (Appendix A): 6776 vs 828.5 bytes per example (ratio 0.122)
    assert saved_exact >= 150 * (784 + 900 + 10) * 4
    assert saved_rad <= 0.15 * saved_exact, (saved_rad, saved_exact)
    assert live_rad <= 0.15 * live_exact, (live_rad, live_exact)
    print(f"{mode}: saved {saved_rad}/{saved_exact} = {saved_rad / saved_exact:.4f}, "
          f"tracker {live_rad}/{live_exact} = {live_rad / live_exact:.4f}")


def test_bitrelu_saves_one_bit_and_pooling_saves_nothing() -> None:
    x = torch.randn(3, 5, 7, 9, requires_grad=True)
    with saved_tensor_bytes(x) as s:
        y = rad.BitReLU()(x)
    assert s.bytes == math.ceil(x.numel() / 8)
    with saved_tensor_bytes() as s:
        z = rad.LeanAvgPool2d(2)(y).sum() + rad.LeanAdaptiveAvgPool2d(2)(y).sum()
    assert s.bytes == 0
    z.backward()
    x2 = x.detach().clone().requires_grad_()
    y2 = torch.relu(x2)
    (F.avg_pool2d(y2, 2).sum() + F.adaptive_avg_pool2d(y2, 2).sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_seeded_layers_reproduce_and_new_sample_each_call() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 30)
    grads = []
    for _ in range(2):
        torch.manual_seed(1)  # same initial weights; the sampler has its own seed
        layer = rad.RandLinear(30, 4, fraction=0.2, seed=7)
        torch.randn(5)  # moves the global RNG: the seeded sampler must not care
        g1 = torch.autograd.grad(layer(x).square().sum(), layer.weight)[0]
        g2 = torch.autograd.grad(layer(x).square().sum(), layer.weight)[0]
        grads.append((g1, g2))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)
    assert not torch.equal(grads[0][0], grads[0][1])


def test_same_mode_touches_only_sampled_columns() -> None:
    layer = rad.RandLinear(50, 3, fraction=0.1, mode="same", seed=0)
    g = torch.autograd.grad(layer(torch.randn(16, 50)).sum(), layer.weight)[0]
    assert int((g.abs().sum(0) > 0).sum()) == 5  # ceil(0.1 * 50) shared columns
    layer = rad.RandLinear(50, 3, fraction=0.1, mode="different", seed=0)
    g = torch.autograd.grad(layer(torch.randn(16, 50)).sum(), layer.weight)[0]
    assert int((g.abs().sum(0) > 0).sum()) > 5  # per-example samples cover more columns


def test_bad_fraction_and_mode_name_the_condition() -> None:
    for bad in (0, 0.0, -0.1, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(rad.RadInputError, match=r"fraction must be a number in \(0, 1\]"):
            rad.RandLinear(4, 2, fraction=bad)  # type: ignore[arg-type]
        with pytest.raises(rad.RadInputError, match=r"fraction must be a number in \(0, 1\]"):
            rad.randomize(_mlp(), fraction=bad)  # type: ignore[arg-type]
    with pytest.raises(rad.RadInputError, match="unknown mode 'rand'; known modes: different"):
        rad.RandConv2d(2, 2, 3, mode="rand")


def test_different_mode_needs_a_batch_dimension() -> None:
    with pytest.raises(rad.RadInputError, match=r"needs a batch dimension.*x\.unsqueeze"):
        rad.RandLinear(6, 2, fraction=0.5)(torch.randn(6))
    with pytest.raises(rad.RadInputError, match="RandConv2d: mode 'different' draws a separate"):
        rad.RandConv2d(2, 2, 3, fraction=0.5)(torch.randn(2, 5, 5))
    with pytest.raises(rad.RadInputError, match=r"RandGRUCell.*needs a batch dimension"):
        rad.RandGRUCell(3, 4, fraction=0.5)(torch.randn(3))
    # modes that share the sample work unbatched, like nn.Linear / nn.Conv2d
    assert rad.RandLinear(6, 2, fraction=0.5, mode="same")(torch.randn(6)).shape == (2,)
    assert rad.RandConv2d(2, 2, 3, mode="project")(torch.randn(2, 5, 5)).shape == (2, 3, 3)
