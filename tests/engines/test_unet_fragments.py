"""The zoo U-Net at a quarter of backprop's peak: its stages as checkpointed blocks,
recomputed in fragments of the batch (``checkpoint(blocks=<stages + head>, fragments=k)``,
alone and with ``levels=2``), which the planner offers (:func:`stage_modules`). Held to
autograd: float64 within 1e-10, float32 within 1e-4; GroupNorm couples nothing across the
batch and the attention at low resolution splits along it, so no stage runs whole. The peak
is the tracker's (bytes, deterministic); nothing here asserts a time."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import leangrad
from leangrad import zoo
from leangrad.engines._blocks import blocks
from leangrad.engines.checkpoint._offers import stage_modules
from leangrad.measure import compare_grads, profile_step
from leangrad.planner._plan import candidates

STAGES = ["down.0", "down.1", "down.2", "mid.0", "mid.1", "mid.2", "up.0", "up.1", "up.2", "out"]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def _unet(dtype: torch.dtype = torch.float64) -> zoo.UNet:
    torch.manual_seed(0)
    model = zoo.unet(image=16, widths=(8, 16, 32), groups=4, attention_at=(32,), head_dim=8)
    return model.to(dtype)


def _reference(model: nn.Module, x: torch.Tensor, loss_fn: Any) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_the_unet_stages_keep_its_parameters_and_its_function() -> None:
    """The stages open with the stem and the upsampling (Ronneberger et al.'s layout): the
    parameter count of the layout with the upsampling at the end of the previous stage, and
    its function (that order of calls, written out here)."""
    model = _unet()
    assert sum(p.numel() for p in model.parameters()) == 127179
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    h, skips = model.stem(x), []
    for down in model.down:
        assert isinstance(down, zoo.UNetDown)
        for block in down.blocks:
            h = block(h)
        skips.append(h)
        h = down.resample(h)
    for block in model.mid:
        h = block(h)
    for up in model.up:
        assert isinstance(up, zoo.UNetUp)
        h = torch.cat([up.enter(h), skips.pop()], 1)
        for block in up.blocks:
            h = block(h)
    torch.testing.assert_close(model(x), model.out(h), rtol=0, atol=0)


def test_stage_modules_are_the_unets_stages_and_nothing_elsewhere() -> None:
    model = _unet()
    assert stage_modules(model, blocks(model)) == STAGES[:-1]
    for other in (zoo.resnet(depth=18, width=4), zoo.gpt(vocab=16, dim=8, layers=2, heads=2,
                                                         context=8)):  # fmt: skip
        assert stage_modules(other, blocks(other)) == []


def test_the_planner_offers_the_stages_in_fragments_alone_and_on_two_levels() -> None:
    model = _unet()
    _x, loss_fn = zoo.batch("unet", model, 4, image=16)
    got = candidates(model, exact=True, loss_fn=loss_fn)
    assert ("checkpoint", {"blocks": STAGES, "fragments": 4}) in got
    assert ("checkpoint", {"levels": 2, "blocks": STAGES, "fragments": 4}) in got


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("fragments", [2, 4])
def test_stages_in_fragments_give_autograds_gradients(dtype: torch.dtype, levels: int,
                                                      fragments: int) -> None:  # fmt: skip
    """Every stage and the head split along the batch (GroupNorm normalizes each example
    alone, the attention at the lowest resolution attends within an example), and the
    gradients are autograd's."""
    model = _unet(dtype)
    x, loss_fn = zoo.batch("unet", model, 4, image=16)
    ref = _reference(model, x, loss_fn)
    eng = leangrad.engine("checkpoint", blocks=STAGES, fragments=fragments, levels=levels)
    result = eng.backward(model, x, loss_fn)
    assert result.info["whole"] == {}
    assert result.info["checkpointed"] == len(STAGES)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(ref)
    assert compare_grads(got, ref).max_rel_err <= TOL[dtype]


def test_stages_in_fragments_hold_less_at_the_peak_than_blocks_in_fragments() -> None:
    """The skips and the upsampled maps no longer sit whole beside a fragment: the tracked
    peak of the stages in fragments is below that of the per-block fragments, and two
    levels lower it again."""
    model = _unet(torch.float32)
    x, loss_fn = zoo.batch("unet", model, 4, image=16)

    def peak(**options: Any) -> int:
        eng = leangrad.engine("checkpoint", **options)
        return profile_step(eng, model, x, loss_fn, repeats=0).peak_bytes

    per_block = peak(fragments=4)
    stages = peak(blocks=STAGES, fragments=4)
    two = peak(blocks=STAGES, fragments=4, levels=2)
    assert stages < per_block
    assert two <= stages
