"""leangrad.bits: exact layers that keep 1-bit masks (ReLU, LeakyReLU, dropout) or nothing
(average pooling), and the ``bits`` transform. Values and gradients equal PyTorch's
(float64, exactly: the same formulas), dropout draws the same masks from the same RNG,
and what is kept is asserted in bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import leangrad
from leangrad import bits
from leangrad.measure import saved_tensor_bytes


@pytest.mark.parametrize(
    ("plain", "lean"),
    [
        (nn.ReLU(), bits.BitReLU()),
        (nn.LeakyReLU(0.1), bits.BitLeakyReLU(0.1)),
        (nn.Dropout(0.3), bits.BitDropout(0.3)),
        (nn.AvgPool2d(2), bits.LeanAvgPool2d(2)),
        (nn.AdaptiveAvgPool2d(3), bits.LeanAdaptiveAvgPool2d(3)),
    ],
    ids=["relu", "leaky_relu", "dropout", "avgpool", "adaptive_avgpool"],
)
def test_lean_layers_equal_pytorchs_exactly(plain: nn.Module, lean: nn.Module) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    x.view(-1)[:5] = 0.0  # the kink: derivative conventions must match too
    g = torch.randn_like(plain(x))
    outs, grads, rngs = [], [], []
    for m in (plain, lean):
        xi = x.clone().requires_grad_()
        torch.manual_seed(1)
        y = m(xi)
        y.backward(g)
        outs.append(y.detach())
        grads.append(xi.grad)
        rngs.append(torch.get_rng_state())
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(rngs[0], rngs[1])


@pytest.mark.parametrize(
    ("plain", "lean", "most"),
    [(nn.ReLU(), bits.BitReLU(), 1 / 8), (nn.LeakyReLU(0.1), bits.BitLeakyReLU(0.1), 1 / 8),
     (nn.Dropout(0.3), bits.BitDropout(0.3), 1 / 8), (nn.AvgPool2d(2), bits.LeanAvgPool2d(2), 0)],
    ids=["relu", "leaky_relu", "dropout", "avgpool"],
)  # fmt: skip
def test_lean_layers_keep_at_most_a_bit_per_element(plain: nn.Module, lean: nn.Module,
                                                    most: float) -> None:  # fmt: skip
    x = torch.randn(8, 4, 16, 16, requires_grad=True)
    kept = []
    for m in (plain, lean):
        with saved_tensor_bytes() as counter:  # the input too: plain layers keep it
            y = m(x)
        kept.append(counter.bytes)
        del y
    assert kept[0] > 0
    assert kept[1] <= most * x.numel() + 64  # numel/8 bytes for a bit mask, 0 for pooling
    assert kept[1] < kept[0] / 7


def test_dropout_in_eval_mode_and_extremes() -> None:
    x = torch.randn(5, 4)
    d = bits.BitDropout(0.5).eval()
    assert d(x) is x
    assert torch.equal(bits.BitDropout(1.0).train()(x), torch.zeros_like(x))


def test_swap_reports_what_it_changed_and_keeps_the_training_mode() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Dropout(0.2),
                          nn.Sequential(nn.LeakyReLU(), nn.Tanh()))  # fmt: skip
    model[2].eval()
    report = bits.swap(model)
    assert report.swapped == {"1": "ReLU -> BitReLU", "2": "Dropout -> BitDropout",
                              "3.0": "LeakyReLU -> BitLeakyReLU"}  # fmt: skip
    assert not model[2].training
    assert "3.0: LeakyReLU -> BitLeakyReLU" in str(report)
    assert "nothing to swap" in str(bits.swap(nn.Linear(2, 2)))


def test_bits_engine_saves_where_nothing_else_keeps_the_tensor() -> None:
    """A ReLU whose output only a dropout and a residual add read, and the dropout's mask
    (a full float tensor on CPU): both become bits; the gradient is autograd's, to the
    bit, with the same dropout masks."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)
            self.act = nn.ReLU()
            self.drop = nn.Dropout(0.1)
            self.out = nn.Linear(64, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.act(self.lin(x))
            return self.out(a + self.drop(a))

    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(512, 64, dtype=torch.float64)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    ref = copy.deepcopy(model)
    torch.manual_seed(3)
    loss_fn(ref(x)).backward()
    torch.manual_seed(3)
    leangrad.engine("bits").backward(model, x, loss_fn)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, r.grad)
    plain = leangrad.measure.profile_step(leangrad.engine("backprop"), model, x, loss_fn,
                                          repeats=0)  # fmt: skip
    lean = leangrad.measure.profile_step(leangrad.engine("bits"), model, x, loss_fn, repeats=0)
    assert lean.kept_bytes is not None and plain.kept_bytes is not None
    tensor = x.numel() * 8
    assert lean.kept_bytes < plain.kept_bytes - 2 * (tensor - tensor // 64 - 64)
    assert lean.peak_bytes < plain.peak_bytes
