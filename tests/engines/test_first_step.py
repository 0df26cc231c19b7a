"""An engine's first step — where fragments probe each block, ``fragment_blocks=k`` sizes
the blocks on fake tensors and ``segments="auto"`` measures them — leaves nothing alive
once its gradients are dropped, and its tracked peak is its later steps' — with Python's
collector off, so that no garbage cycle is freed by chance before the peak.

Both failed before: the fragments' probe saved its tensors with a pack hook that returned
them, a reference cycle with every output the probe's graph saved, so one example's
activations per block stayed alive for good (the first step's peak 1.1-1.5x the later ones'
on the quick zoo); ``segments="auto"``'s measuring forward kept the same cycle over the
whole batch; the CPU tracker counted the fake tensors of ``fragment_blocks=k``'s sizing
(up to 2.8x on the quick GPT); and making a trace left garbage cycles that reached the
running step's frames, so its block inputs outlived their use (8.9% on the quick BERT with
the collector off).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import leangrad
from leangrad import zoo
from leangrad.measure import MemoryTracker, profile_step

Case = tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]


# warnings about the tiny models are not findings
pytestmark = pytest.mark.filterwarnings("ignore")


def _zoo(name: str, batch: int) -> Case:
    torch.manual_seed(0)
    models: dict[str, Callable[[], nn.Module]] = {
        "gpt": lambda: zoo.gpt(vocab=64, dim=32, layers=2, heads=2, context=16),
        "resnet": lambda: zoo.resnet(10, width=8),
        "unet": lambda: zoo.unet(image=16, widths=(8, 16), groups=4, attention_at=(16,),
                                  head_dim=8),
    }
    model = models[name]()
    x, loss_fn = zoo.batch(name, model, batch, length=12, image=16)
    return model, (x,), loss_fn


def _sequential() -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
                            for _ in range(4)])  # fmt: skip
    x = torch.randn(8, 16)
    target = torch.randn(8, 16)
    return model, (x,), lambda out: ((out - target) ** 2).mean()


CASES: dict[str, tuple[Callable[[], Case], dict[str, Any]]] = {
    "gpt fragments": (lambda: _zoo("gpt", 4), {"fragments": 2}),
    "gpt fragment_blocks": (lambda: _zoo("gpt", 4), {"fragments": 2, "fragment_blocks": 1}),
    "gpt sequence_fragments": (lambda: _zoo("gpt", 1), {"sequence_fragments": 2}),
    "gpt trace": (lambda: _zoo("gpt", 4), {"trace": True}),
    "resnet fragments (BatchNorm)": (lambda: _zoo("resnet", 4), {"fragments": 2}),
    "unet fragments": (lambda: _zoo("unet", 2), {"fragments": 2}),
    "sequential segments=auto": (_sequential, {"segments": "auto"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_step_leaves_nothing_alive(case: str) -> None:
    make, options = CASES[case]
    model, xs, loss_fn = make()
    eng = leangrad.engine("checkpoint", **options)
    with MemoryTracker(baseline=[model, *xs]) as tracker:
        eng.backward(model, xs, loss_fn)
        model.zero_grad(set_to_none=True)
        gc.collect()
        left = tracker.current_bytes()
    assert left == 0, f"{case}: {left} bytes the first step made are still alive"


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_first_step_peaks_where_later_steps_do(case: str) -> None:
    make, options = CASES[case]
    model, xs, loss_fn = make()
    eng = leangrad.engine("checkpoint", **options)
    gc.collect()
    gc.disable()  # garbage cycles would hold what they reach until the collector runs
    try:
        first, second = (profile_step(eng, model, xs, loss_fn, repeats=0, warmup=0).total_bytes
                         for _ in range(2))  # fmt: skip
    finally:
        gc.enable()
    assert first == second, f"{case}: first step {first} bytes, second {second}"
