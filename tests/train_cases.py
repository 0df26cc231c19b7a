"""Settings and helpers shared by the training tests (tests/train/)."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

from leangrad import models

# 128 training examples, 4 steps per epoch: resumes in the tests cross epoch boundaries
SMALL = {"data": "synthetic", "data_options": {"n": 160}, "batch_size": 32, "progress": False,
         "track_memory_every": 0, "plots": False}  # fmt: skip


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


class Trap(nn.Module):
    """An MLP whose forward call number ``at`` returns NaN or sends this process SIGINT
    (calls count training steps and the one test-set evaluation at each epoch end)."""

    def __init__(self, at: int, action: str) -> None:
        super().__init__()
        self.net = models.mlp(64, 16, 1, 10)
        self.at, self.action, self.calls = at, action, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = self.net(x)
        if self.calls == self.at and self.action == "nan":
            out = out * float("nan")
        if self.calls == self.at and self.action == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
        return out
