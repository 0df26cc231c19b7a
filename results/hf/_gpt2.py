"""The GPT-2 both scripts here step: at its vocabulary (50,257; random weights from seed 0,
built offline, dropout off) with a batch of random token ids (seed 0)."""

from __future__ import annotations

import torch

import leangrad.hf as hf

SIZE = {"vocab": 50257, "dim": 256, "layers": 4, "heads": 4, "context": 128}
BATCH, LENGTH = 4, 128
MODEL = f"GPT-2 (transformers) {SIZE}, batch {BATCH} x {LENGTH}, float32"
"""The report's ``model``."""


def gpt2_and_ids() -> tuple[torch.nn.Module, torch.Tensor]:
    model = hf.gpt2(**SIZE, seed=0, dropout=0.0)
    gen = torch.Generator().manual_seed(0)
    return model, torch.randint(0, SIZE["vocab"], (BATCH, LENGTH), generator=gen)
