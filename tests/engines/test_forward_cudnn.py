"""Forward-mode engines run recurrent layers off cuDNN, whose ``_cudnn_rnn`` has no
forward-mode rule (found on an H200: ``forward`` on the RNN classifier failed on CUDA and
nowhere else). No GPU here, so the flag is read from inside the model's forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import leangrad
from leangrad.measure import compare_grads, grads_of


class Recorder(nn.Module):
    """An RNN classifier that records ``torch.backends.cudnn.enabled`` at each forward run
    under ``torch.func`` (its weight then a functorch wrapper: a tangent rides on it)."""

    def __init__(self, recurrent: bool) -> None:
        super().__init__()
        self.rnn = nn.RNN(3, 4, batch_first=True) if recurrent else None
        self.fc = nn.Linear(4 if recurrent else 3, 2)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch._C._functorch.is_functorch_wrapped_tensor(self.fc.weight):
            self.seen.append(torch.backends.cudnn.enabled)
        if self.rnn is not None:
            x = self.rnn(x)[0]
        return self.fc(x[:, -1])


@pytest.mark.parametrize("name", ["forward", "projforward"])
def test_recurrent_models_run_off_cudnn_under_forward_mode(name: str) -> None:
    torch.manual_seed(0)
    model = Recorder(recurrent=True).double()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    tf32, bench = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    leangrad.engine(name).backward(model, x, lambda out: out.square().sum())
    assert model.seen and not any(model.seen)
    assert torch.backends.cudnn.enabled  # restored
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark) == (tf32, bench)


def test_models_without_recurrent_layers_keep_cudnn() -> None:
    model = Recorder(recurrent=False).double()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    leangrad.engine("forward").backward(model, x, lambda out: out.square().sum())
    assert model.seen and all(model.seen)


def test_forward_on_a_recurrent_model_still_matches_autograd() -> None:
    torch.manual_seed(0)
    model = Recorder(recurrent=True).double()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    model(x).square().sum().backward()
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    leangrad.engine("forward").backward(model, x, lambda out: out.square().sum())
    assert compare_grads(grads_of(model), want).max_rel_err <= 1e-12
