"""Randomized RNN (IRNN) and GRU cells: exact at fraction 1, unbiased, new sample per step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leangrad import rad
from leangrad.measure import estimator_stats, saved_tensor_bytes

# See tests/rad/test_layers.py for the justification of these bounds.
Z2_LOW, Z2_HIGH, Z_MAX = 0.3, 1.6, 6.0


class _Seq(nn.Module):
    def __init__(self, cell: nn.Module, hidden: int) -> None:
        super().__init__()
        self.cell = cell
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = None
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h)


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _cells() -> dict[str, nn.Module]:
    return {
        "irnn": nn.RNNCell(4, 6, nonlinearity="relu"),
        "tanh": nn.RNNCell(4, 6),
        "gru": nn.GRUCell(4, 6),
    }


@pytest.mark.parametrize("kind", ["irnn", "tanh", "gru"])
@pytest.mark.parametrize("mode", ["different", "same", "project"])
def test_cells_unbiased_over_time(kind: str, mode: str) -> None:
    torch.manual_seed(0)
    exact = _Seq(_cells()[kind], 6).double()
    model = copy.deepcopy(exact)
    rad.randomize(model, fraction=0.34, mode=mode, seed=1)
    x, y = torch.randn(8, 4, 4, dtype=torch.float64), torch.randint(3, (8,))
    ref = _grads(exact, x, y)
    st = estimator_stats(lambda: _grads(model, x, y), ref, draws=200)
    assert Z2_LOW < st.z_mean_square < Z2_HIGH, st
    assert st.max_abs_z < Z_MAX, st
    at_one = copy.deepcopy(exact)
    rad.randomize(at_one, fraction=1.0, mode=mode)
    got = _grads(at_one, x, y)
    for n in ref:
        assert (got[n] - ref[n]).abs().max().item() <= 1e-12, n


def test_new_sample_every_time_step() -> None:
    cell = rad.RandRNNCell(20, 10, nonlinearity="relu", fraction=0.3, mode="same", seed=0)
    x = torch.randn(2, 20)
    cols = []
    for _ in range(3):  # three calls = three time steps: each draws its own 6 of 20 columns
        g = torch.autograd.grad(cell(x).sum(), cell.weight_ih)[0]
        cols.append(set((g.abs().sum(0) > 0).nonzero().reshape(-1).tolist()))
    assert all(len(c) <= 6 for c in cols)
    assert len(cols[0] | cols[1] | cols[2]) > 6


def test_irnn_init_and_saved_bytes() -> None:
    cell = rad.irnn_cell(28, 100, fraction=0.1, seed=0)
    assert torch.equal(cell.weight_hh, torch.eye(100)) and cell.bias_hh.abs().sum() == 0
    exact = nn.RNNCell(28, 100, nonlinearity="relu")
    x = torch.rand(32, 28, 28)
    saved = {}
    for name, c in (("exact", exact), ("rad", cell)):
        with saved_tensor_bytes(*c.parameters()) as s:
            h = None
            for t in range(28):
                h = c(x[:, t].clone(), h)  # a fresh step input, as a real sequence loader gives
        saved[name] = s.bytes
    # exact keeps x_t and h_t (and the pre-activation) per step; RAD keeps 10% + 1 bit per unit
    assert saved["rad"] <= 0.15 * saved["exact"], saved


def test_gru_saved_bytes_are_gates_plus_samples() -> None:
    b, d, hidden, steps = 32, 28, 100, 28
    x = torch.rand(b, steps, d)
    saved = {}
    for name, cell in (
        ("exact", nn.GRUCell(d, hidden)),
        ("rad", rad.RandGRUCell(d, hidden, fraction=0.1, seed=0)),
    ):
        with saved_tensor_bytes(*cell.parameters()) as s:
            h = None
            for t in range(steps):
                h = cell(x[:, t].clone(), h)
        saved[name] = s.bytes
    # per step: r, z, n, h_n, h (5H, exact gate derivatives) + 10% of x and of h, float32
    assert saved["rad"] == steps * b * (5 * hidden + 3 + 10) * 4
    assert saved["rad"] <= 0.75 * saved["exact"], saved
