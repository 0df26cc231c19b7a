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
- :func:`llama`: a Llama-style decoder (Touvron et al. 2023): token embedding, ``layers``
  x (RMSNorm → causal self-attention with rotary position embeddings (Su et al. 2021)
  through ``F.scaled_dot_product_attention`` → residual, RMSNorm → SwiGLU MLP (Shazeer
  2020) → residual), final RMSNorm, an untied ``lm_head``; no biases.
- :func:`unet`: a diffusion-style U-Net (Ronneberger et al. 2015; Ho et al. 2020's
  denoiser): conv stem, a down path of ``ResBlock`` (GroupNorm, SiLU, 3x3 conv, twice,
  residual) and, at low resolution, ``AttnBlock`` (self-attention over the feature map's
  positions) with stride-2 downsampling, a middle ResBlock-AttnBlock-ResBlock, an up path
  taking the down path's skips (concatenated) with nearest upsampling, an output conv to
  the input's channels. No timestep embedding: ``forward(x)`` predicts the noise.

:data:`MODELS` names each with a matching offline batch (:func:`batch`): images from a
seeded generator, tokens from a seeded generator (``gpt_50k`` is :func:`gpt` at GPT-2's
50,257-token vocabulary, sized by the caller), noisy images and their noise for the U-Net.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "BERT",
    "GPT",
    "MODELS",
    "RNNLM",
    "AttnBlock",
    "BasicBlock",
    "EncoderBlock",
    "GPTBlock",
    "Llama",
    "LlamaBlock",
    "ResBlock",
    "ResNet",
    "UNet",
    "UNetDown",
    "UNetStage",
    "UNetUp",
    "Upsample",
    "ViT",
    "batch",
    "bert",
    "gpt",
    "highway_gru_lm",
    "llama",
    "resnet",
    "rnn_lm",
    "unet",
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


def _token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position: ``(N, T, V)`` logits against
    ``(N, T)`` ids."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


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

    loss = staticmethod(_token_ce)


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


class _Transposed(nn.Module):
    """``layer(x)`` with its first two dimensions swapped, ``layer`` held as attribute
    ``key``: ``(N, T)`` token ids -> ``(T, N, embed)`` into the highway GRU layers (they
    run time-major), ``(T, N, hidden)`` -> ``(N, T, vocab)`` logits out of them (so the
    loss matches :class:`RNNLM`'s)."""

    def __init__(self, key: str, layer: nn.Module) -> None:
        super().__init__()
        self.key = key
        self.add_module(key, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.key)(x).transpose(0, 1)


def highway_gru_lm(*, vocab: int = 128, embed: int = 64, hidden: int = 256,
                   layers: int = 2) -> nn.Module:  # fmt: skip
    """:func:`rnn_lm` ("gru") as a :class:`leangrad.highway.HighwayNet`, for the
    ``highway`` engine. What changed: the GRU layers are leangrad's ``GRULayer`` (the
    equations and gate order of ``nn.GRU``, run one step at a time with hand-written
    J-vjps instead of the fused kernel) and run time-major; same inputs and outputs."""
    from .highway import GRULayer, HighwayNet

    stacks = [GRULayer(embed if i == 0 else hidden, hidden) for i in range(layers)]
    stem = _Transposed("embed", nn.Embedding(vocab, embed))
    return HighwayNet(stem, stacks, _Transposed("lin", nn.Linear(hidden, vocab)))


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


def _rope(context: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding tables ``(cos, sin)``, each ``(context, head_dim)``: the
    angle of position ``t`` and frequency ``i`` is ``t * base**(-2i / head_dim)``, each
    frequency listed twice (once per half of the head, as :func:`_rotate_half` pairs them)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(context, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], -1)
    return angles.cos().float(), angles.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


class LlamaBlock(nn.Module):
    """A Llama decoder layer: pre-RMSNorm causal self-attention with rotary position
    embeddings (q and k rotated; ``F.scaled_dot_product_attention``), then pre-RMSNorm
    SwiGLU MLP (``down(silu(gate(x)) * up(x))``), each residual, no biases. The rotary
    tables are this block's own buffers, so it is called as ``block(x)``."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, dim: int, heads: int, hidden: int, context: int) -> None:
        super().__init__()
        if dim % heads or (dim // heads) % 2:
            raise ValueError(
                f"dim ({dim}) must be divisible by heads ({heads}) into an even head size"
            )
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-5)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        cos, sin = _rope(context, dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        cos, sin = self.cos[:t].to(q.dtype), self.sin[:t].to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """A Llama-style language model; input token ids ``(N, T)``, output logits
    ``(N, T, vocab)`` (use :meth:`loss` or flatten for cross-entropy)."""

    def __init__(self, *, vocab: int = 32000, dim: int = 128, layers: int = 4, heads: int = 4,
                 context: int = 128, hidden: int | None = None) -> None:  # fmt: skip
        super().__init__()
        hidden = _swiglu_hidden(dim) if hidden is None else hidden
        self.context = context
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads, hidden, context) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        torch._assert(idx.shape[1] <= self.context, "the sequence is longer than the context")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    loss = staticmethod(_token_ce)


def _swiglu_hidden(dim: int, multiple: int = 8) -> int:
    """Llama's SwiGLU width: 2/3 of a 4x MLP (``8/3 * dim``), rounded up to ``multiple``."""
    return multiple * math.ceil(8 * dim / 3 / multiple)


def llama(*, vocab: int = 32000, dim: int = 128, layers: int = 4, heads: int = 4,
          context: int = 128, hidden: int | None = None) -> Llama:  # fmt: skip
    """A Llama-style decoder (Touvron et al. 2023): pre-RMSNorm, rotary position embeddings,
    SwiGLU MLP (``hidden`` defaults to ``8/3 * dim`` rounded up to a multiple of 8), no
    biases, an untied ``lm_head``. Llama-2 7B is ``dim=4096, layers=32, heads=32,
    hidden=11008, context=4096``."""
    return Llama(vocab=vocab, dim=dim, layers=layers, heads=heads, context=context,
                 hidden=hidden)  # fmt: skip


class ResBlock(nn.Module):
    """A diffusion U-Net residual block: GroupNorm, SiLU, 3x3 conv, GroupNorm, SiLU, 3x3
    conv, plus the input (through a 1x1 conv when the channel count changes)."""

    def __init__(self, c_in: int, c_out: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, 1, 1)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1)
        self.skip: nn.Module = nn.Identity() if c_in == c_out else nn.Conv2d(c_in, c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class AttnBlock(nn.Module):
    """Multi-head self-attention over the ``H * W`` positions of a feature map (GroupNorm,
    1x1 q/k/v projection, ``F.scaled_dot_product_attention``, 1x1 output projection),
    residual."""

    def __init__(self, channels: int, groups: int, head_dim: int) -> None:
        super().__init__()
        if channels % head_dim:
            raise ValueError(f"channels ({channels}) must be divisible by head_dim ({head_dim})")
        self.heads = channels // head_dim
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        qkv = self.qkv(self.norm(x)).view(b, 3, self.heads, c // self.heads, h * w)
        q, k, v = qkv.transpose(-2, -1).unbind(1)  # each (b, heads, h * w, head_dim)
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(out.transpose(-2, -1).reshape(b, c, h, w))


class Upsample(nn.Module):
    """Nearest-neighbour 2x upsampling, then a 3x3 conv."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _run_block(block: nn.Module, h: torch.Tensor, checkpointing: bool) -> torch.Tensor:
    """``block(h)``, under ``torch.utils.checkpoint`` (non-reentrant) where asked and grad
    mode is on."""
    if checkpointing and torch.is_grad_enabled():
        out: torch.Tensor = checkpoint(block, h, use_reentrant=False)
        return out
    return block(h)


class UNetStage(nn.Module):
    """One resolution of a :class:`UNet` (Ronneberger et al. 2015's contracting and
    expansive steps): ``enter`` (the stem conv on the first down stage, the
    :class:`Upsample` from the lower resolution on every up stage but the first, else
    ``nn.Identity``), then its ``blocks`` (a :class:`ResBlock`, then an :class:`AttnBlock`
    where attention is on) and, on the down path, ``resample`` (:class:`UNetDown`). A down
    stage returns ``(skip, h)``: the
    blocks' output, which the up path concatenates, and its downsampled ``h``; an up stage
    takes ``(h, skip)`` and returns the blocks' output. Each stage is a function of its
    own, so a stage is a unit checkpointing can recompute whole: its boundaries are the
    low-resolution ``h`` and the skip."""

    blocks: nn.ModuleList
    enter: nn.Module
    checkpointing: bool = False
    """Run each of ``blocks`` under ``torch.utils.checkpoint`` (set by :class:`UNet`)."""

    def __init__(self, blocks: list[nn.Module], enter: nn.Module | None = None) -> None:
        super().__init__()
        self.enter = nn.Identity() if enter is None else enter
        self.blocks = nn.ModuleList(blocks)

    def _blocks(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = _run_block(block, h, self.checkpointing)
        return h


class UNetDown(UNetStage):
    """A down-path :class:`UNetStage`: ``(skip, resample(skip))`` of its input, ``resample``
    a stride-2 conv (``nn.Identity`` at the lowest resolution)."""

    resample: nn.Module

    def __init__(self, blocks: list[nn.Module], resample: nn.Module,
                 enter: nn.Module | None = None) -> None:  # fmt: skip
        super().__init__(blocks, enter)
        self.resample = resample

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        skip = self._blocks(self.enter(h))
        return skip, self.resample(skip)


class UNetUp(UNetStage):
    """An up-path :class:`UNetStage`: its input upsampled (``enter``), the down path's skip
    concatenated along the channels, its blocks."""

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self._blocks(torch.cat([self.enter(h), skip], 1))


class UNet(nn.Module):
    """A diffusion-style U-Net predicting noise; input and output ``(N, in_channels, image,
    image)``. No timestep embedding (``forward(x)`` only): the layers and skips of a
    denoiser, without its conditioning. The stem conv opens the first down stage and each
    up stage but the first opens with its upsampling (:class:`UNetStage`).

    Attributes:
        checkpointing: run every :class:`ResBlock` and :class:`AttnBlock` under
            ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` while grad mode
            is on (what diffusers' ``enable_gradient_checkpointing()`` switches on).
    """

    def __init__(self, *, image: int = 64, in_channels: int = 3,
                 widths: Sequence[int] = (32, 64, 128), groups: int = 8,
                 attention_at: Sequence[int] = (128,), head_dim: int = 32) -> None:  # fmt: skip
        super().__init__()
        widths = tuple(int(w) for w in widths)
        if not widths or any(w % groups for w in widths):
            raise ValueError(f"widths {widths} must be non-empty and divisible by groups "
                             f"({groups})")  # fmt: skip
        if image % 2 ** (len(widths) - 1):
            raise ValueError(f"image ({image}) must be divisible by 2**(len(widths) - 1) = "
                             f"{2 ** (len(widths) - 1)}")  # fmt: skip
        attend = {int(w) for w in attention_at}
        last = len(widths) - 1
        self.in_channels = in_channels
        c = widths[0]
        down: list[UNetStage] = []
        for i, w in enumerate(widths):
            blocks: list[nn.Module] = [ResBlock(c, w, groups)]
            blocks += [AttnBlock(w, groups, head_dim)] if w in attend else []
            resample: nn.Module = nn.Conv2d(w, w, 3, 2, 1) if i < last else nn.Identity()
            stem = nn.Conv2d(in_channels, widths[0], 3, 1, 1) if i == 0 else None
            down.append(UNetDown(blocks, resample, stem))
            c = w
        self.down = nn.ModuleList(down)
        self.mid = nn.ModuleList([ResBlock(c, c, groups), AttnBlock(c, groups, head_dim),
                                  ResBlock(c, c, groups)])  # fmt: skip
        up: list[UNetStage] = []
        for i in reversed(range(len(widths))):
            w = widths[i]
            blocks = [ResBlock(c + w, w, groups)]  # the down path's skip concatenated
            blocks += [AttnBlock(w, groups, head_dim)] if w in attend else []
            up.append(UNetUp(blocks, Upsample(c) if i < last else None))
            c = w
        self.up = nn.ModuleList(up)
        self.out = nn.Sequential(nn.GroupNorm(groups, c), nn.SiLU(),
                                 nn.Conv2d(c, in_channels, 3, 1, 1))  # fmt: skip
        self.checkpointing = False

    @property
    def stem(self) -> nn.Conv2d:
        """The first conv (it opens the first down stage)."""
        stem = cast("UNetStage", self.down[0]).enter
        assert isinstance(stem, nn.Conv2d)
        return stem

    @property
    def checkpointing(self) -> bool:
        return cast("UNetStage", self.down[0]).checkpointing

    @checkpointing.setter
    def checkpointing(self, on: bool) -> None:
        for stage in [*self.down, *self.up]:
            cast("UNetStage", stage).checkpointing = bool(on)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        skips: list[torch.Tensor] = []
        for stage in self.down:
            skip, h = stage(h)
            skips.append(skip)
        for block in self.mid:
            h = _run_block(block, h, self.checkpointing)
        for stage in self.up:
            h = stage(h, skips.pop())
        return self.out(h)


def unet(*, image: int = 64, in_channels: int = 3, widths: Sequence[int] = (32, 64, 128),
         groups: int = 8, attention_at: Sequence[int] = (128,),
         head_dim: int = 32) -> UNet:  # fmt: skip
    """A diffusion U-Net (Ho et al. 2020's DDPM layout, one residual block per resolution):
    a resolution per width, halved between them; attention at the widths in
    ``attention_at`` (the low resolutions) and in the middle; no timestep embedding."""
    return UNet(image=image, in_channels=in_channels, widths=widths, groups=groups,
                attention_at=attention_at, head_dim=head_dim)  # fmt: skip


MODELS: dict[str, str] = {
    "resnet": "images",
    "gpt": "tokens",
    "bert": "tokens",
    "lstm_lm": "tokens",
    "gru_lm": "tokens",
    "highway_gru_lm": "tokens",
    "vit": "images",
    "llama": "tokens",
    "gpt_50k": "tokens",
    "unet": "denoise",
}
"""Zoo model name -> the kind of data it takes (see :func:`batch`)."""


LossFn = Callable[[torch.Tensor], torch.Tensor]


def batch(name: str, model: nn.Module, size: int, *, length: int = 64, image: int = 32,
          seed: int = 0) -> tuple[torch.Tensor, LossFn]:  # fmt: skip
    """An offline batch for zoo model ``name``: ``(inputs, loss_fn)``.

    Images: ``(size, 3, image, image)`` from a seeded generator, 10 classes. Tokens:
    ``(size, length)`` ids below the model's vocabulary; the loss is next-token
    cross-entropy for language models, the sequence class for BERT. Denoise (the U-Net):
    ``(size, in_channels, image, image)`` noisy images and a target of the same shape (the
    noise to predict), both standard normal in the model's dtype; the loss is their mean
    squared error. Everything is drawn on the CPU (the same numbers on every device) and
    placed on the model's device.

    Every loss is a mean over examples of equal weight (images and BERT: one class per
    example; language models: cross-entropy over all tokens, ``length`` per example; the
    U-Net: the squared error over all elements, as many per example), so each is declared
    with :func:`leangrad.loss.per_example`: an ordinary ``loss_fn`` that gradient
    accumulation (the ``accumulate`` engine) may also split into micro-batches.
    """
    from .loss import per_example

    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(MODELS)}")
    gen = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    if MODELS[name] == "denoise":
        assert isinstance(model, UNet), "the zoo's U-Net starts with a conv stem"
        stem = model.stem
        shape = (size, stem.in_channels, image, image)
        x = torch.randn(shape, generator=gen).to(dev, stem.weight.dtype)
        noise = torch.randn(shape, generator=gen).to(dev, stem.weight.dtype)
        return x, per_example(F.mse_loss, noise)
    if MODELS[name] == "images":
        x = torch.randn(size, 3, image, image, generator=gen).to(dev)
        y = torch.randint(0, 10, (size,), generator=gen).to(dev)
        return x, per_example(F.cross_entropy, y)
    emb = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    idx = torch.randint(0, emb.num_embeddings, (size, length), generator=gen).to(dev)
    if name == "bert":
        head = model.get_submodule("head")
        assert isinstance(head, nn.Linear), "the zoo's BERT ends in a linear head"
        cls = torch.randint(0, head.out_features, (size,), generator=gen).to(dev)
        return idx, per_example(F.cross_entropy, cls)
    tgt = torch.randint(0, emb.num_embeddings, (size, length), generator=gen).to(dev)
    return idx, per_example(_token_ce, tgt)
