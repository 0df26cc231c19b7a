"""rad.randomize: swaps in place, shares weights, reports, warns about what it leaves exact."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leangrad import rad


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Sequential(nn.Linear(64, 8), nn.ReLU()), nn.Dropout(0.0),
        nn.Linear(8, 3),
    )  # fmt: skip


def test_swaps_in_place_shares_weights_and_reports() -> None:
    model = _model()
    params = {n: p for n, p in model.named_parameters()}
    with pytest.warns(UserWarning, match=r"left 2 layer\(s\) exact.*1 \(BatchNorm2d\)"):
        report = rad.randomize(model, fraction=0.5, mode="same")
    assert report.swapped == {
        "0": "Conv2d -> RandConv2d",
        "2": "ReLU -> BitReLU",
        "3": "AvgPool2d -> LeanAvgPool2d",
        "5.0": "Linear -> RandLinear",
        "5.1": "ReLU -> BitReLU",
        "7": "Linear -> RandLinear",
    }
    assert report.left_exact == ["1 (BatchNorm2d)", "6 (Dropout)"]
    assert (report.fraction, report.mode, report.replace) == (0.5, "same", False)
    assert isinstance(model[0], rad.RandConv2d) and isinstance(model[5][0], rad.RandLinear)
    for n, p in model.named_parameters():  # the same Parameter objects: optimizers keep working
        assert params[n] is p
    # randomizing twice swaps nothing new; the randomized layers take the (same) settings
    with pytest.warns(UserWarning):
        again = rad.randomize(model, fraction=0.5, mode="same")
    assert set(again.swapped) == {"0", "5.0", "7"}
    assert all(v.endswith("(settings replaced)") for v in again.swapped.values())
    assert isinstance(model[0], rad.RandConv2d) and isinstance(model[5][0], rad.RandLinear)


def test_training_step_with_an_optimizer_built_before_the_swap() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    rad.randomize(model, fraction=0.3, seed=0)
    F.cross_entropy(model(torch.randn(4, 10)), torch.tensor([0, 1, 0, 1])).backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_recurrent_cells_swapped_and_exact_at_fraction_one() -> None:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.RNNCell(3, 5, nonlinearity="relu")
            self.gru = nn.GRUCell(5, 4)
            self.out = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = g = None
            for t in range(x.shape[1]):
                h = self.rnn(x[:, t], h)
                g = self.gru(h, g)
            return self.out(g)

    exact = Net().double()
    model = copy.deepcopy(exact)
    report = rad.randomize(model, fraction=1.0)
    assert report.swapped == {
        "rnn": "RNNCell -> RandRNNCell", "gru": "GRUCell -> RandGRUCell",
        "out": "Linear -> RandLinear",
    }  # fmt: skip
    x, y = torch.randn(3, 6, 3, dtype=torch.float64), torch.tensor([0, 1, 1])
    for m in (exact, model):
        F.cross_entropy(m(x), y).backward()
    for (n, p), q in zip(exact.named_parameters(), model.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max().item() <= 1e-12, n


def test_root_layer_and_unsupported_root() -> None:
    with pytest.raises(rad.RadInputError, match=r"the model itself is a Linear; wrap it"):
        rad.randomize(nn.Linear(3, 2))
    with pytest.warns(UserWarning, match=r"<root> \(LayerNorm\)"):
        report = rad.randomize(nn.LayerNorm(3))
    assert report.swapped == {}


def test_conv_with_unsupported_padding_left_exact() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding="same"), nn.Flatten())
    with pytest.warns(UserWarning, match=r"0 \(Conv2d\)"):
        report = rad.randomize(model)
    assert report.left_exact == ["0 (Conv2d)"] and type(model[0]) is nn.Conv2d
