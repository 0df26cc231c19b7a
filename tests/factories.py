"""Model factories written the way a user writes one (``--model factories:resnet``): plain
functions taking their options and ``input_shape`` / ``num_classes`` by keyword."""

from __future__ import annotations

from torch import nn

import leangrad


def resnet(*, input_shape: tuple[int, ...], num_classes: int, width: int = 4) -> nn.Module:
    """A class-based ResNet for (C, H, W) images."""
    return leangrad.zoo.ResNet((1, 1), width=width, in_channels=input_shape[0],
                               classes=num_classes)  # fmt: skip


def gpt(*, input_shape: tuple[int, ...], num_classes: int, layers: int = 2) -> nn.Module:
    """A class-based GPT for (T,) character windows."""
    return leangrad.zoo.gpt(vocab=num_classes, dim=16, layers=layers, heads=2,
                            context=input_shape[0])  # fmt: skip
