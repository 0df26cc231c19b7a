"""The zoo suite's opt-in timm models (``timm_resnet50``, ``timm_convnext_tiny``,
``timm_vit_small``): built from the suite's sizes, timm's own ``set_grad_checkpointing()``
as the PyTorch-side row, and the hand-written accumulation loop skipped where the model
draws (stochastic depth), for its micro-batches would draw other masks. Quick sizes;
nothing here asserts a time."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("timm")

from leangrad.measure import compare_grads
from leangrad_bench import load_suite
from leangrad_bench._models import TIMM_MODELS, build
from leangrad_bench._zoo_methods import (
    TIMM_CHECKPOINTING,
    call,
    library_checkpointing,
    pytorch_methods,
)


def test_suite_sizes_every_timm_model_and_keeps_them_opt_in() -> None:
    suite = load_suite("zoo")
    for quick in (False, True):
        assert set(suite.setting("timm_models", quick)) == set(TIMM_MODELS)
        assert not set(suite.setting("models", quick)) & set(TIMM_MODELS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["timm_convnext_tiny", "timm_vit_small"])
def test_timm_checkpointing_row_gives_autograds_gradient(name: str) -> None:
    size = {**load_suite("zoo").setting("timm_models", True)[name], "image": 32, "batch": 2}
    wl = build(name, size)
    wl.model.double()
    (x,) = (wl.inputs.double(),) if isinstance(wl.inputs, torch.Tensor) else wl.inputs
    assert library_checkpointing(wl.model) == TIMM_CHECKPOINTING
    methods, skipped = pytorch_methods(wl.model, segments=[2], chunks=[], micro_batches=[2],
                                       loss_fn=wl.loss_fn, inputs=x)  # fmt: skip
    labels = [m.label for m in methods]
    assert labels == ["torch bf16 autocast", TIMM_CHECKPOINTING]
    by_label = {s.label: s.reason for s in skipped}
    # drop path 0.1: a hand-written loop would draw other masks than the whole batch
    assert "draws random numbers" in by_label["torch accumulate(2)"]
    assert "bernoulli_" in by_label[f"{TIMM_CHECKPOINTING} + accumulate(2)"]
    wl.model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    wl.loss_fn(call(wl.model, (x,))).backward()
    ref = {n: p.grad.clone() for n, p in wl.model.named_parameters() if p.grad is not None}
    wl.model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    methods[1].make().backward(wl.model, (x,), wl.loss_fn)
    got = {n: p.grad for n, p in wl.model.named_parameters() if p.grad is not None}
    assert compare_grads(got, ref).max_rel_err <= 1e-9
    assert not any(getattr(m, "grad_checkpointing", False) for m in wl.model.modules()), (
        "the step left checkpointing on")  # fmt: skip


def test_a_timm_model_that_draws_nothing_keeps_the_hand_written_loop() -> None:
    size = {**load_suite("zoo").setting("timm_models", True)["timm_vit_small"],
            "drop_path": 0.0, "image": 32, "batch": 2}  # fmt: skip
    wl = build("timm_vit_small", size)
    methods, _ = pytorch_methods(wl.model, segments=[], chunks=[], micro_batches=[2],
                                 loss_fn=wl.loss_fn, inputs=wl.inputs)  # fmt: skip
    assert "torch accumulate(2)" in [m.label for m in methods]
