"""Standard architectures written the ordinary way: a class with its own ``forward``, a
stem, repeated blocks, a head — the form a practitioner's model has, not a leangrad
``Chain`` or an ``nn.Sequential``. Plain PyTorch, no downloads; every size is a knob.

- :func:`resnet`: ResNet-18/34-style (He et al. 2016): 3x3 stem, four stages of
  ``BasicBlock`` (two 3x3 conv + BatchNorm, identity or 1x1 projection shortcut),
  global average pooling, a linear head. ``layers=(2, 2, 2, 2)`` is ResNet-18's
  layout and ``(3, 4, 6, 3)`` ResNet-34's; ``width=64`` is theirs.
- :func:`gpt`: a GPT-2-style pre-LN decoder (Radford et al. 2019): token and learned
  position embeddings, ``layers`` x (LayerNorm → causal self-attention → residual,
  LayerNorm → GELU MLP (4x) → residual), final LayerNorm, a linear head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "BasicBlock", "GPTBlock", "ResNet", "gpt", "resnet"]


class BasicBlock(nn.Module):
    """Two 3x3 conv + BatchNorm with a residual shortcut (1x1 projection when the shape
    changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet-style CNN (see the module docstring); input ``(N, in_channels, H, W)``."""

    def __init__(
        self,
        layers: tuple[int, ...] = (2, 2, 2, 2),
        *,
        width: int = 64,
        in_channels: int = 3,
        classes: int = 10,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        stages: list[nn.Module] = []
        c = width
        for i, n in enumerate(layers):
            c_out = width * 2**i
            blocks = [BasicBlock(c, c_out, 1 if i == 0 else 2)]
            blocks += [BasicBlock(c_out, c_out) for _ in range(n - 1)]
            stages.append(nn.Sequential(*blocks))
            c = c_out
        self.stages = nn.ModuleList(stages)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet(
    depth: int = 18, *, width: int = 64, in_channels: int = 3, classes: int = 10
) -> ResNet:
    """ResNet-18 (``depth=18``) or -34 (``depth=34``) layout at any ``width``; ``depth=10``
    is one block per stage (a small test size)."""
    layouts = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}
    if depth not in layouts:
        raise ValueError(f"depth must be one of {sorted(layouts)}, got {depth!r}")
    return ResNet(layouts[depth], width=width, in_channels=in_channels, classes=classes)


class GPTBlock(nn.Module):
    """Pre-LN transformer block: causal self-attention and a GELU MLP, each residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(causal, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-style language model; input token ids ``(N, T)``, output logits
    ``(N, T, vocab)`` (use :meth:`loss` or flatten for cross-entropy)."""

    def __init__(
        self, *, vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4,
        context: int = 128,
    ) -> None:  # fmt: skip
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.pos.shape[0]:
            raise ValueError(f"sequence length {t} exceeds the context {self.pos.shape[0]}")
        x = self.tok(idx) + self.pos[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over every position."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt(*, vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4,
        context: int = 128) -> GPT:  # fmt: skip
    """A GPT-2-style model (GPT-2 small is ``dim=768, layers=12, heads=12, context=1024``)."""
    return GPT(vocab=vocab, dim=dim, layers=layers, heads=heads, context=context)
