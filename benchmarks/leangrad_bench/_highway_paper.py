"""Paper-only code of the Highway-BP suites: the models and data of the
Highway-BP paper's experiments, as :mod:`leangrad_bench._highway`'s runners train them.

- :func:`char_corpus`, :func:`lm_windows`, :func:`lm_loss` — character-level language
  modelling on the Python standard library's own ``.py`` sources (a loss at every step).
- :func:`char_lm` — embedding -> GRU/LSTM layers -> linear head (Table 3/6, Figs. 2, 4-6);
  :class:`TorchLM` the same with ``nn.GRU``/``nn.LSTM`` and the same weights (the peer).
- :func:`preact_resnet` — a pre-activation ResNet for the 8x8 digits (Figs. 2, 4-6).
- :func:`gpt_char_lm` — a GPT-2-style (pre-LN) or RoBERTa-style (post-LN) character
  transformer (Table 2, Fig. 3, Appendix C.3 eq. 17-23).
"""

from __future__ import annotations

import copy
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from leangrad._errors import OptionError
from leangrad.highway import (
    GRULayer,
    HighwayNet,
    LSTMLayer,
    PostLNSublayer,
    PreActBlock,
    PreLNSublayer,
    ResidualStack,
)

__all__ = [
    "BAD_NORM", "PAPER_GAMMA", "Batch", "TorchLM", "char_corpus", "char_lm", "gpt_char_lm",
    "lm_loss", "lm_windows", "preact_resnet",
]  # fmt: skip

BAD_NORM = (
    "gpt_char_lm: norm must be 'pre' (GPT-2, LayerNorm before each sublayer, eq. 17) or "
    "'post' (RoBERTa, LayerNorm after each residual add, eq. 23), got {value!r}"
)
PAPER_GAMMA = {"pre": 0.2, "post": 0.8}
"""The γ of the residual split the paper used (Appendix C.3): 0.2 for GPT-2 (eq. 17),
0.8 for RoBERTa (eq. 23)."""

Batch = tuple[tuple[torch.Tensor, ...], Callable[[torch.Tensor], torch.Tensor]]
"""One training batch: the model's inputs and the loss of its output."""


# --- character-level language modelling ------------------------------------------------


def char_corpus(max_chars: int, *, vocab: int = 96) -> tuple[torch.Tensor, int]:
    """Characters of the Python standard library's ``.py`` files (sorted paths, from
    ``sysconfig.get_paths()["stdlib"]``), the ``vocab − 1`` most common mapped to ids and
    every other character to one "unknown" id. Returns ``(ids, vocab)``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if total == 0:
        raise FileNotFoundError(f"no readable .py files under the standard library at {root}")
    text = "".join(parts)[:max_chars]
    common = [c for c, _ in Counter(text).most_common(vocab - 1)]
    table = {c: i for i, c in enumerate(common)}
    ids = torch.tensor([table.get(c, vocab - 1) for c in text], dtype=torch.long)
    return ids, vocab


def lm_loss(targets: torch.Tensor, vocab: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Mean next-character cross-entropy over every step (a loss at every step, section 3)."""

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, vocab), targets.reshape(-1))

    return loss_fn


def lm_windows(ids: torch.Tensor, vocab: int, length: int, batch: int, seed: int, *,
               batch_first: bool = False) -> Iterator[Batch]:  # fmt: skip
    """Random windows of ``ids`` (starts drawn from generator ``seed``) and their
    next-character loss, forever: tokens time-major ``(length, batch)``, or
    ``(batch, length)`` when ``batch_first``."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=gen)
        win = torch.stack([ids[s : s + length + 1] for s in starts.tolist()], 1)
        x, y = win[:-1], win[1:]
        if batch_first:
            x, y = x.t().contiguous(), y.t().contiguous()
        yield (x,), lm_loss(y, vocab)


def char_lm(cell: str, vocab: int, hidden: int, layers: int = 1) -> HighwayNet:
    """Embedding -> ``layers`` GRU/LSTM layers (residuals between them) -> linear head."""
    cls = GRULayer if cell == "gru" else LSTMLayer
    stacks = [cls(hidden, hidden, residual=i > 0) for i in range(layers)]
    return HighwayNet(nn.Embedding(vocab, hidden), stacks, nn.Linear(hidden, vocab))


class TorchLM(nn.Module):
    """A one-layer :func:`char_lm` with ``nn.GRU``/``nn.LSTM``, its weights copied."""

    def __init__(self, net: HighwayNet, cell: str) -> None:
        super().__init__()
        layer = net.stacks[0]
        cls = nn.GRU if cell == "gru" else nn.LSTM
        assert net.stem is not None and net.head is not None, "char_lm has both"
        self.stem: nn.Module = copy.deepcopy(net.stem)
        self.head: nn.Module = copy.deepcopy(net.head)
        self.rnn = cls(layer.input_size, layer.hidden_size)
        with torch.no_grad():
            for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(self.rnn, f"{n}_l0").copy_(getattr(layer, n))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.stem(tokens))[0])

    @staticmethod
    def renamed(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The :func:`char_lm`'s gradients (same order) under this model's parameter names."""
        return {f"rnn.{n[len('stacks.0.'):]}_l0" if n.startswith("stacks.0.") else n: g
                for n, g in grads.items()}  # fmt: skip


def preact_resnet(channels: int, blocks: int, classes: int = 10) -> HighwayNet:
    """Pre-activation ResNet for 1x8x8 digits: conv stem -> ``blocks`` PreActBlocks ->
    BN-ReLU-average pool-linear head (K = I in every block, eq. 14)."""
    head = nn.Sequential(
        nn.BatchNorm2d(channels), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(channels, classes),
    )  # fmt: skip
    stem = nn.Conv2d(1, channels, 3, padding=1, bias=False)
    return HighwayNet(stem, [ResidualStack([PreActBlock(channels) for _ in range(blocks)])], head)


# --- the GPT-2-style transformer -------------------------------------------------------


class TokenPositionEmbedding(nn.Module):
    """GPT-2's stem: ``wte[tokens] + wpe[positions]`` for batch-first token ids
    ``(batch, tokens)`` -> ``(batch, tokens, d_model)``; both tables ~ N(0, 0.02²)."""

    def __init__(self, vocab: int, d_model: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(context, d_model)
        for table in (self.tokens, self.positions):
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[-1], device=ids.device)
        return self.tokens(ids) + self.positions(pos)


def gpt_char_lm(
    vocab: int,
    *,
    d_model: int = 64,
    layers: int = 4,
    heads: int = 2,
    context: int = 64,
    norm: str = "pre",
    gamma: float | None = None,
) -> HighwayNet:
    """A GPT-2-style character LM written for the highway engine.

    Each of the ``layers`` transformer layers is split into its two sublayers — causal
    self-attention, then a GELU MLP (4·d_model) — each with its own residual, so the
    :class:`~leangrad.highway.ResidualStack` has ``L = 2 · layers`` blocks (the paper's
    L = 24 for 12 layers, section 5.1.1). Residual decomposition (Appendix C.3):

    - ``norm="pre"`` (GPT-2): :class:`~leangrad.highway.PreLNSublayer`,
      ``f(x) = x + Layer(LN(x))`` split as ``g(x) = Layer(LN(x)) + γx``,
      ``r(x, z) = (1 − γ)x + z`` (eq. 17), so ``K = (1 − γ)I`` (scalar); the head is the
      final LayerNorm + a linear layer.
    - ``norm="post"`` (RoBERTa): :class:`~leangrad.highway.PostLNSublayer`,
      ``f(x) = LN(x + Layer(x)) = x ⊙ a(x) + b(x)`` split as ``g = [(1−γ)a, b + γ x⊙a]``,
      ``r(x, z) = x ⊙ z1 + z2`` (eq. 23), so ``K = diag((1 − γ)a)``; every sublayer ends
      in its own LayerNorm, so the head is the linear layer alone.

    The forward value does not depend on γ (backprop's gradient neither); γ only moves
    part of the identity path into ``g``, which Highway-BP's k iterations then have to
    recover: γ = 0 is the plain split (eq. 16, which the paper found to diverge on
    GPT-2), γ = 1 the fixed-point-iteration baseline. ``gamma=None`` takes the paper's
    (:data:`PAPER_GAMMA`: 0.2 pre-LN, 0.8 post-LN).

    Args:
        vocab: characters; d_model: width; layers: transformer layers (2 blocks each);
        heads: attention heads; context: longest sequence (position table size).
        norm: ``"pre"`` or ``"post"``; gamma: the split's γ in [0, 1].

    Inputs are batch-first token ids ``(batch, tokens)``; the output is the logits
    ``(batch, tokens, vocab)``.

    Raises:
        OptionError: ``norm`` is neither ``"pre"`` nor ``"post"``.
    """
    if norm not in PAPER_GAMMA:
        raise OptionError(BAD_NORM.format(value=norm))
    g = PAPER_GAMMA[norm] if gamma is None else gamma
    cls = PreLNSublayer if norm == "pre" else PostLNSublayer
    blocks = [cls(d_model, heads, kind=kind, gamma=g)
              for _ in range(layers) for kind in ("attention", "mlp")]  # fmt: skip
    head: nn.Module = (
        nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, vocab)) if norm == "pre"
        else nn.Linear(d_model, vocab)
    )  # fmt: skip
    stem = TokenPositionEmbedding(vocab, d_model, context)
    return HighwayNet(stem, [ResidualStack(blocks)], head)
