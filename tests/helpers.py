"""Test helpers: small random problems and the autograd reference every engine is held to."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from leangrad import Chain, models, zoo
from leangrad.layers import AdditiveCoupling, FragmentalConv2d, LeakyReLU, SpaceToDepth, Tanh
from leangrad.loss import per_example

__all__ = [
    "MODEL_KINDS",
    "Problem",
    "StepHead",
    "draw_problem",
    "make_problem",
    "next_token_loss",
    "reference_grads",
    "reference_step",
    "resnet_problem",
    "seeded_autograd",
    "tiny_gpt2",
    "trainable",
]

DEVICE = torch.device(os.environ.get("LEANGRAD_TEST_DEVICE", "cpu"))
"""Where :func:`make_problem` puts its problems: ``LEANGRAD_TEST_DEVICE=cuda`` runs the
reference test of every engine on a GPU (``make bench-gpu``). There TF32 is switched off:
with cuDNN's default TF32 convolutions, float32 gradients of the same step differ by up to
~5e-4 (seen on an H100: ``accumulate`` on the revchain, most likely for that reason) — the
kernel's precision, not the engine's."""
if DEVICE.type == "cuda":
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

MODEL_KINDS = (
    "mlp", "cnn", "conv", "rnn", "revchain", "subcnn", "subcnn_repeat", "frag1d", "frag2d"
)
"""mlp: ``models.mlp``; cnn: ``models.small_cnn`` (8x8 inputs); conv: ``models.conv_stack``
(any spatial size); rnn: ``models.rnn_classifier``; revchain: a :class:`leangrad.Chain` of
invertible layers (couplings, LeakyReLU, ψ, Tanh) behind a 1x1-conv stem; subcnn: a Chain of
channel-triangular stride-2 convs and LeakyReLUs (submersive, not invertible); subcnn_repeat:
the same behind a parameter-free stem (Moonwalk then seeds Phase III with h1, not h0);
frag1d: ``models.fragmental_cnn1d`` (stride-1 'same' convs: not submersive, Moonwalk needs
``fragment=``), lengths not divisible by the block sizes; frag2d: a Chain of
FragmentalConv2d + LeakyReLU behind a parameter-free stem."""


class StepHead(nn.Module):
    """Read a GRU at every step: (steps, batch, 5) -> (steps * batch, 3 classes), the head
    of the HighwayNets the contract and planner tests build."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h).flatten(0, 1)


def _revchain(s: dict[str, int], h: int, w: int) -> nn.Module:
    half = s["channels"]

    def f() -> nn.Module:
        return nn.Sequential(nn.Conv2d(half, half, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(half, half, 1))  # fmt: skip

    return Chain(
        AdditiveCoupling(f()),
        LeakyReLU(0.2),
        SpaceToDepth(2),
        AdditiveCoupling(nn.Sequential(nn.Conv2d(4 * half, 4 * half, 1), nn.Tanh())),
        Tanh(),
        stem=nn.Conv2d(s["in_channels"], 2 * half, 1),
        head=nn.Sequential(nn.Flatten(), nn.Linear(8 * half * (h // 2) * (w // 2), s["classes"])),
    )


def _subcnn(s: dict[str, int], stem: str = "conv") -> nn.Module:
    return models.submersive_cnn(
        s["in_channels"], s["channels"] + 1, s["depth"], s["classes"], stem=stem
    )


def _frag2d(s: dict[str, int]) -> nn.Module:
    ch = s["channels"] + 1
    layers: list[nn.Module] = []
    for _ in range(s["depth"]):
        layers += [FragmentalConv2d(ch, 3), LeakyReLU(0.2)]
    head = nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(ch, s["classes"]))
    return Chain(*layers, stem=models.RepeatChannels(ch), head=head)


@dataclasses.dataclass
class Problem:
    """A model, its inputs and a cross-entropy loss over random targets."""

    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    targets: torch.Tensor

    @property
    def loss_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Cross-entropy over the examples, declared per example (every engine calls it
        as ``loss_fn(out)``; ``accumulate`` also splits the targets with the inputs)."""
        return per_example(F.cross_entropy, self.targets)


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """Named parameters with ``requires_grad``, in registration order."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def make_problem(
    kind: str, dtype: torch.dtype, *, seed: int = 0, sizes: dict[str, int] | None = None
) -> Problem:
    """Build a small ``kind`` problem; ``sizes`` overrides the defaults below."""
    s = {
        "batch": 3, "features": 4, "width": 5, "depth": 2, "classes": 3,
        "channels": 2, "in_channels": 2, "height": 5, "wide": 4, "steps": 3,
    }  # fmt: skip
    s.update(sizes or {})
    torch.manual_seed(seed)
    b, c = s["batch"], s["classes"]
    model: nn.Module
    if kind == "mlp":
        model = models.mlp(s["features"], s["width"], s["depth"], c)
        x = torch.randn(b, s["features"], dtype=torch.float64)
    elif kind == "cnn":
        model = models.small_cnn(c, in_channels=1, channels=s["channels"])
        x = torch.randn(b, 1, 8, 8, dtype=torch.float64)
    elif kind == "conv":
        model = models.conv_stack(s["in_channels"], s["channels"], s["depth"], c)
        x = torch.randn(b, s["in_channels"], s["height"], s["wide"], dtype=torch.float64)
    elif kind == "rnn":
        model = models.rnn_classifier(s["features"], s["width"], c)
        x = torch.randn(b, s["steps"], s["features"], dtype=torch.float64)
    elif kind == "revchain":
        h, w = 2 * ((s["height"] + 1) // 2), 2 * ((s["wide"] + 1) // 2)  # even, for ψ
        model = _revchain(s, h, w)
        x = torch.randn(b, s["in_channels"], h, w, dtype=torch.float64)
    elif kind in ("subcnn", "subcnn_repeat"):
        model = _subcnn(s, "repeat" if kind == "subcnn_repeat" else "conv")
        side = 2 ** s["depth"] * max(1, s["height"] // 2)
        x = torch.randn(b, s["in_channels"], side, side, dtype=torch.float64)
    elif kind == "frag1d":
        model = models.fragmental_cnn1d(s["in_channels"], s["channels"] + 1, s["depth"], c)
        x = torch.randn(b, s["in_channels"], 4 * s["height"] + s["wide"], dtype=torch.float64)
        model.layers[0].bias.requires_grad_(False)  # a frozen parameter inside the chain
    elif kind == "frag2d":
        model = _frag2d(s)
        x = torch.randn(b, s["in_channels"], 2 * s["height"] + 1, s["wide"] + 2,
                        dtype=torch.float64)  # fmt: skip
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    targets = torch.randint(0, c, (b,))
    return Problem(
        model=model.to(DEVICE, dtype), inputs=(x.to(DEVICE, dtype),), targets=targets.to(DEVICE)
    )


def draw_problem(data: st.DataObject, kind: str, dtype: torch.dtype) -> Problem:
    """A ``kind`` problem with sizes and seed drawn by hypothesis (kept small: the
    ``forward`` engine costs one jvp per parameter)."""
    ints: Callable[[int, int], st.SearchStrategy[int]] = st.integers
    sizes = {
        "batch": data.draw(ints(1, 4), label="batch"),
        "features": data.draw(ints(1, 5), label="features"),
        "width": data.draw(ints(1, 6), label="width"),
        "depth": data.draw(ints(1, 3), label="depth"),
        "classes": data.draw(ints(2, 4), label="classes"),
        "channels": data.draw(ints(1, 3), label="channels"),
        "in_channels": data.draw(ints(1, 2), label="in_channels"),
        "height": data.draw(ints(1, 5), label="height"),
        "wide": data.draw(ints(1, 5), label="wide"),
        "steps": data.draw(ints(1, 4), label="steps"),
    }
    seed = data.draw(ints(0, 2**16), label="seed")
    return make_problem(kind, dtype, seed=seed, sizes=sizes)


def reference_grads(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The oracle: loss and ``torch.autograd.grad`` of it w.r.t. the trainable parameters.

    ``autograd.grad`` leaves ``.grad`` untouched, so the model can be reused as is.
    """
    params = trainable(model)
    loss = loss_fn(model(*inputs))
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss.detach(), dict(zip(params, grads, strict=True))


def reference_step(
    model: nn.Module, xs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Autograd's loss and the ``.grad`` its ``backward()`` leaves, by name (those not
    None); the model's ``.grad`` are cleared before and after."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(*xs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def seeded_autograd(
    model: nn.Module, xs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The ``.grad`` autograd leaves from RNG seed 0 (the engine's step draws the same
    dropout masks from it), by name; the model's ``.grad`` are cleared before and after."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks as the engine's step
    loss_fn(model(*xs)).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return ref


def resnet_problem(
    width: int, batch: int, side: int
) -> tuple[nn.Module, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``zoo.resnet(10, width=width)`` (training-mode BatchNorm) from seed 0, a float32
    batch of ``batch`` RGB images ``side`` pixels square and cross-entropy over 10 classes
    (inputs and targets drawn from the global RNG after the model)."""
    torch.manual_seed(0)
    model = zoo.resnet(10, width=width)
    x = torch.randn(batch, 3, side, side)
    y = torch.randint(0, 10, (batch,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    return model, x, loss_fn


def tiny_gpt2(*, dim: int, layers: int, dropout: float = 0.0) -> nn.Module:
    """Hugging Face's ``GPT2LMHeadModel`` from seed 0 (skips without transformers): 2 heads,
    a vocabulary of 64, 16 positions, ``dropout`` everywhere, float64, training mode."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=dim, n_layer=layers, n_head=2, vocab_size=64, n_positions=16,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model: nn.Module = transformers.GPT2LMHeadModel(config).double().train()
    return model


def next_token_loss(ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Cross-entropy of logits ``(batch, length, vocab)`` against the next token of ``ids``."""

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    return loss_fn
