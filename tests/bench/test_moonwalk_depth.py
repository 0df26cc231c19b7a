"""moonwalk-v1-depth: pure Moonwalk and Forward equal autograd on the
RevNet it times, the work bound is counted from the model, Forward's timed couplings
average the whole chain, and the suite runs end to end on a tiny config. (No time is
asserted.)"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import leangrad
from leangrad import Chain, EngineInputError, models
from leangrad._errors import OptionError
from leangrad.engines._base import LossFn
from leangrad.measure import compare_grads, grads_of
from leangrad_bench._moonwalk_depth import (
    BAD_SAMPLE,
    _freeze_except,
    render,
    run_depth,
    timed_couplings,
    work_bound,
)
from leangrad_bench._suites import RunSettings, Suite, load_suite


def _revnet(depth: int, *, channels: int = 4, size: int = 4, batch: int = 3,
            dtype: torch.dtype = torch.float64) -> tuple[Chain, torch.Tensor, LossFn]:  # fmt: skip
    torch.manual_seed(depth)
    model = models.revnet(1, channels, 10, blocks=1, layers_per_block=depth).to(dtype)
    x = torch.randn(batch, 1, size, size, dtype=dtype)
    y = torch.randint(0, 10, (batch,))
    return model, x, lambda out: F.cross_entropy(out, y)


def _autograd(model: Chain, x: torch.Tensor, loss_fn: LossFn) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    return grads_of(ref)


@pytest.mark.parametrize("depth", [2, 5])
@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("forward", {"chunk_size": 1024}),
        ("moonwalk", {"mode": "pure", "per_example": True, "chunk_size": 1024}),
        ("moonwalk", {"mode": "pure", "per_example": False, "chunk_size": 7}),
    ],
)
def test_engines_equal_autograd_in_float64(
    depth: int, name: str, options: dict[str, object]
) -> None:
    model, x, loss_fn = _revnet(depth)
    ref = _autograd(model, x, loss_fn)
    leangrad.engine(name, **options).backward(model, x, loss_fn)
    cmp = compare_grads(grads_of(model), ref)
    assert cmp.max_rel_err < 1e-11 and cmp.cosine > 1 - 1e-12


def test_forward_on_the_timed_couplings_is_their_exact_gradient() -> None:
    """What the suite times: Forward with every parameter frozen but those of the timed
    couplings; their gradients are autograd's, the frozen ones get none."""
    model, x, loss_fn = _revnet(6)
    ref = _autograd(model, x, loss_fn)
    keep = timed_couplings(6, 2)
    n = _freeze_except(model, keep)
    leangrad.engine("forward", chunk_size=1024).backward(model, x, loss_fn)
    mine = grads_of(model)
    assert n == sum(g.numel() for g in mine.values()) == 2 * 76  # two couplings' F
    assert {name.split(".")[1] for name in mine} == {str(2 * i) for i in keep}  # coupling, swap
    assert compare_grads(mine, {k: ref[k] for k in mine}).max_rel_err < 1e-11
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_work_bound_counts_p_and_d_from_the_model() -> None:
    """P: every trainable coordinate; d: one example's chain input (the padded image).
    The count by hand for 3 couplings of 4 channels, 4x4 inputs, chunks of 16: each
    coupling's F has two 2->2 3x3 convs (36 weights, 2 biases each)."""
    model, x, _ = _revnet(3)
    wb = work_bound(model, x, forward_chunk=16, moonwalk_chunk=16)
    assert wb.couplings == 3
    assert wb.params == sum(p.numel() for p in model.parameters()) == 3 * 76 + 4 * 10 + 10
    assert wb.input_size == 4 * 4 * 4
    assert wb.bound == pytest.approx(wb.params / (2 * 64))
    # Forward: a coupling i's coordinates cross couplings i..L-1, less the part of i before
    # them: 36 (L-i) + 2 (L-i-1/2) + 36 (L-i-1/2) + 2 (L-i-1); plus one primal pass of
    # the chain per chunk (weights 3 chunks, biases 1; head 3 + 1) and one real forward.
    tangents = sum(36 * (3 - i) + 2 * (2.5 - i) + 36 * (2.5 - i) + 2 * (2 - i) for i in range(3))
    assert wb.forward_passes == pytest.approx(tangents + 3 * (3 * 8 + 4 + 1))
    # Moonwalk: d tangents through every coupling, one primal pass per chunk (4), two real
    # forwards and Phase III's 4.5 passes per coupling.
    assert wb.moonwalk_passes == pytest.approx(3 * (64 + 4 + 2 + 4.5))
    assert wb.counted_ratio == pytest.approx(wb.forward_passes / wb.moonwalk_passes)


@pytest.mark.parametrize("depth", [6, 60])
def test_the_constant_2_is_the_count_of_the_suites_model(depth: int) -> None:
    """On the suite's RevNet (16 channels, 8x8, its chunk sizes) the exact count of passes
    is P/(2d) within (1 + 0.5/L): the 2 is the mean share of the chain a parameter's
    tangent crosses, not a loose constant."""
    torch.manual_seed(0)
    model = models.revnet(1, 16, 10, blocks=1, layers_per_block=depth)
    wb = work_bound(model, torch.zeros(1, 1, 8, 8), forward_chunk=1024,
                    moonwalk_chunk=512)
    assert wb.input_size == 1024 and wb.params == depth * 1168 + 170
    assert 1 <= wb.counted_ratio / wb.bound <= 1 + 0.5 / depth


def test_work_bound_refuses_a_chain_with_downsampling() -> None:
    model = models.revnet(1, 4, 10, blocks=2, layers_per_block=2)
    with pytest.raises(EngineInputError, match="blocks = 1"):
        work_bound(model, torch.zeros(1, 1, 4, 4), forward_chunk=16, moonwalk_chunk=16)


@pytest.mark.parametrize("depth", [6, 7, 12, 24, 60])
@pytest.mark.parametrize("count", [2, 4, 6])
def test_timed_couplings_average_the_whole_chain(depth: int, count: int) -> None:
    keep = timed_couplings(depth, count)
    assert len(keep) == len(set(keep)) == min(count, depth)
    assert all(0 <= i < depth for i in keep)
    assert math.isclose(sum(keep) / len(keep), (depth - 1) / 2)
    assert timed_couplings(depth, 2 * depth) == list(range(depth))


@pytest.mark.parametrize("count", [0, 3, True, "2"])
def test_timed_couplings_refuse_an_odd_or_bad_count(count: object) -> None:
    with pytest.raises(OptionError) as err:
        timed_couplings(12, count)  # type: ignore[arg-type]
    assert str(err.value) == BAD_SAMPLE.format(value=count)


def _tiny() -> Suite:
    suite = load_suite("moonwalk-v1-depth")
    series = [dataclasses.replace(s, quick_values=[2, 4],
                                  config={**s.config, "channels": 4, "size": 4})
              for s in suite.series]  # fmt: skip
    settings = {**suite.settings, "quick_batch": 2, "quick_repeats": 1, "warmup": 0,
                "quick_forward_couplings": 2, "quick_forward_whole": [4],
                "forward_chunk_size": 64, "moonwalk_chunk_size": 32}
    return dataclasses.replace(suite, series=series, settings=settings)


def test_suite_records_and_report_on_a_tiny_config(tmp_path: Path) -> None:
    suite = load_suite("moonwalk-v1-depth")
    suite.check()  # the runner and the report import
    assert suite.resolve_runner() is run_depth and suite.resolve_report() is render
    recs = run_depth(_tiny(), RunSettings(quick=True, progress=False, threads=[1]))
    assert [(r["x"], r["threads"]) for r in recs] == [(2, 1), (4, 1)]
    two, four = recs
    for r in recs:
        model = models.revnet(1, 4, 10, blocks=1, layers_per_block=r["x"])
        assert r["params"] == sum(p.numel() for p in model.parameters())
        assert r["input_size"] == 64 and r["config"]["batch"] == 2
        assert r["bound"] == pytest.approx(r["params"] / 128)
        assert r["speedup"] == pytest.approx(r["forward_seconds"] / r["moonwalk_seconds"])
        assert r["speedup_over_bound"] == pytest.approx(r["speedup"] / r["bound"])
        assert r["moonwalk_seconds"] > 0 and r["forward_measured_seconds"] > 0
        assert r["forward_grad_max_rel_err"] < 1e-5 and r["moonwalk_grad_max_rel_err"] < 1e-5
        assert r["grad_cosine"] > 1 - 1e-6 and "interleaved" in r["timing"]
    # 2 couplings: both timed, nothing frozen, nothing extrapolated.
    assert two["forward_timed_directions"] == two["params"] and not two["forward_extrapolated"]
    assert two["forward_note"] == f"measured on all {two['params']} directions"
    # 4 couplings: timed on 2 of them (1 and 2) and also whole; both are recorded.
    assert four["forward_timed_couplings"] == [1, 2]
    assert four["forward_timed_directions"] == 2 * 76 < four["params"]
    assert four["forward_whole_seconds"] == four["forward_seconds"]
    scaled = four["forward_measured_seconds"] * four["params"] / (2 * 76)
    assert four["forward_extrapolated_seconds"] == pytest.approx(scaled)
    assert four["extrapolation_error"] == pytest.approx(scaled / four["forward_seconds"] - 1)
    assert f"extrapolated from 152 of {four['params']}" in four["forward_note"]
    assert four["forward_whole_grad_max_rel_err"] < 1e-5
    text = "\n".join(render(suite.name, recs, tmp_path, plots=True))
    assert "| couplings | P | d | bound P/(2d) |" in text and "Scaling check at 4" in text
    assert "Targets:" in text and "27×" in text
    assert (tmp_path / "plots" / "moonwalk-v1-depth.png").stat().st_size > 0


def test_suite_extrapolates_when_forward_is_not_timed_whole(tmp_path: Path) -> None:
    suite = _tiny()
    suite = dataclasses.replace(suite, settings={**suite.settings, "quick_forward_whole": []})
    series = [dataclasses.replace(s, quick_values=[4]) for s in suite.series]
    settings = RunSettings(quick=True, progress=False, threads=[1])
    (r,) = run_depth(dataclasses.replace(suite, series=series), settings)
    assert r["forward_extrapolated"] and r["forward_whole_seconds"] is None
    assert r["forward_note"] == f"extrapolated from 152 of {r['params']} directions"
    assert r["forward_seconds"] == pytest.approx(r["forward_measured_seconds"] * r["params"] / 152)
    assert "extrapolated from 152" in "\n".join(render(suite.name, [r], tmp_path, plots=False))
