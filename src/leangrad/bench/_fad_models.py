"""Tiny CPU-sized models for the ``fad`` suite: a ResNet-style CNN and a BERT-style encoder
(paper section V-A: ResNet-50 and BERT-base, scaled down) whose activations are written
out of primitives (Table I), so autograd saves their intermediates unless FAD nests them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ACTIVATIONS", "Act", "ActEncoder", "ActResNet", "fad_model", "set_recompute"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def swish(x: Tensor) -> Tensor:
    """``x * sigmoid(x)`` (Table I)."""
    return x * torch.sigmoid(x)


def gelu_tanh(x: Tensor) -> Tensor:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (Table I)."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def mish(x: Tensor) -> Tensor:
    """``x * tanh(softplus(x))`` (Table I)."""
    return x * torch.tanh(F.softplus(x))


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "swish": swish,
    "gelu": gelu_tanh,
    "mish": mish,
}


class Act(nn.Module):
    """A composite activation; ``recompute=True`` wraps it in ``torch.utils.checkpoint``
    (the paper's recomputation baseline: keep the input, rebuild intermediates in backward)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fn = ACTIVATIONS[name]
        self.recompute = False

    def forward(self, x: Tensor) -> Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self.fn, x, use_reentrant=False)
        return self.fn(x)


def set_recompute(model: nn.Module, on: bool) -> nn.Module:
    for m in model.modules():
        if isinstance(m, Act):
            m.recompute = on
    return model


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, act: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.act1 = Act(act)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.act2 = Act(act)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        out = self.act1(self.bn1(self.conv1(x)))
        return self.act2(self.bn2(self.conv2(out)) + self.short(x))


class ActResNet(nn.Module):
    """Stem conv, ``stages`` stages of ``blocks`` basic blocks (widths c, 2c, ...), head."""

    def __init__(self, *, act: str, channels: int = 16, stages: int = 2, blocks: int = 1,
                 in_channels: int = 3, classes: int = 10) -> None:  # fmt: skip
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(channels), Act(act))  # fmt: skip
        layers: list[nn.Module] = []
        c = channels
        for s in range(stages):
            cout = channels * 2**s
            for b in range(blocks):
                layers.append(_Block(c, cout, 2 if (s > 0 and b == 0) else 1, act))
                c = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.layers(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


class _Layer(nn.Module):
    """Post-LN transformer layer as in BERT: attention, add & norm, FFN with activation."""

    def __init__(self, d: int, heads: int, act: str) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, 4 * d)
        self.act = Act(act)
        self.ff2 = nn.Linear(4 * d, d)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        dh = d // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, dh).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(dh), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = self.ln1(x + self.proj(y))
        return self.ln2(x + self.ff2(self.act(self.ff1(x))))


class ActEncoder(nn.Module):
    """Token + position embeddings, ``layers`` post-LN layers, mean-pool, linear head."""

    def __init__(self, *, act: str, d: int = 64, heads: int = 4, layers: int = 2,
                 vocab: int = 128, seq: int = 32, classes: int = 2) -> None:  # fmt: skip
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.layers = nn.Sequential(*[_Layer(d, heads, act) for _ in range(layers)])
        self.head = nn.Linear(d, classes)

    def forward(self, ids: Tensor) -> Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.layers(self.tok(ids) + self.pos(pos))
        return self.head(h.mean(dim=1))


Batch = Callable[[int, torch.Generator], tuple[Tensor, Tensor]]


def fad_model(kind: str, act: str, size: dict[str, int]) -> tuple[nn.Module, Batch]:
    """The model and a batch maker ``make(batch, generator) -> (inputs, targets)``."""
    if kind == "resnet":
        model: nn.Module = ActResNet(
            act=act,
            channels=size.get("channels", 16),
            stages=size.get("stages", 2),
            blocks=size.get("blocks", 1),
        )
        side = size.get("side", 16)

        def make(b: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
            x = torch.randn(b, 3, side, side, generator=gen)
            return x, torch.randint(0, 10, (b,), generator=gen)

        return model, make
    if kind == "bert":
        seq = size.get("seq", 32)
        model = ActEncoder(act=act, d=size.get("d", 64), heads=size.get("heads", 4),
                        layers=size.get("layers", 2), seq=seq)  # fmt: skip

        def make_ids(b: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
            ids = torch.randint(0, 128, (b, seq), generator=gen)
            return ids, torch.randint(0, 2, (b,), generator=gen)

        return model, make_ids
    raise ValueError(f"fad suite model must be 'resnet' or 'bert', got {kind!r}")
