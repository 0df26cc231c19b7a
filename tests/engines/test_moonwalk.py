"""Moonwalk and RevBackprop: behaviour beyond the reference test (what is stored, errors)."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import Chain, EngineInputError, models
from leangrad.engines._chain_run import NOT_A_CHAIN
from leangrad.engines._moonwalk import BAD_MODE
from leangrad.layers import LeakyReLU, NotInvertibleError, NotSubmersiveError, SubmersiveConv2d
from leangrad.layers._chain import NO_RULES
from leangrad.measure import MemoryTracker, compare_grads, grads_of


def _subcnn(depth: int = 3, dtype: torch.dtype = torch.float64, batch: int = 4, size: int = 32):
    torch.manual_seed(0)
    model = models.submersive_cnn(3, 8, depth, 5).to(dtype)
    x = torch.randn(batch, 3, size, size, dtype=dtype)
    y = torch.randint(0, 5, (batch,))
    return model, x, lambda out: F.cross_entropy(out, y)


def _forward_live(engine: str, model: nn.Module, x: torch.Tensor, loss_fn, **opts) -> int:  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    with MemoryTracker(baseline=(model, x)) as tracker:
        leangrad.engine(engine, **opts).backward(model, x, loss_fn)
    live = tracker.report.forward_live_bytes
    assert live is not None
    return live


def test_mixed_moonwalk_keeps_only_bit_masks() -> None:
    """Phase I keeps, per LeakyReLU, one bit per element and nothing for the convs; the
    stem output x0 is replayed for Phase III, not kept. Measured by the tracker."""
    model, x, loss_fn = _subcnn(depth=3, dtype=torch.float32)
    live = _forward_live("moonwalk", model, x, loss_fn)
    with torch.no_grad():
        x0 = model.stem(x)
        bits, h = 0, x0
        for layer in model.layers:
            h = layer(h)
            if isinstance(layer, LeakyReLU):
                bits += (h.numel() + 7) // 8
    head_and_loss = 4 * 1024  # head graph on a (4, 8) feature map and the loss: a few KiB
    assert bits <= live <= bits + head_and_loss
    # Backprop keeps every conv input and LeakyReLU input in float32: 32x more per element.
    assert live < 0.05 * _forward_live("backprop", model, x, loss_fn)


@pytest.mark.parametrize("stem_chunks", [1, 4])
def test_moonwalk_seeded_at_h1_keeps_only_bit_masks(stem_chunks: int) -> None:
    """Behind a parameter-free stem Phase I starts at x1 = f1(x0); x1 is dropped once the
    second layer has run, as x0 is on the other path (a reference the seed kept to x1 once
    held a full-size activation through Phase II: 0.41x -> 0.56x of backprop's peak)."""
    torch.manual_seed(0)
    model = models.submersive_cnn(3, 8, 3, 5, stem="repeat")
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    live = _forward_live(
        "moonwalk", model, x, lambda out: F.cross_entropy(out, y), stem_chunks=stem_chunks
    )
    with torch.no_grad():
        h, bits = model.stem(x), 0
        for layer in model.layers:
            h = layer(h)
            if isinstance(layer, LeakyReLU):
                bits += (h.numel() + 7) // 8
    x1_bytes = 4 * 8 * 16 * 16 * 4
    assert bits <= live <= bits + 4 * 1024 < x1_bytes


def test_moonwalk_segments_keep_less_than_every_residual() -> None:
    """Couplings keep half their input each; with ⌈√L⌉ segments only the segment inputs
    are kept (v2 Appendix 11, "Moonwalk + checkpoint"). Bit masks, by contrast, are
    smaller than any segment input, so on the submersive CNN segments would not help."""
    torch.manual_seed(0)
    model = models.revnet(1, 8, 10, blocks=1, layers_per_block=16)
    x, y = torch.randn(16, 1, 16, 16), torch.randint(0, 10, (16,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    full = _forward_live("moonwalk", model, x, loss_fn)
    seg = _forward_live("moonwalk", model, x, loss_fn, segments="sqrt")
    half_input = x.numel() * 8 // 2 * 4  # x1 of one coupling, float32
    assert full >= 16 * half_input
    # ⌈√L⌉ segment inputs (L = 32: couplings and swaps), plus the chain output under the head.
    segments = math.ceil(math.sqrt(len(model.layers)))
    assert segments == 6
    assert seg <= (segments + 1) * 2 * half_input + 4096 < full


def test_pure_moonwalk_keeps_nothing_but_the_chain_input() -> None:
    """No residuals at all: only x0, the point the jvps are taken at."""
    model, x, loss_fn = _subcnn(depth=2, dtype=torch.float32, batch=1, size=8)
    x0_bytes = 1 * 8 * 8 * 8 * 4
    assert _forward_live("moonwalk", model, x, loss_fn, mode="pure", chunk_size=64) == x0_bytes


def test_moonwalk_is_exact_on_deep_float32_chains() -> None:
    """The target: float32 ≤ 1e-4 relative at depth 8 with default initialisation."""
    model, x, loss_fn = _subcnn(depth=5, dtype=torch.float32, size=32)
    ref = copy.deepcopy(model).double()
    loss_fn(ref(x.double())).backward()
    leangrad.engine("moonwalk").backward(model, x, loss_fn)
    assert compare_grads(grads_of(model), grads_of(ref)).max_rel_err <= 1e-4
    torch.manual_seed(1)
    rev = models.revnet(1, 8, 10, blocks=2, layers_per_block=4)  # 8 couplings + ψ
    xr, yr = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    ref = copy.deepcopy(rev).double()
    F.cross_entropy(ref(xr.double()), yr).backward()
    leangrad.engine("moonwalk").backward(rev, xr, lambda o: F.cross_entropy(o, yr))
    assert compare_grads(grads_of(rev), grads_of(ref)).max_rel_err <= 1e-4


def test_moonwalk_needs_a_chain() -> None:
    model = models.mlp(4, 4, 2, 3)
    msg = NOT_A_CHAIN.format(engine="moonwalk", model="Sequential")
    with pytest.raises(EngineInputError, match=re.escape(msg)):
        leangrad.engine("moonwalk").backward(model, torch.randn(2, 4), lambda o: o.sum())


def test_chain_layer_without_rules_is_named() -> None:
    chain = Chain(nn.Linear(4, 4), head=nn.Linear(4, 2))
    msg = NO_RULES.format(index=0, layer="Linear", engine="moonwalk")
    with pytest.raises(EngineInputError, match=re.escape(msg)):
        leangrad.engine("moonwalk").backward(chain, torch.randn(2, 4), lambda o: o.sum())


class _Square(leangrad.ChainLayer):
    """Has rules (autograd defaults) but no vijp: not submersive."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def test_non_submersive_layer_is_named_with_the_fix() -> None:
    chain = Chain(LeakyReLU(0.1), _Square(), head=nn.Linear(4, 2))
    with pytest.raises(NotSubmersiveError, match=r"chain layer 1: _Square\(\) is not submersive"):
        leangrad.engine("moonwalk").backward(chain, torch.randn(2, 4), lambda o: o.sum())
    with pytest.raises(NotSubmersiveError, match="'checkpoint' engine"):
        leangrad.engine("moonwalk").backward(chain, torch.randn(2, 4), lambda o: o.sum())
    # The checkpoint engine the message suggests does run on it.
    leangrad.engine("checkpoint").backward(chain, torch.randn(2, 4), lambda o: o.sum())


def test_revbackprop_needs_invertible_layers() -> None:
    chain = Chain(SubmersiveConv2d(4, 4, 3, stride=2, padding=1), head=nn.Flatten())
    msg = r"chain layer 0: SubmersiveConv2d.* is not invertible"
    with pytest.raises(NotInvertibleError, match=msg):
        leangrad.engine("revbackprop").backward(chain, torch.randn(1, 4, 4, 4), lambda o: o.sum())


def test_bad_moonwalk_options() -> None:
    with pytest.raises(ValueError, match=re.escape(BAD_MODE.format(value="reverse"))):
        leangrad.engine("moonwalk", mode="reverse")
    with pytest.raises(ValueError, match="segments applies to mode='mixed' only"):
        leangrad.engine("moonwalk", mode="pure", segments=2)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        leangrad.engine("moonwalk", mode="pure", chunk_size=0)


def test_on_grad_runs_during_the_forward_sweep_in_layer_order() -> None:
    """Algorithm 1: g_i is handed over as soon as it exists, layer by layer — so the
    chain's parameters arrive in forward order, after the head's."""
    model, x, loss_fn = _subcnn(depth=3)
    order: list[str] = []
    leangrad.engine("moonwalk").backward(model, x, loss_fn, on_grad=lambda n, p: order.append(n))
    layer_names = [n for n in order if n.startswith("layers.")]
    assert layer_names == sorted(layer_names, key=lambda n: int(n.split(".")[1]))
    assert order.index(layer_names[0]) > max(order.index(n) for n in order if n.startswith("head."))


def test_seeding_with_h1_and_stem_chunks_lower_the_peak_and_stay_exact() -> None:
    """Behind a parameter-free stem, Phase II stops at h1 and x0 is rebuilt in batch
    chunks (v2 section 4.3's alternative seed): the full-size x0 never lives whole."""
    torch.manual_seed(0)
    model = models.submersive_cnn(3, 8, 3, 5, stem="repeat").double()
    x, y = torch.randn(8, 3, 32, 32, dtype=torch.float64), torch.randint(0, 5, (8,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    peaks = {}
    for chunks in (1, 4):
        m = copy.deepcopy(model)
        with MemoryTracker(baseline=(m, x)) as tracker:
            leangrad.engine("moonwalk", stem_chunks=chunks).backward(m, x, loss_fn)
        peaks[chunks] = tracker.report.peak_bytes
        assert compare_grads(grads_of(m), grads_of(ref)).max_rel_err <= 1e-10
    with MemoryTracker(baseline=(ref, x)) as tracker:
        leangrad.engine("backprop").backward(copy.deepcopy(model), x, loss_fn)
    x0_bytes = 8 * 8 * 32 * 32 * 8
    assert peaks[4] < peaks[1] - x0_bytes // 2
    assert peaks[4] < 0.75 * tracker.report.peak_bytes


def test_swap_halves_rules() -> None:
    """SwapHalves is its own vjp, vijp and inverse; odd sizes raise naming the layer."""
    from leangrad.layers import SwapHalves

    layer = SwapHalves()
    x = torch.randn(2, 6, 3, 3, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    h = torch.randn_like(y)
    (ref,) = torch.autograd.grad(y, x, h)
    torch.testing.assert_close(layer.vjp_input(layer.residual(x, y), h), ref, rtol=0, atol=0)
    torch.testing.assert_close(layer.vijp(None, layer.vjp_input(None, h)), h, rtol=0, atol=0)
    torch.testing.assert_close(layer.inverse(y), x.detach(), rtol=0, atol=0)
    with pytest.raises(leangrad.layers.LayerConditionError, match=r"SwapHalves\(dim=1\).*odd"):
        layer(torch.randn(1, 3, 2, 2))


def test_revnet_couplings_alternate_halves() -> None:
    model = models.revnet(1, 8, 10, blocks=1, layers_per_block=3)
    kinds = [type(m).__name__ for m in model.layers]
    assert kinds == ["AdditiveCoupling", "SwapHalves"] * 3


def test_stem_chunks_auto_chunks_when_safe_and_says_why_not() -> None:
    """The default picks the measured best variant (4 chunks) where the stem and the first
    layer treat examples independently: exact, and a lower tracked peak than 1 chunk; with
    a training-mode BatchNorm in the stem it uses 1 chunk and says why."""
    import copy

    import torch.nn.functional as F

    from leangrad.measure import MemoryTracker

    torch.manual_seed(0)
    model = leangrad.models.submersive_cnn(3, 16, depth=3, classes=4, stem="repeat")
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 4, (8,))
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    res = leangrad.engine("moonwalk").backward(model, x, loss_fn)
    assert res.info["stem_chunks"] == 4 and "stem_chunks_note" not in res.info
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5)

    def peak(eng: leangrad.Engine) -> int:
        model.zero_grad(set_to_none=True)
        with MemoryTracker(baseline=(model, x)) as tracker:
            eng.backward(model, x, loss_fn)
        return tracker.report.peak_bytes

    assert peak(leangrad.engine("moonwalk")) < peak(leangrad.engine("moonwalk", stem_chunks=1))

    model.stem = torch.nn.Sequential(model.stem, torch.nn.BatchNorm2d(16, affine=False))
    res = leangrad.engine("moonwalk").backward(model, x, loss_fn)
    assert res.info["stem_chunks"] == 1
    assert "BatchNorm2d '1' in training mode" in res.info["stem_chunks_note"]


@pytest.mark.parametrize("stem_chunks", ["auto", 4])
def test_stem_chunks_says_why_it_did_not_apply(stem_chunks: object) -> None:
    """A trainable stem needs h0 whole: no h1 seed, so no chunks — and the step says so."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = leangrad.models.submersive_cnn(3, 8, depth=2, classes=4, stem="conv")
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 4, (4,))
    res = leangrad.engine("moonwalk", stem_chunks=stem_chunks).backward(
        model, x, lambda out: F.cross_entropy(out, y)
    )
    assert res.info["stem_chunks"] == 1
    assert "the stem has parameters to train" in res.info["stem_chunks_note"]
    res = leangrad.engine("moonwalk", stem_chunks=1).backward(
        model, x, lambda out: F.cross_entropy(out, y)
    )
    assert "stem_chunks_note" not in res.info  # asked for one chunk: nothing to explain
