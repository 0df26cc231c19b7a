"""Small reference models used by the tests, the demo and the benchmark suites.

The plain models are ``nn.Sequential`` of blocks, so every generic engine
(including ``checkpoint``, which segments over blocks) runs on them unchanged;
``revnet`` and ``submersive_cnn`` are :class:`leangrad.Chain` models whose
layers carry the rules ``moonwalk`` and ``revbackprop`` need.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .layers import Chain

__all__ = [
    "GRUSequence",
    "LastStep",
    "PadChannels",
    "RNNLayer",
    "RepeatChannels",
    "ResidualBlock",
    "char_gru_lm",
    "conv_stack",
    "fragmental_cnn1d",
    "fragmental_cnn2d",
    "mlp",
    "revnet",
    "rnn_classifier",
    "small_cnn",
    "small_resnet",
    "submersive_cnn",
]


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


class PadChannels(nn.Module):
    """Zero-pad the channel dimension to ``channels`` (Moonwalk v1: input padded to 32x32x8)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = self.channels - x.shape[1]
        if extra < 0:
            raise ValueError(f"input has {x.shape[1]} channels, more than {self.channels}")
        return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, extra))


class RepeatChannels(nn.Module):
    """Parameter-free channel upsampling: tile the input channels up to ``channels``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reps = -(-self.channels // x.shape[1])
        return x.repeat(1, reps, *([1] * (x.dim() - 2)))[:, : self.channels]


def _coupling_fn(half: int, activation: str, batchnorm: bool) -> nn.Sequential:
    act: nn.Module = nn.Tanh() if activation == "tanh" else nn.ReLU()
    layers: list[nn.Module] = [nn.Conv2d(half, half, 3, padding=1), act]
    if batchnorm:
        layers.append(nn.BatchNorm2d(half))
    layers.append(nn.Conv2d(half, half, 3, padding=1))
    return nn.Sequential(*layers)


def revnet(
    in_channels: int = 1,
    channels: int = 8,
    classes: int = 10,
    *,
    blocks: int = 3,
    layers_per_block: int = 1,
    activation: str = "relu",
    batchnorm: bool = False,
) -> Chain:
    """The Moonwalk v1 RevNet, scaled down: zero-padded input, ``blocks`` blocks of
    additive couplings (F = conv-act-[BN]-conv) that alternate which channel half
    they update (a :class:`~leangrad.layers.SwapHalves` after each coupling, as in
    RevNet), the invertible downsampling ψ between blocks, then average pooling and
    a linear head.

    Returns a :class:`leangrad.Chain` (stem: channel padding, no parameters).
    """
    from .layers import AdditiveCoupling, Chain, SpaceToDepth, SwapHalves

    if activation not in ("relu", "tanh"):
        raise ValueError(f"activation must be 'relu' or 'tanh', got {activation!r}")
    if channels % 2:
        raise ValueError(f"channels must be even (couplings split them in halves), got {channels}")
    layers: list[nn.Module] = []
    c = channels
    for b in range(blocks):
        for _ in range(layers_per_block):
            layers += [AdditiveCoupling(_coupling_fn(c // 2, activation, batchnorm)), SwapHalves()]
        if b < blocks - 1:
            layers.append(SpaceToDepth(2))
            c *= 4
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))
    return Chain(*layers, stem=PadChannels(channels), head=head)


def submersive_cnn(
    in_channels: int = 3,
    channels: int = 16,
    depth: int = 4,
    classes: int = 10,
    *,
    negative_slope: float = 0.1,
    stem: str = "conv",
) -> nn.Module:
    """The Moonwalk v2 2D submersive CNN (section 6.2), scaled down: a stem upsamples the
    channels (``stem="conv"``: a 1x1 conv; ``"repeat"``: parameter-free tiling), then
    ``depth`` x (3x3 stride-2 padding-1 channel-triangular conv + LeakyReLU), then
    global max pooling and a linear head.

    Returns a :class:`leangrad.Chain`. The input's spatial size must be divisible by
    ``2**depth``.
    """
    from .layers import SubmersiveConv2d

    conv = functools.partial(SubmersiveConv2d, channels, channels, 3, stride=2, padding=1)
    return _conv_chain(conv, 2, in_channels, channels, depth, classes, negative_slope, stem)


def _conv_chain(
    conv: Callable[[], nn.Module],
    rank: int,
    in_channels: int,
    channels: int,
    depth: int,
    classes: int,
    negative_slope: float,
    stem: str,
) -> nn.Module:
    """``stem -> depth x (conv() + LeakyReLU) -> global max pool + linear``, as a Chain;
    ``stem="conv"`` is a 1x1 conv, ``"repeat"`` parameter-free channel tiling."""
    from .layers import Chain, LeakyReLU

    if stem not in ("conv", "repeat"):
        raise ValueError(f"stem must be 'conv' or 'repeat', got {stem!r}")
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [conv(), LeakyReLU(negative_slope)]
    conv_nd, pool = (nn.Conv1d, nn.AdaptiveMaxPool1d) if rank == 1 else (nn.Conv2d,
                                                                         nn.AdaptiveMaxPool2d)
    first = conv_nd(in_channels, channels, 1) if stem == "conv" else RepeatChannels(channels)
    head = nn.Sequential(pool(1), nn.Flatten(), nn.Linear(channels, classes))
    return Chain(*layers, stem=first, head=head)


class ResidualBlock(nn.Module):
    """``relu(x + conv(relu(conv(x))))`` with two 3x3 same-size convolutions (He et al. 2016)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.conv2(torch.relu(self.conv1(x))))


def small_resnet(
    in_channels: int = 1, channels: int = 16, blocks: int = 2, classes: int = 10
) -> nn.Sequential:
    """A small ResNet: a 3x3 stem conv, ``blocks`` same-size :class:`ResidualBlock` s
    (no normalisation, so every engine runs on it), global average pool, Linear head.

    An ``nn.Sequential`` of blocks, so ``checkpoint`` segments over residual blocks.
    """
    if blocks < 1:
        raise ValueError(f"blocks must be at least 1, got {blocks}")
    return nn.Sequential(
        _block(nn.Conv2d(in_channels, channels, 3, padding=1), nn.ReLU()),
        *[ResidualBlock(channels) for _ in range(blocks)],
        _block(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)),
    )


class GRUSequence(nn.Module):
    """``nn.GRU`` (batch-first) returning only its output sequence (not a highway
    :class:`leangrad.highway.GRULayer`: this one runs PyTorch's fused kernel)."""

    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[0]


def char_gru_lm(vocab: int, embed: int = 32, hidden: int = 64) -> nn.Sequential:
    """A character-level GRU language model: Embedding, one GRU layer, Linear to logits.

    Takes int64 character ids ``(N, T)`` and returns next-character logits
    ``(N, T, vocab)``; train with cross-entropy over every position.
    """
    if vocab < 2:
        raise ValueError(f"vocab must be at least 2, got {vocab}")
    return nn.Sequential(
        nn.Embedding(vocab, embed), GRUSequence(embed, hidden), nn.Linear(hidden, vocab)
    )


def fragmental_cnn1d(
    in_channels: int = 3,
    channels: int = 64,
    depth: int = 4,
    classes: int = 10,
    *,
    kernel_size: int = 3,
    negative_slope: float = 0.5,
    stem: str = "conv",
) -> nn.Module:
    """The Moonwalk v2 1D network of section 6.3, scaled down: the channel-upsampling stem
    of :func:`submersive_cnn` (``stem="conv"`` or ``"repeat"``), then ``depth`` x
    (length-keeping stride-1 :class:`~leangrad.layers.FragmentalConv1d` + LeakyReLU) — not
    submersive, so Moonwalk needs ``fragment=B`` — then global max pooling and a linear
    head. Returns a :class:`leangrad.Chain`.

    ``negative_slope`` defaults to 0.5, not the usual 0.01–0.1: Moonwalk's Phase III
    divides each cotangent by the LeakyReLU slope, and the rebuild of eq. (20) spreads
    that error along each block, so float32 gradient errors grow roughly like
    ``(c/slope)^depth`` for large blocks (measured, depth 8, B=16, float32: 1.1e-1 at
    slope 0.1, 6e-4 at 0.2, 2.6e-5 at 0.3, 1.3e-6 at 0.5; see the ``fragmental-1d`` suite).
    """
    from .layers import FragmentalConv1d

    conv = functools.partial(FragmentalConv1d, channels, kernel_size)
    return _conv_chain(conv, 1, in_channels, channels, depth, classes, negative_slope, stem)


def fragmental_cnn2d(
    in_channels: int = 3,
    channels: int = 16,
    depth: int = 4,
    classes: int = 10,
    *,
    kernel_size: int = 3,
    negative_slope: float = 0.5,
    stem: str = "conv",
) -> nn.Module:
    """The 2D analogue of :func:`fragmental_cnn1d` (not in the paper): ``depth`` x
    (size-keeping stride-1 :class:`~leangrad.layers.FragmentalConv2d` + LeakyReLU), whose
    fragments are blocks of rows; global max pooling and a linear head. A Chain."""
    from .layers import FragmentalConv2d

    conv = functools.partial(FragmentalConv2d, channels, kernel_size)
    return _conv_chain(conv, 2, in_channels, channels, depth, classes, negative_slope, stem)
