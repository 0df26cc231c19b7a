"""Small reference models used by the tests, the demo and the benchmark suites.

Each is an ``nn.Sequential`` of blocks, so every engine (including
``checkpoint``, which segments over blocks) runs on it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LastStep", "RNNLayer", "conv_stack", "mlp", "rnn_classifier", "small_cnn"]


def _block(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers)


def mlp(in_features: int, width: int, depth: int, out_features: int) -> nn.Sequential:
    """``depth`` hidden blocks of Linear+ReLU of ``width`` units, then a Linear head.

    Inputs of any shape ``(N, ...)`` are flattened first.
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    blocks: list[nn.Module] = [_block(nn.Flatten(), nn.Linear(in_features, width), nn.ReLU())]
    blocks += [_block(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 1)]
    blocks.append(nn.Linear(width, out_features))
    return nn.Sequential(*blocks)


def conv_stack(
    in_channels: int, channels: int, depth: int, classes: int, *, kernel_size: int = 3
) -> nn.Sequential:
    """A stem conv, ``depth - 1`` same-size Conv+ReLU blocks, global average pool, Linear.

    Spatial size is kept through the stack, so activation memory is linear in depth.
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    pad = kernel_size // 2
    stem = nn.Conv2d(in_channels, channels, kernel_size, padding=pad)
    blocks: list[nn.Module] = [_block(stem, nn.ReLU())]
    blocks += [
        _block(nn.Conv2d(channels, channels, kernel_size, padding=pad), nn.ReLU())
        for _ in range(depth - 1)
    ]
    blocks.append(_block(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)))
    return nn.Sequential(*blocks)


def small_cnn(classes: int = 10, *, in_channels: int = 1, channels: int = 8) -> nn.Sequential:
    """A small CNN for 8x8 digits: two 3x3 convs (the second stride 2), Tanh, Linear head."""
    return nn.Sequential(
        _block(nn.Conv2d(in_channels, channels, 3, padding=1), nn.Tanh()),
        _block(nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1), nn.Tanh()),
        _block(nn.Flatten(), nn.Linear(2 * channels * 16, classes)),
    )


class RNNLayer(nn.Module):
    """``nn.RNN`` (tanh, batch-first) returning only its output sequence."""

    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.rnn = nn.RNN(features, hidden, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


class LastStep(nn.Module):
    """The last time step of a batch-first sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, -1]


def rnn_classifier(features: int, hidden: int, classes: int) -> nn.Sequential:
    """A one-layer tanh RNN over ``(N, T, features)`` and a Linear head on the last step."""
    return nn.Sequential(RNNLayer(features, hidden), LastStep(), nn.Linear(hidden, classes))
