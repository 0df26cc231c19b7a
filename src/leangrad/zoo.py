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
- :func:`bert`: a BERT-style post-LN encoder (Devlin et al. 2019): attention → residual →
  LayerNorm, GELU MLP → residual → LayerNorm, bidirectional, a classifier on the first
  token.
- :func:`rnn_lm`: a character language model over ``nn.LSTM`` or ``nn.GRU`` (PyTorch's
  fused kernels), 2 layers by default; :func:`highway_gru_lm` is the same GRU LM as a
  :class:`leangrad.highway.HighwayNet` (what the ``highway`` engine needs: leangrad's
  ``GRULayer``, same equations and gate order as ``nn.GRU``, one step at a time).
- :func:`vit`: a ViT-tiny-style vision transformer (Dosovitskiy et al. 2021): patch
  embedding, a class token, pre-LN encoder blocks, a linear head.

:data:`MODELS` names each with a matching offline batch (:func:`batch`): images from a
seeded generator, tokens from a seeded generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BERT",
    "GPT",
    "MODELS",
    "RNNLM",
    "BasicBlock",
    "EncoderBlock",
    "GPTBlock",
    "ResNet",
    "ViT",
    "batch",
    "bert",
    "gpt",
    "highway_gru_lm",
    "resnet",
    "rnn_lm",
    "vit",
]


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


def _attention(qkv: nn.Linear, proj: nn.Linear, heads: int, x: torch.Tensor, *,
               causal: bool) -> torch.Tensor:  # fmt: skip
    """Multi-head self-attention written out (scores, softmax, weighted sum)."""
    b, t, d = x.shape
    q, k, v = qkv(x).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // heads)
    if causal:
        mask = torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1)  # fx-traceable
        scores = scores.masked_fill(mask, float("-inf"))
    return proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


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
        return _attention(self.qkv, self.proj, self.heads, x, causal=True)

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
        torch._assert(t <= self.pos.shape[0], "the sequence is longer than the context")
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


class EncoderBlock(nn.Module):
    """A transformer encoder block, post-LN (BERT) or pre-LN (ViT), bidirectional."""

    def __init__(self, dim: int, heads: int, *, post_ln: bool) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads, self.post_ln = heads, post_ln
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_ln:
            x = self.ln1(x + _attention(self.qkv, self.proj, self.heads, x, causal=False))
            return self.ln2(x + self.mlp(x))
        x = x + _attention(self.qkv, self.proj, self.heads, self.ln1(x), causal=False)
        return x + self.mlp(self.ln2(x))


class BERT(nn.Module):
    """A BERT-style post-LN encoder classifying a sequence from its first token; input
    token ids ``(N, T)``, output ``(N, classes)``."""

    def __init__(self, *, vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4,
                 context: int = 128, classes: int = 2) -> None:  # fmt: skip
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.ln_emb = nn.LayerNorm(dim)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, post_ln=True) for _ in range(layers))
        self.head = nn.Linear(dim, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.ln_emb(self.tok(idx) + self.pos[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(x[:, 0])


def bert(*, vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4,
         context: int = 128, classes: int = 2) -> BERT:  # fmt: skip
    """A BERT-style encoder (BERT-base is ``dim=768, layers=12, heads=12``)."""
    return BERT(vocab=vocab, dim=dim, layers=layers, heads=heads, context=context,
                classes=classes)  # fmt: skip


class RNNLM(nn.Module):
    """A character language model over PyTorch's fused ``nn.LSTM`` / ``nn.GRU``; input
    token ids ``(N, T)``, output logits ``(N, T, vocab)``."""

    def __init__(self, *, cell: str = "lstm", vocab: int = 128, embed: int = 64,
                 hidden: int = 256, layers: int = 2) -> None:  # fmt: skip
        super().__init__()
        if cell not in ("lstm", "gru"):
            raise ValueError(f"cell must be 'lstm' or 'gru', got {cell!r}")
        self.embed = nn.Embedding(vocab, embed)
        rnn = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = rnn(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(idx))
        return self.head(out)


def rnn_lm(cell: str = "lstm", *, vocab: int = 128, embed: int = 64, hidden: int = 256,
           layers: int = 2) -> RNNLM:  # fmt: skip
    """A 2-layer ``nn.LSTM`` (``cell="lstm"``) or ``nn.GRU`` character LM."""
    return RNNLM(cell=cell, vocab=vocab, embed=embed, hidden=hidden, layers=layers)


class _TimeMajor(nn.Module):
    """(N, T) token ids -> (T, N, embed): the highway GRU layers run time-major."""

    def __init__(self, vocab: int, embed: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed(idx).transpose(0, 1)


class _BatchMajor(nn.Module):
    """(T, N, hidden) -> (N, T, vocab) logits, so the loss matches :class:`RNNLM`'s."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, vocab)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h).transpose(0, 1)


def highway_gru_lm(*, vocab: int = 128, embed: int = 64, hidden: int = 256,
                   layers: int = 2) -> nn.Module:  # fmt: skip
    """:func:`rnn_lm` ("gru") as a :class:`leangrad.highway.HighwayNet`, for the
    ``highway`` engine. What changed: the GRU layers are leangrad's ``GRULayer`` (the
    equations and gate order of ``nn.GRU``, run one step at a time with hand-written
    J-vjps instead of the fused kernel) and run time-major; same inputs and outputs."""
    from .highway import GRULayer, HighwayNet

    stacks = [GRULayer(embed if i == 0 else hidden, hidden) for i in range(layers)]
    return HighwayNet(_TimeMajor(vocab, embed), stacks, _BatchMajor(hidden, vocab))


class ViT(nn.Module):
    """A ViT-style classifier: ``patch`` x ``patch`` patches, a class token, pre-LN encoder
    blocks; input ``(N, in_channels, image, image)``."""

    def __init__(self, *, image: int = 32, patch: int = 4, in_channels: int = 3,
                 dim: int = 192, layers: int = 12, heads: int = 3,
                 classes: int = 10) -> None:  # fmt: skip
        super().__init__()
        if image % patch:
            raise ValueError(f"image ({image}) must be divisible by patch ({patch})")
        self.patch = nn.Conv2d(in_channels, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros((image // patch) ** 2 + 1, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, post_ln=False) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x[:, 0]))


def vit(*, image: int = 32, patch: int = 4, in_channels: int = 3, dim: int = 192,
        layers: int = 12, heads: int = 3, classes: int = 10) -> ViT:  # fmt: skip
    """ViT-tiny's width (192), depth (12) and heads (3) on small images by default."""
    return ViT(image=image, patch=patch, in_channels=in_channels, dim=dim, layers=layers,
               heads=heads, classes=classes)  # fmt: skip


MODELS: dict[str, str] = {
    "resnet": "images",
    "gpt": "tokens",
    "bert": "tokens",
    "lstm_lm": "tokens",
    "gru_lm": "tokens",
    "highway_gru_lm": "tokens",
    "vit": "images",
}
"""Zoo model name -> the kind of data it takes (see :func:`batch`)."""


LossFn = Callable[[torch.Tensor], torch.Tensor]


def batch(name: str, model: nn.Module, size: int, *, length: int = 64, image: int = 32,
          seed: int = 0) -> tuple[torch.Tensor, LossFn]:  # fmt: skip
    """An offline batch for zoo model ``name``: ``(inputs, loss_fn)``.

    Images: ``(size, 3, image, image)`` from a seeded generator, 10 classes. Tokens:
    ``(size, length)`` ids below the model's vocabulary; the loss is next-token
    cross-entropy for language models, the sequence class for BERT.

    Every loss is a mean over examples of equal weight (images and BERT: one class per
    example; language models: cross-entropy over all tokens, ``length`` per example), so
    each is declared with :func:`leangrad.loss.per_example`: an ordinary ``loss_fn`` that
    gradient accumulation (the ``accumulate`` engine) may also split into micro-batches.
    """
    from .loss import per_example

    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(MODELS)}")
    gen = torch.Generator().manual_seed(seed)
    if MODELS[name] == "images":
        x = torch.randn(size, 3, image, image, generator=gen)
        y = torch.randint(0, 10, (size,), generator=gen)
        return x, per_example(F.cross_entropy, y)
    emb = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    idx = torch.randint(0, emb.num_embeddings, (size, length), generator=gen)
    if name == "bert":
        head = model.get_submodule("head")
        assert isinstance(head, nn.Linear), "the zoo's BERT ends in a linear head"
        cls = torch.randint(0, head.out_features, (size,), generator=gen)
        return idx, per_example(F.cross_entropy, cls)
    tgt = torch.randint(0, emb.num_embeddings, (size, length), generator=gen)
    return idx, per_example(_token_ce, tgt)


def _token_ce(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every token of ``(N, T, V)`` logits against ``(N, T)`` ids."""
    return F.cross_entropy(out.flatten(0, 1), tgt.flatten())
