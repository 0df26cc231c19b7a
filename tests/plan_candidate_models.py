"""Tiny models whose planner candidates tests/test_plan_candidates.py freezes: the
registered training models, the zoo's, a HighwayNet and leangrad.Chain models."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from helpers import StepHead
from leangrad import zoo
from leangrad.highway import GRULayer, HighwayNet
from leangrad.loss import PerExample, per_example
from leangrad.train._registry import DataInfo, build_model

BATCH = 4
"""Examples in the per-example loss: fragments and micro-batches above it are not offered."""

_IMAGES = DataInfo("images", (3, 16, 16), 10, tokens=False)
_TOKENS = DataInfo("text", (16,), 20, tokens=True)
_VOCAB = DataInfo("text", (16,), 1024, tokens=True)  # a vocabulary-sized head: chunked_ce


def _highway() -> nn.Module:
    return HighwayNet(nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.25)),
                      [GRULayer(5, 5), GRULayer(5, 5)], StepHead())  # fmt: skip


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": lambda: build_model("mlp", _IMAGES),
    "submersive_cnn": lambda: build_model("submersive_cnn", _IMAGES),
    "resnet": lambda: build_model("resnet", _IMAGES),
    "revnet": lambda: build_model("revnet", _IMAGES),
    "gru_lm": lambda: build_model("gru_lm", _TOKENS),
    "zoo_gpt": lambda: zoo.gpt(vocab=64, dim=16, layers=2, heads=2),
    "zoo_gpt_vocab": lambda: zoo.gpt(vocab=1024, dim=16, layers=2, heads=2),
    "gru_lm_vocab": lambda: build_model("gru_lm", _VOCAB),
    "zoo_vit": lambda: zoo.vit(image=8, patch=4, dim=16, layers=2, heads=2),
    "zoo_lstm": lambda: zoo.rnn_lm("lstm", vocab=32, embed=16, hidden=16),
    "zoo_resnet": lambda: zoo.resnet(10, width=4),
    "zoo_unet": lambda: zoo.unet(image=8, widths=(4, 8), groups=2, attention_at=(8,),
                                 head_dim=4),
    "highway": _highway,
}


def loss(per_ex: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``None`` (no loss given) or a cross-entropy declared a mean over ``BATCH`` examples."""
    if not per_ex:
        return None
    made: PerExample = per_example(F.cross_entropy, torch.zeros(BATCH, dtype=torch.long))
    return made
