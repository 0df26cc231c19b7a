"""Fragmental checkpointing (Moonwalk v2 section 5.1, Appendix 10, Algorithm 3):
FragmentalConv1d/2d rules, moonwalk(fragment=B) exactness, what is stored, bad input.

Tolerances: the rebuild of eq. (20) is a causal recursion, so rounding errors can grow
along a block; in float64 they stay below 1e-12 relative on these sizes (measured
~1e-14 at B=16), and Moonwalk gradients are held to the reference test's 1e-10 (f64)
and 1e-4 (f32, depth 8, as the issue asks).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import leangrad
from helpers import make_problem, reference_grads
from leangrad import Chain, models
from leangrad.engines._moonwalk import (
    BAD_FRAGMENT,
    FRAGMENT_NEEDS_MIXED,
    NEEDS_FRAGMENT,
    NO_FRAGMENT_RULE,
)
from leangrad.layers import (
    FragmentalConv1d,
    FragmentalConv2d,
    LayerConditionError,
    LeakyReLU,
    NotSubmersiveError,
    SubmersiveLinear,
)
from leangrad.layers._base import FRAGMENT_RULE, FragmentalLayer
from leangrad.layers._fragmental import (
    BLOCK_TOO_SMALL,
    EVEN_KERNEL,
    NEEDS_FRAGMENTS,
    UNSUPPORTED_PADDING,
    UNSUPPORTED_STRIDE,
    ZERO_DIAGONAL,
)
from leangrad.measure import MemoryTracker, compare_grads, grads_of


def _layer(rank: int, channels: int, k: int, **kw: object) -> nn.Module:
    cls = FragmentalConv1d if rank == 1 else FragmentalConv2d
    return cls(channels, k, **kw).double()


def _shape(rank: int, n: int, c: int, length: int) -> tuple[int, ...]:
    return (n, c, length) if rank == 1 else (n, c, length, 3)


# --- the layer --------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 2])
@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    k=st.sampled_from([1, 3, 5]),
    extra=st.integers(0, 13),
    length=st.integers(1, 40),
    channels=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_rebuild_is_exact(rank: int, k: int, extra: int, length: int, channels: int,
                          seed: int) -> None:  # fmt: skip
    """h' rebuilt from h = h' ∂y/∂x and the fragments equals h' (float64, ≤1e-12), for any
    block size B ≥ k, including ragged last blocks and blocks longer than the input."""
    torch.manual_seed(seed)
    block = k + extra
    layer = _layer(rank, channels, k)
    h_out = torch.randn(_shape(rank, 2, channels, length), dtype=torch.float64)
    h_in = layer.vjp_input(None, h_out)
    frags = layer.fragments(h_out, block)
    rebuilt = layer.vijp_fragments(None, h_in, frags, block)
    assert rebuilt.shape == h_out.shape
    err = (rebuilt - h_out).abs().max() / h_out.abs().max()
    assert err <= 1e-12


def test_vjp_input_is_the_convolution_transpose() -> None:
    """vjp_input equals autograd's input gradient (the layer keeps no residual)."""
    for rank in (1, 2):
        layer = _layer(rank, 4, 3)
        x = torch.randn(_shape(rank, 2, 4, 9), dtype=torch.float64, requires_grad=True)
        h = torch.randn_like(x)
        (ref,) = torch.autograd.grad(layer(x), x, h)
        assert layer.residual(x, layer(x)) is None
        torch.testing.assert_close(layer.vjp_input(None, h), ref, rtol=1e-12, atol=1e-12)


def test_fragments_are_the_first_k_minus_1_positions_of_each_block() -> None:
    """What Phase II keeps: positions bB … bB+k−2 of h' (Algorithm 3's h_init), as a
    compact copy — not a view that would keep the whole cotangent alive."""
    layer = _layer(1, 3, 5)
    h = torch.randn(2, 3, 22, dtype=torch.float64)
    frags = layer.fragments(h, 8)  # blocks at 0, 8, 16 (ragged: 6 positions)
    assert frags.shape == (2, 3, 3, 4, 1)
    for b in range(3):
        torch.testing.assert_close(frags[:, :, b, :, 0], h[:, :, 8 * b : 8 * b + 4])
    assert frags.untyped_storage().nbytes() == frags.numel() * 8
    assert frags.untyped_storage().data_ptr() != h.untyped_storage().data_ptr()
    short = layer.fragments(h[:, :, :10], 8)  # last block of 2 < k−1: zero-padded
    torch.testing.assert_close(short[:, :, 1, :2, 0], h[:, :, 8:10])
    assert short[:, :, 1, 2:].abs().max() == 0


def test_weight_structure() -> None:
    """First tap channel-triangular with unit diagonal (1D); in 2D the first kernel row is
    zero except its centre tap."""
    w1 = _layer(1, 4, 3).weight.detach()
    a = w1[:, :, 0]
    torch.testing.assert_close(a.diagonal(), torch.ones(4, dtype=torch.float64))
    assert torch.tril(a, diagonal=-1).abs().max() == 0
    w2 = _layer(2, 4, 3).weight.detach()
    assert w2[:, :, 0, 0].abs().max() == 0 and w2[:, :, 0, 2].abs().max() == 0
    assert torch.tril(w2[:, :, 0, 1], diagonal=-1).abs().max() == 0
    learned = _layer(1, 4, 3, unit_diagonal=False).weight.detach()[:, :, 0]
    torch.testing.assert_close(learned.diagonal(), torch.ones(4, dtype=torch.float64))


# --- moonwalk(fragment=B) ---------------------------------------------------------


@pytest.mark.parametrize("fragment", [3, 4, 16, "full"])
@pytest.mark.parametrize("stem", ["conv", "repeat"])
def test_moonwalk_fragmental_float32_depth8(fragment: int | str, stem: str) -> None:
    """The issue's target: float32 gradients within 1e-4 of autograd at depth 8 (length 100,
    not a multiple of the block sizes), with and without stem parameters."""
    torch.manual_seed(0)
    model = models.fragmental_cnn1d(3, 8, 8, 5, stem=stem)
    x, y = torch.randn(4, 3, 100), torch.randint(0, 5, (4,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    _, ref = reference_grads(model.double(), (x.double(),), loss_fn)
    model.float()
    leangrad.engine("moonwalk", fragment=fragment).backward(model, x, loss_fn)
    cmp = compare_grads(grads_of(model), ref)
    assert cmp.max_rel_err <= 1e-4, (cmp.worst_param, cmp.per_param)


def test_kept_cotangent_bytes_follow_k_minus_1_over_b() -> None:
    """Stored cotangent bytes: B=4 keeps half of full cotangent checkpointing and B=16 one
    eighth (k=3, length divisible by 16), as the paper's arithmetic says; measured on the
    storages Phase II actually holds."""
    prob = make_problem("frag1d", torch.float64, sizes={"height": 16, "wide": 0, "depth": 3})
    kept = {}
    for fragment in ("full", 4, 16):
        res = leangrad.engine("moonwalk", fragment=fragment).backward(
            prob.model, prob.inputs, prob.loss_fn
        )
        kept[fragment] = res.info["kept_cotangent_bytes"]
    assert kept[4] * 2 == kept["full"]
    assert kept[16] * 8 == kept["full"]


def test_fragment_lowers_the_tracked_peak() -> None:
    """Memory behaviour at the allocator level: peak(B=16) < peak(B=4) < peak(full), and
    B=4 below backprop's peak (3 layers of 16 channels, length 256)."""
    torch.manual_seed(0)
    model = models.fragmental_cnn1d(3, 16, 6, 4, stem="repeat")
    x, y = torch.randn(8, 3, 256), torch.randint(0, 4, (8,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    peaks = {}
    for label, eng in [
        ("backprop", leangrad.engine("backprop")),
        ("full", leangrad.engine("moonwalk", fragment="full")),
        (4, leangrad.engine("moonwalk", fragment=4)),
        (16, leangrad.engine("moonwalk", fragment=16)),
    ]:
        model.zero_grad(set_to_none=True)
        eng.backward(model, x, loss_fn)  # grads exist: the tracked step only adds to them
        with MemoryTracker(baseline=(model, x)) as tracker:
            eng.backward(model, x, loss_fn)
        peaks[label] = tracker.report.peak_bytes
    assert peaks[16] < peaks[4] < peaks["full"]
    assert peaks[4] < peaks["backprop"]


# --- bad input ----------------------------------------------------------------------


def test_layer_construction_errors() -> None:
    name = "FragmentalConv1d(channels=4, kernel_size={k})"
    with pytest.raises(LayerConditionError) as err:
        FragmentalConv1d(4, 4)
    assert str(err.value) == EVEN_KERNEL.format(layer=name.format(k=4), k=4)
    with pytest.raises(LayerConditionError) as err:
        FragmentalConv1d(4, 3, stride=2)
    assert str(err.value) == UNSUPPORTED_STRIDE.format(layer=name.format(k=3), stride=2)
    with pytest.raises(LayerConditionError) as err:
        FragmentalConv1d(4, 3, padding=0)
    assert str(err.value) == UNSUPPORTED_PADDING.format(layer=name.format(k=3), p=1, padding=0)
    FragmentalConv1d(4, 3, padding=1)  # the explicit 'same' padding is accepted
    FragmentalConv2d(4, 3, padding=(1, 1))


def test_block_smaller_than_kernel_is_refused() -> None:
    model = models.fragmental_cnn1d(2, 3, 2, 3, kernel_size=5)
    layer = model.layers[0]
    msg = BLOCK_TOO_SMALL.format(layer=layer._describe(), block=4, k=5, k_1=4)
    eng = leangrad.engine("moonwalk", fragment=4)
    assert eng.supports(model) == msg
    with pytest.raises(LayerConditionError) as err:
        eng.backward(model, torch.randn(2, 2, 12), lambda out: out.sum())
    assert str(err.value) == msg
    assert leangrad.engine("moonwalk", fragment=5).supports(model) is None


def test_zero_first_tap_diagonal_is_refused() -> None:
    layer = FragmentalConv1d(3, 3, unit_diagonal=False)
    with torch.no_grad():
        layer.weight_raw[1, 1, 0] = 0.0
    msg = ZERO_DIAGONAL.format(layer=layer._describe(), c=1, value=0.0)
    with pytest.raises(LayerConditionError) as err:
        layer.check()
    assert str(err.value) == msg
    model = Chain(layer, head=nn.Flatten())
    with pytest.raises(LayerConditionError) as err:
        leangrad.engine("moonwalk", fragment=3).backward(
            model, torch.randn(2, 3, 8), lambda out: out.square().sum()
        )
    assert str(err.value) == msg


def test_learned_diagonal_is_exact() -> None:
    """unit_diagonal=False: the diagonal is a parameter (solved by, not assumed 1)."""
    torch.manual_seed(1)
    layer = FragmentalConv1d(3, 3, unit_diagonal=False).double()
    with torch.no_grad():
        layer._lead(layer.weight_raw).diagonal().copy_(torch.tensor([0.5, -2.0, 1.3]))
    model = Chain(layer, LeakyReLU(0.1), head=nn.Flatten())
    x = torch.randn(2, 3, 11, dtype=torch.float64)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.sin().sum()

    _, ref = reference_grads(model, (x,), loss_fn)
    leangrad.engine("moonwalk", fragment=4).backward(model, x, loss_fn)
    assert compare_grads(grads_of(model), ref).max_rel_err <= 1e-10


def test_fragment_option_errors() -> None:
    for bad in (0, -2, "half", 2.5, True):
        with pytest.raises(ValueError) as err:
            leangrad.engine("moonwalk", fragment=bad)
        assert str(err.value) == BAD_FRAGMENT.format(value=bad)
    with pytest.raises(ValueError) as err:
        leangrad.engine("moonwalk", mode="pure", fragment=4)
    assert str(err.value) == FRAGMENT_NEEDS_MIXED


def test_non_submersive_layers_need_the_right_fragment_option() -> None:
    """Without fragment=, a fragmental layer says how to run it; with fragment=B, a
    non-submersive layer without fragment rules names fragment='full'."""
    model = models.fragmental_cnn1d(2, 3, 1, 3)
    layer = model.layers[0]
    reason = leangrad.engine("moonwalk").supports(model)
    assert reason == "chain layer 0: " + NEEDS_FRAGMENT.format(layer=layer._describe(),
                                                               block=None)  # fmt: skip
    with pytest.raises(NotSubmersiveError) as err:
        layer.vijp(None, torch.zeros(1, 3, 4))
    assert str(err.value) == NEEDS_FRAGMENTS.format(layer=layer._describe(), k=3, k_1=2)

    wide = SubmersiveLinear(3, 3)
    plain = Chain(_NotSubmersive(), wide, head=nn.Identity())
    reason = leangrad.engine("moonwalk", fragment=4).supports(plain)
    assert reason == "chain layer 0: " + NO_FRAGMENT_RULE.format(
        layer=plain.layers[0]._describe(), block=4
    )
    # fragment='full' runs any layer: its whole output cotangent is kept.
    x = torch.randn(4, 3, dtype=torch.float64)
    plain.double()

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.tanh().sum()

    _, ref = reference_grads(plain, (x,), loss_fn)
    res = leangrad.engine("moonwalk", fragment="full").backward(plain, x, loss_fn)
    assert compare_grads(grads_of(plain), ref).max_rel_err <= 1e-10
    assert res.info["kept_cotangent_bytes"] == 4 * 3 * 8


class _NotSubmersive(leangrad.ChainLayer):
    """A linear layer with generic (autograd) rules and no vijp: 3 -> 3, rank-deficient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _NoRules(FragmentalLayer):
    """A fragmental layer that forgot its rules."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_a_fragmental_layer_without_its_rules_names_them() -> None:
    layer, h = _NoRules(), torch.zeros(2, 3)
    calls = {
        "check_fragment": lambda: layer.check_fragment(4),
        "fragments": lambda: layer.fragments(h, 4),
        "vijp_fragments": lambda: layer.vijp_fragments(None, h, None, 4),
    }
    for rule, call in calls.items():
        with pytest.raises(NotImplementedError) as err:
            call()
        assert str(err.value) == FRAGMENT_RULE.format(layer="_NoRules", rule=rule)
    model = Chain(layer, SubmersiveLinear(3, 3))
    with pytest.raises(NotImplementedError) as err:
        leangrad.engine("moonwalk", fragment=4).backward(model, h, lambda out: out.sum())
    assert str(err.value) == FRAGMENT_RULE.format(layer="_NoRules", rule="check_fragment")


def test_wrong_input_shape_names_the_layer() -> None:
    layer = FragmentalConv1d(4, 3)
    with pytest.raises(LayerConditionError, match=r"needs an input of shape \(N, 4, L\)"):
        layer.check(torch.zeros(2, 5, 9))
    with torch.no_grad():
        assert math.isfinite(float(layer(torch.zeros(2, 4, 9)).sum()))


# --- the depth-at-budget search and the tracker's budget ------------------------------


def test_budget_aborts_the_step_that_crosses_it() -> None:
    """MemoryTracker(budget_bytes=) raises at the allocation that crosses the budget,
    naming the numbers; a step under the budget runs normally."""
    from leangrad.measure import MemoryBudgetExceeded
    from leangrad.measure._memory import BUDGET_EXCEEDED

    x = torch.zeros(250)  # 1000 bytes of baseline
    with MemoryTracker(baseline=(x,), budget_bytes=3000) as ok:
        a = torch.ones(500)
        del a
    assert ok.report.peak_bytes == 2000
    with pytest.raises(MemoryBudgetExceeded) as err, MemoryTracker(
        baseline=(x,), budget_bytes=3000
    ):
        kept = [torch.ones(250)]
        kept.append(torch.ones(500))  # 1000 + 1000 + 2000 > 3000
    assert str(err.value) == BUDGET_EXCEEDED.format(
        total=4000, baseline=1000, live=3000, budget=3000
    )
    assert isinstance(err.value, MemoryError)


@pytest.mark.parametrize("limit", [0, 1, 5, 10, 37, 64, 200])
def test_deepest_fitting_finds_the_boundary(limit: int) -> None:
    """Doubling + bisection finds the largest fitting depth of a monotone predicate,
    capped at max_depth, probing each depth at most once."""
    from leangrad_bench._fragmental import DepthProbe, deepest_fitting

    calls: list[int] = []

    def fits(d: int) -> DepthProbe:
        calls.append(d)
        return DepthProbe(depth=d, fits=d <= limit, total_bytes=None)

    depth, probes = deepest_fitting(fits, max_depth=100, extra_probes=2)
    assert depth == min(limit, 100)
    assert len(calls) == len(set(calls)) == len(probes)


def test_deepest_fitting_looks_past_a_non_monotone_dip() -> None:
    """A depth that fails between fitting ones (peak not monotone in depth) does not stop
    the search when a deeper probe fits."""
    from leangrad_bench._fragmental import DepthProbe, deepest_fitting

    fit = set(range(1, 10)) | {11}  # bisection stops at 9 | 10; the extra probes find 11
    depth, probes = deepest_fitting(
        lambda d: DepthProbe(depth=d, fits=d in fit, total_bytes=None),
        max_depth=64,
        extra_probes=2,
    )
    assert depth == 11
    assert [p["depth"] for p in probes] == [1, 2, 4, 8, 16, 12, 10, 9, 11, 12 + 1, 12 + 2]


def test_fragmental_cnn2d_under_moonwalk_is_exact() -> None:
    """models.fragmental_cnn2d (blocks of rows, ragged: 13 rows) trained by moonwalk with
    fragment=4 gives autograd's gradients (float64)."""
    torch.manual_seed(0)
    model = models.fragmental_cnn2d(2, 3, 2, 4).double()
    x, y = torch.randn(2, 2, 13, 6, dtype=torch.float64), torch.randint(0, 4, (2,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    _, ref = reference_grads(model, (x,), loss_fn)
    res = leangrad.engine("moonwalk", fragment=4).backward(model, x, loss_fn)
    assert compare_grads(grads_of(model), ref).max_rel_err <= 1e-10
    assert res.info["kept_cotangent_bytes"] == 2 * 2 * 3 * 4 * 2 * 6 * 8  # 2 layers, 4 blocks
